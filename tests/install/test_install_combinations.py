"""What a user gets from the combination of distributions installed in this environment.

LAYER_BOUNDARY_EXPECT_PLUGINS says what is installed (unset: every plugin). Features whose
plugin is absent must fail with one line naming the distribution, exit status 2.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from layer_boundary.testing import ALL_PLUGINS, expected_plugins

ROOT = Path(__file__).resolve().parents[2]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "layer_boundary", *args], capture_output=True, text=True, timeout=300)


def test_plugins_lists_exactly_what_is_installed():
    data = json.loads(cli("plugins", "--json").stdout)
    names = {p["name"] for p in data["plugins"]}
    assert names == {"core", *expected_plugins()}
    assert all(p["status"] == "ok" for p in data["plugins"])


FEATURES = {
    "cp": ["--attn-cp", "2"],
    "tbo": ["--tbo"],
    "lora": ["--lora", "2"],
}


@pytest.mark.parametrize("plugin", sorted(FEATURES))
def test_a_feature_without_its_plugin_names_the_distribution(plugin):
    if plugin in expected_plugins():
        pytest.skip(f"layer-boundary-{plugin} is installed here")
    # without a model family the run stops first at that (the next test), naming its distribution
    missing = plugin if "models" in expected_plugins() else "models"
    out = cli("run", "--model", "qwen3_moe", "--tp", "2", *FEATURES[plugin])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert f"pip install layer-boundary-{missing}" in lines[0]


@pytest.mark.parametrize("command", [["run"], ["plan"], ["run", "--check", "single", "--tp", "1"]])
def test_without_a_model_family_the_commands_name_the_distribution(command):
    if "models" in expected_plugins():
        pytest.skip("layer-boundary-models is installed here")
    out = cli(*command, "--model", "qwen3")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "pip install layer-boundary-models" in lines[0] and "Traceback" not in out.stderr


def test_models_that_need_a_missing_plugin_name_it():
    if "models" not in expected_plugins():
        pytest.skip("layer-boundary-models is not installed here")
    from layer_boundary._errors import FEATURE_DISTRIBUTIONS
    from layer_boundary_models import families

    def plugin_of(feature):
        return FEATURE_DISTRIBUTIONS[feature].removeprefix("layer-boundary-")

    needy = [f for f in families().values() if any(plugin_of(name) not in expected_plugins() for _, name in f.requires)]
    if not needy:
        pytest.skip("every model's plugins are installed here")
    for fam in needy:
        out = cli("run", "--model", fam.model)
        assert out.returncode == 2, out.stderr
        assert "pip install layer-boundary-" in out.stderr and "Traceback" not in out.stderr


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("plugin", ALL_PLUGINS)
def test_no_plugin_imports_another_plugin(plugin):
    others = {f"layer_boundary_{p}" for p in ALL_PLUGINS if p != plugin}
    for path in (ROOT / "plugins" / plugin).rglob("*.py"):
        assert not (_imports(path) & others), f"{path} imports another plugin"
