import pytest
import torch

from layer_boundary import ReductionPolicy, RMSNorm, Forward, Topology, declare_attn, declare_ffn, make_stages, residual_batch, resolve_reduction
from layer_boundary._policy import ARCHITECTURE_DEFAULTS, architecture_of
from layer_boundary.testing.threaded import run_threaded


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "ar"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "rs+rsv"),
        ({"architectures": ["LongcatFlashForCausalLM"]}, "rsv"),
        ({"model_type": "qwen3"}, "ar"),
        ({"text_config": {"architectures": ["Qwen3ForCausalLM"]}, "architectures": ["SomeVLM"]}, "ar"),
        ({}, "rs+rsv"),
        (None, "rs+rsv"),
    ],
)
def test_auto_resolves_per_architecture(config, expected):
    assert resolve_reduction("auto", config) is ReductionPolicy(expected)


def test_explicit_policies_pass_through():
    for p in ("ar", "rs", "rsv", "rs+rsv"):
        assert resolve_reduction(p, {"architectures": ["Qwen3ForCausalLM"]}).value == p
    assert architecture_of(type("C", (), {"architectures": ["X"], "model_type": "x"})()) == "X"
    assert all(isinstance(v, ReductionPolicy) for v in ARCHITECTURE_DEFAULTS.values())


def test_captured_last_layer_outputs_under_sequence_parallel():
    """The capture lands on the attention's compute-input rows (gathered), owned."""
    H = 4

    def fn(parallel):
        norm = lambda: RMSNorm(H, dtype=torch.float64, compute_dtype=torch.float64)  # noqa: E731
        attn, ffn, attn2 = make_stages(
            (declare_attn(), norm()), (declare_ffn(), norm()), (declare_attn(), norm()), terminal=True, parallel=parallel
        )
        got = []
        for sp in (False, True):
            fwd = Forward(parallel, 5, sequence_parallel=sp)
            residual_batch.start(fwd)
            x = torch.arange(5 * H, dtype=torch.float64).reshape(5, H) / 16
            h = attn.finish(attn.prepare(x, fwd) * 0.5, fwd)
            y = ffn.prepare(h, fwd)
            with ffn.exit(fwd) as out:
                y = parallel.groups["tp"].all_reduce(y * 0.25) if not out.flags.skips_reduction else y * 0.25
            h = out.finish(y)
            caps = []
            attn2.prepare(h, fwd, captured_last_layer_outputs=lambda v, owned: caps.append((v.clone(), owned)))
            got.append(caps[0])
        (plain, plain_owned), (sp_value, sp_owned) = got
        return torch.equal(plain, sp_value), sp_owned

    assert run_threaded(fn, Topology(tp=2)) == [(True, True), (True, True)]
