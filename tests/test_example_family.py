"""A third party's model family end to end, with no change to layer-boundary.

The example distribution in tests/example_family (Llama, written against `layer_boundary` and
`layer_boundary.plugin` only) is pip-installed from its folder into a throwaway target directory,
found through its entry point, and gets what the reference families get: `layer-boundary run
--check hf` (float64 parity with Hugging Face's LlamaForCausalLM at TP=2, with attention DP),
`plan`, and the static-cache decode `bench decode` times (checked here on the CPU against the
eager run).
"""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
EXAMPLE = Path(__file__).parent / "example_family"
PACKAGE = "layer_boundary_example_family"


@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    """pip-install the example from its folder into a target directory; its path for PYTHONPATH."""
    root = tmp_path_factory.mktemp("example-family")
    source, site = root / "source", root / "site"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
         "--target", str(site), str(source)],
        capture_output=True, text=True,
    )
    if pip.returncode != 0:
        pytest.fail(f"pip could not install the example family:\n{pip.stdout}\n{pip.stderr}")
    return site


def cli(site, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "layer_boundary", *args], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def test_the_example_imports_only_the_public_api():
    for path in (EXAMPLE / PACKAGE).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.startswith("layer_boundary"):
                assert node.module in ("layer_boundary", "layer_boundary.plugin"), (path.name, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("layer_boundary") for a in node.names), path.name


def test_plugins_lists_the_family(example_site):
    data = json.loads(cli(example_site, "plugins", "--json").stdout)
    assert [r["name"] for r in data["records"]["model_families"] if r["plugin"] == "example_family"] == ["example_family.llama"]


@pytest.mark.parametrize(
    "topology, collectives",
    [
        (["--tp", "2"], {"all_reduce@attn_tp": 3, "all_reduce@tp": 3}),  # two sums a layer, three layers
        (["--tp", "2", "--attn-dp", "2"], None),
    ],
    ids=["tp2", "tp2-dp2"],
)
def test_run_checks_the_family_against_hugging_face(example_site, topology, collectives):
    pytest.importorskip("transformers")
    out = cli(example_site, "run", "--model", "llama", *topology, "--dtype", "float64", "--check", "hf", "--decode-steps", "3", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["check"]["passed"] and report["check"]["rel_err"] < 1e-10, report["check"]
    assert report["config"]["model"] == "llama" and report["config"]["architecture"] == "LlamaForCausalLM"
    decode = report["collectives"]["decode_step"]
    assert decode and (collectives is None or decode == collectives), decode


def test_plan_shows_every_boundary_of_the_family(example_site):
    out = cli(example_site, "plan", "--model", "llama", "--tp", "2", "--json")
    assert out.returncode == 0, out.stderr
    boundaries = json.loads(out.stdout)["boundaries"]
    assert [b["label"] for b in boundaries] == [f"layer{i}.{j}:{stage}" for i in range(3) for j, stage in enumerate(("attention", "ffn"))]


def test_a_bad_topology_is_one_line_from_the_family(example_site):
    out = cli(example_site, "run", "--model", "llama", "--tp", "2", "--pp", "2")
    assert out.returncode == 2 and "runs without pipeline stages" in out.stderr and "Traceback" not in out.stderr


def test_a_mistyped_config_field_is_one_line_naming_the_family(example_site):
    raw = {"model_type": "llama", "vocab_size": 128, "hidden_size": "48", "num_hidden_layers": 3, "num_attention_heads": 4,
           "intermediate_size": 96}
    out = cli(example_site, "run", "--model", "llama", "--tp", "2", "--hf-config", json.dumps(raw))
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "llama config: hidden_size must be a positive integer, got '48' (a string)" in lines[0], out.stderr


UNLOADED = """
import sys, torch
sys.path.insert(0, {site!r})
from layer_boundary import Forward, ForwardMode, Parallel
from layer_boundary.plugin import StateDictSource, StepLayout, UnloadedWeightsError
from layer_boundary.cli.families import build, family_config, find_family
item = find_family("llama")
config = family_config(item)
model = build(item, config, Parallel.single(), dtype=torch.float64)
run = lambda: model(torch.arange(4), Forward(Parallel.single(), 4, mode=ForwardMode.EXTEND), StepLayout([0], [4], [0]), model.new_cache())
try:
    run()
    raise SystemExit("an unloaded model ran")
except UnloadedWeightsError as exc:
    print(exc)
item.record.load_weights(model, StateDictSource(item.record.random_weights(config, torch.float64, 3)))
assert torch.isfinite(run()).all()
"""


def test_a_model_without_weights_refuses_a_forward_until_they_load(example_site):
    env = dict(os.environ, PYTHONPATH=str(example_site))
    out = subprocess.run([sys.executable, "-c", UNLOADED.format(site=str(example_site))], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "this llama model has no weights yet" in out.stdout


STATIC = """
import sys, torch
sys.path.insert(0, {site!r})
from layer_boundary import Parallel, prepare_model
from layer_boundary.plugin import StateDictSource, StepLayout
from layer_boundary.cli.families import build, family_config, find_family
from layer_boundary.cli.static_decode import static_decode_step, static_prefill
item = find_family("llama")
config = family_config(item)
model = build(item, config, Parallel.single(), dtype=torch.float64)
item.record.load_weights(model, StateDictSource(item.record.random_weights(config, torch.float64, 3)))
prepare_model(model)
prompts = [torch.randint(0, config.vocab_size, (n,)) for n in (5, 3)]
with torch.inference_mode():
    cache = model.new_static_cache(2, 12)
    static_prefill(model, Parallel.single(), cache, prompts, "cpu")
    ids = torch.tensor([7, 9])
    got = static_decode_step(model, Parallel.single(), cache, ids, None, torch.tensor([5, 3]))
    from layer_boundary import Forward, ForwardMode
    eager = model.new_cache()
    step = StepLayout([0, 1], [5, 3], [0, 0])
    model(torch.cat(prompts), Forward(Parallel.single(), 8, mode=ForwardMode.EXTEND), step, eager)
    want = model(ids, Forward(Parallel.single(), 2, mode=ForwardMode.DECODE), StepLayout([0, 1], [1, 1], [5, 3]), eager)
print(float((got - want).abs().max()))
"""


def test_the_static_cache_decode_step_equals_the_eager_one(example_site):
    env = dict(os.environ, PYTHONPATH=str(example_site))
    out = subprocess.run([sys.executable, "-c", STATIC.format(site=str(example_site))], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) < 1e-12
