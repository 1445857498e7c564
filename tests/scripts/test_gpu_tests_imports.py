"""The GPU tests import inside their functions (so that a CPU machine can collect them), which
hides a name that moved until the GPU machine runs them. Every `from layer_boundary... import`
in a GPU test module must resolve here, on the CPU, where the module imports at all."""

import ast
import importlib
import importlib.util
import pathlib

import pytest

TESTS = pathlib.Path(__file__).resolve().parents[1]
GPU_TEST_FILES = sorted({*TESTS.rglob("test_*_gpu.py"), TESTS / "models" / "test_gpu_ranks.py"})


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("layer_boundary"):
            yield node.lineno, node.module, [alias.name for alias in node.names]


@pytest.mark.parametrize("path", GPU_TEST_FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_every_name_a_gpu_test_imports_exists(path):
    missing = []
    for line, module_name, names in _imports(path):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            # a distribution not installed in this environment, or a plugin module that needs its
            # GPU package (flashinfer, cutlass): nothing to check here
            if exc.name and importlib.util.find_spec(exc.name.split(".")[0]) is None:
                continue
            missing.append(f"line {line}: {module_name}: {exc}")
            continue
        for name in names:
            if name == "*" or hasattr(module, name):
                continue
            try:
                importlib.import_module(f"{module_name}.{name}")
            except ImportError:
                missing.append(f"line {line}: {name} from {module_name}")
    assert not missing, f"{path.name} imports what does not exist: {missing}"
