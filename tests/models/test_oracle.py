"""The Hugging Face oracle on every supported transformers release: each reference family at TP 2
through prefill and three decode steps against it in float64; a decode step that loses its cache
fails (the comparison, and the driver before it); the supported range is declared once and a
release outside it is refused in one line before any rank starts.

Marked `oracle`: scripts/test_matrix.py runs these on the lowest and the highest supported
transformers as well as on the pinned one.
"""

import importlib.util
import types
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
from packaging.version import Version

from layer_boundary import Topology
from layer_boundary.cli import oracle, run_cmd
from layer_boundary.cli.main import main
from layer_boundary.cli.oracle import OracleError, cache_keyword, hf_from_state, hf_logits, reference_of
from layer_boundary.cli.runner import run_rank
from layer_boundary.testing import requires_plugins
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_models import families, family, model_config
from layer_boundary_models import oracle as references
from layer_boundary_models.mamba import chunked_scan

from model_cases import TOLERANCE, rel_error, setup

pytestmark = pytest.mark.oracle

ROOT = Path(__file__).resolve().parents[2]
#: the plugins a family's run needs beside the reference families
NEEDS = {"deepseek_v4": ("mhc",), "longcat_flash": ("tbo",)}
FAMILIES = [pytest.param(name, marks=requires_plugins(*NEEDS.get(name, ()))) for name in families()]


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("oracle-weights"))


def _tolerance(model: str, job) -> float:
    """What `run --check hf` allows: the default, the family's, and the reference's own bound."""
    reference = reference_of(family(model), model_config(model), torch.float64, state=torch.load(job.weights))
    return max(TOLERANCE["float64"], family(model).tolerances.get("float64", 0.0), reference.tolerance or 0.0)


def _tp2(job):
    return run_threaded(run_rank, Topology(tp=2), attrs.evolve(job, topology=Topology(tp=2)), timeout=120)


@pytest.mark.parametrize("model", FAMILIES)
def test_every_family_matches_hf_through_decode_at_tp2(weights_dir, model):
    job, ref = setup(model, "float64", weights_dir)
    assert all(len(steps) == 4 for steps in ref)  # the prefill and three decode steps
    assert rel_error(_tp2(job), ref) < _tolerance(model, job)


# a decode step that loses its cache ---------------------------------------------------------------


class _LosesItsCache(torch.nn.Module):
    """A causal LM whose forward takes the cache under the keyword the driver detects and drops it,
    as an older forward given `cache=` did (it landed in **kwargs)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, cache=None, use_cache=None, **kwargs):
        return self.model(input_ids, use_cache=use_cache, **kwargs)

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()


@torch.inference_mode()
def _cacheless_logits(model, prompts, decode):
    """What the oracle computed when its cache was dropped: every decode token alone."""
    return [
        [model(torch.tensor([p]), use_cache=False).logits[0]]
        + [model(torch.tensor([[tokens[r]]]), use_cache=False).logits[0] for tokens in decode]
        for r, p in enumerate(prompts)
    ]


def test_a_reference_that_loses_its_decode_cache_fails_the_comparison(weights_dir):
    job, ref = setup("qwen3", "float64", weights_dir)
    ours = _tp2(job)
    assert rel_error(ours, ref) < TOLERANCE["float64"]
    config = model_config("qwen3")
    hf = hf_from_state(dict(config.hf), torch.load(job.weights), torch.float64)
    lost = _cacheless_logits(hf, job.prompts, job.decode_tokens)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(lost, ref))  # the prefill alone cannot tell
    assert rel_error(ours, lost) > 1e-2


@pytest.mark.parametrize("model", FAMILIES)
def test_the_driver_refuses_a_decode_step_that_lost_its_cache(model):
    """Every family's Hugging Face cache reports its length, so a lost cache is caught at the
    step it happens, whichever keyword the installed forward takes."""
    config = model_config(model)
    hf = hf_from_state(dict(config.hf), family(model).random_weights(config, torch.float64, 1), torch.float64)
    prompts, decode = [torch.tensor([1, 2, 3, 4, 5])], [[6], [7]]
    assert len(hf_logits(hf, prompts, decode)[0]) == 3
    with pytest.raises(OracleError, match="decode step 1 returned a cache of 1 tokens, not 6"):
        hf_logits(_LosesItsCache(hf), prompts, decode)


@pytest.mark.gloo
def test_run_check_hf_with_a_lost_cache_is_one_line_and_exit_2():
    """The command line with a driver that passes the cache under a keyword the forward swallows
    (what transformers before 5.24 did with `cache=`): one line, exit 2, never a verdict."""
    code = (
        "import sys; from layer_boundary.cli import oracle; oracle.cache_keyword = lambda model: 'swallowed'; "
        "from layer_boundary.cli.main import main; "
        "sys.exit(main(['run', '--model', 'qwen3', '--tp', '2', '--decode-steps', '1', '--dtype', 'float64', '--json']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "decode step 1 returned a cache of" in lines[0] and "`swallowed=`" in lines[0]
    assert out.stdout == ""


def test_the_decode_bench_profiles_a_step_that_kept_its_cache(monkeypatch):
    """`bench decode`'s Hugging Face profile (run here on the CPU): its decode step is the
    cached one, whichever keyword the installed forward takes."""
    from layer_boundary.bench import decode, profile

    config = model_config("qwen3")
    hf = hf_from_state(dict(config.hf), family("qwen3").random_weights(config, torch.float64, 1), torch.float64)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(profile, "profile_step", lambda step: step())
    stepped = decode.hf_profile(hf, [1], prompt=5, vocab=config.vocab_size)[1]
    gen = torch.Generator().manual_seed(1)  # the prompt and the token hf_profile draws for batch 1
    prompt, token = torch.randint(0, config.vocab_size, (1, 5), generator=gen), torch.randint(0, config.vocab_size, (1, 1), generator=gen)
    cached = hf_logits(hf, [prompt[0]], [[int(token)]])[0][1]
    assert torch.allclose(stepped[0], cached, rtol=0, atol=1e-12)
    assert not torch.allclose(stepped[0], _cacheless_logits(hf, [prompt[0].tolist()], [[int(token)]])[0][1], atol=1e-3)


def test_the_cache_keyword_is_read_from_the_forward():
    class Current(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None, **kwargs): ...

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None, **kwargs): ...

    class Neither(torch.nn.Module):
        def forward(self, input_ids, **kwargs): ...

    class Wrapped(torch.nn.Module):  # peft's wrapper: forward(*args, **kwargs) over the model
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, *args, **kwargs): ...

        def get_base_model(self):
            return self.base

    assert cache_keyword(Current()) == "cache" and cache_keyword(Older()) == "past_key_values"
    assert cache_keyword(Wrapped(Older())) == "past_key_values"
    with pytest.raises(OracleError, match="neither `cache` nor `past_key_values`"):
        cache_keyword(Neither())


# what the references align where releases differ (probed on stand-ins of either behaviour) -------


class _Norm(torch.nn.Module):
    def __init__(self, in_float32: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))
        self.variance_epsilon, self.in_float32 = 1e-5, in_float32

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * h).to(x.dtype) if self.in_float32 else self.weight * h.to(x.dtype)


def test_a_norm_multiplying_its_weight_in_the_input_dtype_is_told_apart():
    assert references._multiplies_in_input_dtype(_Norm(in_float32=False))
    assert not references._multiplies_in_input_dtype(_Norm(in_float32=True))
    older, newer = _Norm(in_float32=False), _Norm(in_float32=True)
    newer.weight = older.weight
    x = torch.randn(3, 8, dtype=torch.float64)
    before = older(x)
    older.forward = types.MethodType(references._float32_weight_product, older)  # what the reference does to it
    assert torch.equal(older(x), newer(x)) and not torch.equal(before, newer(x))


def _model_of_module(monkeypatch, scan):
    module = types.ModuleType("stand_in_modeling")
    if scan is not None:
        module.mamba2_chunk_scan = scan
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return type("StandInForCausalLM", (), {"__module__": module.__name__})()


def _as_hf(scan):
    def hf_scan(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_limit, return_final_states):
        y, final = chunked_scan(x, dt, A, B, C, chunk=chunk_size, D=D, dt_bias=dt_bias, dt_min=dt_limit[0], initial=initial_states)
        return scan(y), final

    return hf_scan


def test_a_scan_summed_in_another_order_loosens_only_that_reference(monkeypatch):
    assert references._scan_reproduced(_model_of_module(monkeypatch, _as_hf(lambda y: y)))
    one_ulp = _as_hf(lambda y: torch.nextafter(y, torch.full_like(y, float("inf"))))
    assert not references._scan_reproduced(_model_of_module(monkeypatch, one_ulp))
    assert not references._scan_reproduced(_model_of_module(monkeypatch, None))


def test_the_dt_floor_is_pinned_on_every_mixer_and_nothing_else():
    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dt_bias, self.time_step_limit = torch.nn.Parameter(torch.zeros(2)), (0.0, float("inf"))

    model = torch.nn.Sequential(Mixer(), Mixer(), torch.nn.Linear(2, 2))
    references._pin_nemotron_dt_floor(model, types.SimpleNamespace(time_step_min=0.002))
    assert [m.time_step_limit for m in model[:2]] == [(0.002, float("inf"))] * 2


def test_longcat_expert_rows_fit_the_layout_the_model_holds():
    config = types.SimpleNamespace(num_experts=4, zero_experts=2)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    state = {name: torch.randn(6, 8, 3), "other": torch.zeros(6, 8, 3)}
    fit = references._fit_longcat_experts(config)
    holding = lambda rows: types.SimpleNamespace(state_dict=lambda: {name: torch.empty(rows, 8, 3), "other": torch.empty(4, 8, 3)})  # noqa: E731
    routed_only = fit(state, holding(4))
    assert torch.equal(routed_only[name], state[name][:4]) and routed_only["other"] is state["other"]
    assert fit(state, holding(6))[name] is state[name]
    assert fit(state, holding(3))[name] is state[name]  # not the routed experts' count: left for the strict load to refuse


# the supported range ------------------------------------------------------------------------------


def _extra(pyproject: Path, name: str) -> list:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"][name]


def _matrix():
    spec = importlib.util.spec_from_file_location("test_matrix", ROOT / "scripts/test_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_range_is_declared_once_and_ci_pins_both_ends():
    declared = f"transformers{oracle.TRANSFORMERS_RANGE}"
    assert declared in _extra(ROOT / "pyproject.toml", "oracle")
    assert declared in _extra(ROOT / "plugins/models/pyproject.toml", "oracle")
    pinned = [r for r in _extra(ROOT / "pyproject.toml", "test") if r.startswith("transformers")]
    assert len(pinned) == 1 and oracle._in_range(pinned[0].removeprefix("transformers=="))
    pins = {name: dict(p.split("==") for p in reqs if "==" in p)["transformers"] for name, reqs in _matrix().PINS.items()}
    lowest = re.match(r">=([\d.]+),", oracle.TRANSFORMERS_RANGE).group(1)
    assert pins["oracle-low"].startswith(lowest + ".") and oracle._in_range(pins["oracle-low"])
    assert oracle._in_range(pins["oracle-high"]) and Version(pins["oracle-high"]) > Version(pins["oracle-low"])


@pytest.mark.parametrize("version", ["5.17.0", "5.20.1", "5.24.0", "5.25.3", "5.25.0rc1"])
def test_a_release_in_the_range_is_accepted(monkeypatch, version):
    monkeypatch.setattr(oracle, "installed_transformers", lambda: version)
    oracle.check_transformers_version()


@pytest.mark.parametrize("version", ["5.16.2", "5.17.0rc1", "5.26.0", "5.26.0.dev0", "6.0.0", "4.57.1", "nonsense"])
def test_run_check_hf_outside_the_range_is_one_line_and_exit_2_before_any_rank(monkeypatch, capsys, version):
    monkeypatch.setattr(oracle, "installed_transformers", lambda: version)
    monkeypatch.setattr(run_cmd, "_launch", lambda *a: pytest.fail("a rank started"))
    assert main(["run", "--model", "qwen3", "--tp", "2", "--check", "hf"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert f"supports transformers{oracle.TRANSFORMERS_RANGE}, installed {version}" in lines[0]


def test_run_check_hf_without_transformers_names_the_range(monkeypatch, capsys):
    monkeypatch.setattr(oracle, "installed_transformers", lambda: None)
    monkeypatch.setattr(run_cmd, "_launch", lambda *a: pytest.fail("a rank started"))
    assert main(["run", "--model", "qwen3", "--check", "hf"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"needs Hugging Face transformers{oracle.TRANSFORMERS_RANGE}" in lines[0]


def test_the_installed_release_is_in_the_range():
    assert oracle._in_range(oracle.installed_transformers()), oracle.installed_transformers()
