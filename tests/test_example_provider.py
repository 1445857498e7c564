"""A third-party fusion provider end to end, without touching a model.

The example distribution in tests/example_provider is pip-installed from its folder (into a
throwaway target directory, removed afterwards), found through its entry point, listed by
`layer-boundary plugins` in selection order, passes the contract suite the way its author runs
it, is used by a model run (its calls counted), is switched off by
LAYER_BOUNDARY_DISABLE_PLUGINS, and changes no logit.
"""

import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layer_boundary import Priority, Topology
from layer_boundary.launch import ProcessWorld
from layer_boundary_models import family, model_config
from layer_boundary.cli.runner import RunJob, make_requests, run_rank
from layer_boundary.plugin import get_registry, reset_registry
from layer_boundary.plugin import DISABLE_ENV
from layer_boundary.testing.contract import DEVICE_FREE_CHECKS, FUSION_CHECKS

ROOT = Path(__file__).parents[1]
EXAMPLE = Path(__file__).parent / "example_provider"
RECORD = "example.fused_add_rmsnorm"
TRACE_ENV = "LAYER_BOUNDARY_EXAMPLE_TRACE"
MAX_ROWS_ENV = "LAYER_BOUNDARY_EXAMPLE_MAX_ROWS"


@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    """pip-install the example from its folder into a target directory on sys.path; undo it after."""
    root = tmp_path_factory.mktemp("example-provider")
    source, site = root / "source", root / "site"
    # build from a copy: a build writes build/ and *.egg-info next to the sources
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
         "--target", str(site), str(source)],
        capture_output=True, text=True,
    )
    if pip.returncode != 0:
        pytest.fail(f"pip could not install the example distribution:\n{pip.stdout}\n{pip.stderr}")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    reset_registry()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        for name in [m for m in sys.modules if m.split(".")[0] == "layer_boundary_example"]:
            del sys.modules[name]
        importlib.invalidate_caches()
        reset_registry()
        shutil.rmtree(root)


def _env(site, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (DISABLE_ENV, TRACE_ENV, MAX_ROWS_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def _layer_boundary(site, *args, **env):
    return subprocess.run([sys.executable, "-m", "layer_boundary", *args], capture_output=True, text=True, env=_env(site, **env),
                          timeout=300)


def _calls(trace: Path) -> dict[str, list[str]]:
    """Accepted calls per process, one line each ("<rows> <dtype>")."""
    return {f.name: f.read_text().splitlines() for f in sorted(trace.glob("*.calls"))}


def test_installed_from_its_folder_and_found_through_its_entry_point(example_site):
    registry = get_registry()
    plugin = registry.plugin("example")
    assert plugin is not None and plugin.ok
    assert (plugin.distribution, plugin.version) == ("layer-boundary-example", "0.2.0")
    item = next(i for i in registry.fusion_providers if i.name == RECORD)
    assert item.plugin == "example" and item.priority > Priority.BUILTIN
    assert Path(inspect.getfile(item.record.factory)).is_relative_to(example_site)  # the installed copy, not the sources
    names = [i.name for i in registry.fusion_providers]
    assert names.index(RECORD) < names.index("core.unfused") == len(names) - 1


@pytest.mark.parametrize("disabled", [False, True], ids=["installed", "disabled"])
def test_plugins_cli_lists_it_in_selection_order_until_disabled(example_site, disabled):
    out = _layer_boundary(example_site, "plugins", "--json", **({DISABLE_ENV: "example"} if disabled else {}))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    plugin = {p["name"]: p for p in data["plugins"]}["example"]
    records = data["records"]["fusion_providers"]
    names = [r["name"] for r in records]
    assert [(-r["priority"], r["name"]) for r in records] == sorted((-r["priority"], r["name"]) for r in records)
    assert names[-1] == "core.unfused"
    if disabled:
        assert plugin["status"] == "disabled" and RECORD not in names
    else:
        assert plugin["status"] == "ok" and plugin["distribution"] == "layer-boundary-example"
        mine = records[names.index(RECORD)]
        assert mine["plugin"] == "example" and mine["priority"] == Priority.REFERENCE > Priority.BUILTIN
        assert names.index(RECORD) < names.index("core.unfused")


def test_it_passes_the_contract_suite_the_way_its_author_runs_it(example_site):
    # the author's checkout (the copy pip built from) and their own pytest run; importlib mode
    # leaves sys.path alone, so the package under test is the installed one
    checkout = example_site.parent / "source"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib", "tests"],
                         capture_output=True, text=True, cwd=checkout, env=_env(example_site), timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    per_device = len(FUSION_CHECKS) - len(DEVICE_FREE_CHECKS)
    expected = len(FUSION_CHECKS) + (per_device if torch.cuda.is_available() else 0) + 1  # + the install check
    assert int(re.search(r"(\d+) passed", out.stdout).group(1)) == expected, out.stdout[-2000:]


@pytest.mark.gloo
def test_a_model_run_uses_it_and_still_matches_hugging_face(example_site, tmp_path):
    # max rows 8: the 21-row prefill falls back to the core's path (a runtime decline), the
    # 3-row decode steps go through the example
    out = _layer_boundary(example_site, "run", "--model", "qwen3", "--tp", "2", "--dtype", "float64", "--decode-steps", "4",
                          "--json", **{TRACE_ENV: str(tmp_path), MAX_ROWS_ENV: "8"})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["check"]["passed"] is True and data["check"]["rel_err"] < 1e-10
    assert sum(data["config"]["prompt_lengths"]) > 8 >= data["config"]["batch"]
    # every input that completes a sum: each layer's FFN input, and the attention inputs after
    # the first layer (the FFN's all-reduce deferred to them); the last FFN completes at the final norm
    per_step = 2 * data["config"]["layers"] - 1
    calls = _calls(tmp_path)
    assert len(calls) == 2  # both ranks
    for lines in calls.values():
        assert lines == ["3 torch.float64"] * (per_step * data["config"]["decode_steps"])
    # the run's kernel report names the example at every input it took, with its own call count
    kernels = data["kernels"]
    assert kernels["rank"] == 0 and kernels["ranks_differ"] == [] and kernels["counting"].startswith("eager")
    taken = [b for b in kernels["boundaries"] if b["candidates"]]
    assert len(taken) == per_step
    for b in taken:
        assert {"candidate": RECORD, "plugin": "example"} in b["providers"]["chosen"]
        mine = next(c for c in b["candidates"] if c["candidate"] == "example.fused_add_rmsnorm")
        assert mine == {"candidate": "example.fused_add_rmsnorm", "plugin": "example", "accepted": data["config"]["decode_steps"],
                        "declined": 1}  # the prefill's rows are above its cap
    assert sum(c["accepted"] for b in taken for c in b["candidates"] if c["plugin"] == "example") == len(next(iter(calls.values())))


def _job(tmp_path) -> RunJob:
    config = model_config("qwen3")
    weights = tmp_path / "weights.pt"
    torch.save(family("qwen3").random_weights(config, torch.float64, 0), weights)
    prompts, decode = make_requests(config.vocab_size, 3, 7, 2, 0)
    return RunJob(model="qwen3", hf_config=dict(config.hf), topology=Topology(tp=2), reduction="ar", dtype="float64",
                  weights=str(weights), prompts=prompts, decode_tokens=decode)


@pytest.mark.gloo
def test_it_changes_no_logit_and_disabling_it_removes_it(example_site, tmp_path):
    job = _job(tmp_path)
    logits, calls = {}, {}
    for disabled in (False, True):
        trace = tmp_path / ("disabled" if disabled else "installed")
        trace.mkdir()
        env = {TRACE_ENV: str(trace), **({DISABLE_ENV: "example"} if disabled else {})}
        with ProcessWorld(2, env=env) as world:  # ranks see the installed example through sys.path
            results = world.run(run_rank, Topology(tp=2), job)
        logits[disabled] = results[0]["logits"]
        calls[disabled] = _calls(trace)
    steps = 1 + len(job.decode_tokens)
    per_step = 2 * model_config("qwen3").num_layers - 1
    assert [len(lines) for lines in calls[False].values()] == [steps * per_step] * 2
    assert calls[True] == {}
    assert logits[False].keys() == logits[True].keys() and logits[False]
    for request, steps_logits in logits[False].items():
        for ours, unfused in zip(steps_logits, logits[True][request], strict=True):
            assert torch.equal(ours, unfused)  # the same float64 operations as the core's add + RMSNorm
