"""The layers of the repository and who may import whom (docs/architecture.md draws them):

- the library (everything in core/layer_boundary but the command line `cli/`, the benchmarks
  `bench/` and `__main__`; the plugin API and the testing kit included) imports neither the
  command line, the benchmarks nor any model family, by statement or by name (importlib, lazy);
- the command line and the benchmarks find model families through the registry only;
- the core has no import circle, and nothing in it imports the plugin API (`layer_boundary.plugin`
  only re-exports);
- plugins (every folder under plugins/, the reference model families included) import only
  `layer_boundary`, `layer_boundary.plugin` and the documented testing modules, and only names
  those export;
- a fresh interpreter that builds stages and runs forwards with `layer_boundary` alone loads no
  command-line, benchmark or model module.

Imports are read from the source (`ast`): module-level and function-level statements, and the
module names passed as strings to `importlib.import_module`, `lazy("module:attr")` and
`Benchmark.of_module`. Only `if TYPE_CHECKING:` blocks are skipped: they never run.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import layer_boundary
from layer_boundary import plugin as api

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"
TOOLS = ("layer_boundary.cli", "layer_boundary.bench", "layer_boundary.__main__")
MODELS = ("layer_boundary_models", "layer_boundary.models")
#: what a plugin may import of the core (docs/plugins.md)
PLUGIN_API = {
    "layer_boundary": set(layer_boundary.__all__) | {"residual_batch"},
    "layer_boundary.plugin": set(api.__all__),
    "layer_boundary.testing": None,
    "layer_boundary.testing.contract": None,
    "layer_boundary.testing.pytest_plugin": None,
}


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _reaches(target: str, names: tuple, prefixes) -> bool:
    """Whether an import of `names` from `target` reaches a module under `prefixes` (the names
    may be submodules: `from layer_boundary import cli`)."""
    return _under(target, prefixes) or any(_under(f"{target}.{n}", prefixes) for n in names)


def _module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_nodes(tree) -> set:
    """The nodes inside `if TYPE_CHECKING:` blocks (never executed)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


_BY_NAME = {"import_module", "lazy", "of_module"}


def imports(path: Path, module: str) -> list[tuple[str, tuple]]:
    """(imported module, names taken from it) for every import of `path` (the module `module`),
    relative imports resolved."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _BY_NAME:
                out.append((node.args[0].value.partition(":")[0], ()))
    return out


def _core_modules() -> dict[str, Path]:
    return {_module_of(p, CORE): p for p in sorted((CORE / "layer_boundary").rglob("*.py"))}


def _edges() -> dict[str, set[str]]:
    """Module -> the core modules it imports (a name that is not a module maps to its package)."""
    modules = _core_modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for target, names in imports(path, module):
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            edges[module].update(m for m in submodules if m != module)
            if names and len(submodules) == len(names):
                continue  # `from pkg import submodule`: the submodules are the edges
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                edges[module].add(target)
    return edges


def test_the_library_imports_no_tool_and_no_model_family():
    offenders = []
    for module, path in _core_modules().items():
        if _under(module, TOOLS):
            continue
        for target, names in imports(path, module):
            if _reaches(target, names, TOOLS + MODELS):
                offenders.append(f"{module} imports {target} {names}")
    assert not offenders, "\n".join(offenders)


def test_the_tools_reach_model_families_only_through_the_registry():
    offenders = []
    for module, path in _core_modules().items():
        for target, names in imports(path, module):
            if _reaches(target, names, MODELS):
                offenders.append(f"{module} imports {target} {names}")
    assert not offenders, "\n".join(offenders)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_core_has_no_import_circle():
    assert _circles(_edges()) == []


def test_a_circle_is_found_where_there_is_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_in_the_core_imports_the_plugin_api_it_reexports():
    importers = sorted(m for m, targets in _edges().items() if "layer_boundary.plugin" in targets)
    allowed = [m for m in importers if _under(m, TOOLS) or m.startswith("layer_boundary.testing")]
    assert importers == allowed, importers


def test_plugins_import_only_the_plugin_api_and_only_names_it_exports():
    offenders = []
    for folder in sorted(p for p in (ROOT / "plugins").iterdir() if p.is_dir()):
        for path in sorted(folder.rglob("*.py")):
            if ".egg-info" in str(path):
                continue
            for target, names in imports(path, _module_of(path, folder)):
                if target.split(".")[0] != "layer_boundary":
                    continue
                where = f"{path.relative_to(ROOT)}: {target}"
                if target not in PLUGIN_API:
                    offenders.append(f"{where} is not the plugin API")
                    continue
                exported = PLUGIN_API[target]
                hidden = [n for n in names if n.startswith("_") or (exported is not None and n not in exported)]
                if hidden:
                    offenders.append(f"{where}: {hidden} are not exported")
    assert not offenders, "\n".join(offenders)


def test_one_module_asks_records_for_their_factories():
    """`record.factory(...)` (and `norm_factory`) is called by the selection rule only."""
    callers = []
    for root in (CORE, ROOT / "plugins"):
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                owner = node.func.value
                owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if node.func.attr in ("factory", "norm_factory") and owner_name == "record":
                    callers.append(str(path.relative_to(ROOT)))
    assert callers == [], callers


FRESH = textwrap.dedent(
    """
    import json, sys
    import torch
    from layer_boundary import Forward, Parallel, RMSNorm, declare_attn, declare_ffn, layer_stack, make_stages
    from layer_boundary import prepare_model, release_model, residual_batch

    parallel = Parallel.single()
    with layer_stack(parallel, reduction="ar"):
        layers = [make_stages((declare_attn(), RMSNorm(8)), (declare_ffn(), RMSNorm(8)),
                              previous=declare_ffn() if i else None, terminal=i == 1, label=f"l{i}") for i in range(2)]
    module = torch.nn.Module()
    module.norms = torch.nn.ModuleList(stage.plan.norm for pair in layers for stage in pair)
    prepare_model(module)
    with torch.inference_mode():
        for tokens in (5, 1):
            fwd = Forward(parallel, tokens)
            residual_batch.start(fwd)
            h = torch.randn(tokens, 8)
            for attn, ffn in layers:
                h = attn.finish(attn.prepare(h, fwd) * 0.5, fwd)
                h = ffn.prepare(h, fwd)
                with ffn.exit(fwd) as out:
                    y = h * 2
                h = out.finish(y)
            h = residual_batch.norm(h, fwd, RMSNorm(8))
    release_model(module)
    print(json.dumps(sorted(sys.modules)))
    """
)


def test_a_forward_with_the_library_alone_loads_no_tool_and_no_model_code():
    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    # an installed family distribution's registration module is loaded with the registry: it
    # names its code lazily, so that is all of it
    registration = {"layer_boundary_models", "layer_boundary_models.plugin"}
    found = [m for m in loaded if _under(m, TOOLS + MODELS) and m not in registration]
    assert found == [], found
    assert "layer_boundary" in loaded


@pytest.mark.parametrize("module", ["layer_boundary.cli.main", "layer_boundary.bench.host", "layer_boundary_models.building"])
def test_the_fresh_interpreter_check_would_see_a_tool_or_model_module(module):
    """The check above reads sys.modules after the run: importing a tool shows there."""
    probe = FRESH.replace("print(json.dumps", f"import {module}\nprint(json.dumps")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    if out.returncode and "No module named 'layer_boundary_models'" in out.stderr:
        pytest.skip("layer-boundary-models is not installed here")
    assert out.returncode == 0, out.stderr
    assert module in json.loads(out.stdout)
