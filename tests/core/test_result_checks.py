"""A plugin candidate's return is held to its request where the check costs nothing: a fusion
candidate's (compute input, new residual) and an add + norm kernel's (normed, new residual) must
be shaped, typed and placed like the residual, a plain norm's like its input. A wrong one (a
one-row residual that would broadcast, a hidden size one short, a row short, another dtype) is
a `FusionError` at the candidate, naming it, its plugin and the switch that disables the plugin,
before any later stage reads it."""

import re

import pytest
import torch

from layer_boundary import (
    Forward,
    FusedMlpInput,
    FusionError,
    FusionProvider,
    RMSNorm,
    SumGroup,
    Topology,
    declare_attn,
    declare_ffn,
    hookimpl,
    make_stages,
    residual_batch,
)
from layer_boundary.plugin import AddNormKernel, add_rms_norm, check_result
from layer_boundary.testing.threaded import run_threaded

H = 8
ROWS = 5


def _norm():
    return RMSNorm(H, dtype=torch.float64)


#: ways a vendor's result can be wrong, each applied to the right (input, residual) pair
CORRUPTIONS = {
    "one-row residual": lambda inp, res: (inp, res[:1]),
    "hidden size one short": lambda inp, res: (inp[:, :-1], res),
    "a row short": lambda inp, res: (inp[:-1], res[:-1]),
    "another dtype": lambda inp, res: (inp.float(), res),
    "not a pair": lambda inp, res: inp,
}
EXPECTED = {
    "one-row residual": r"wrong new residual: 1 row where 5 were asked \(got a tensor \(1, 8\) float64 on cpu, asked a tensor \(5, 8\) float64 on cpu\)",
    "hidden size one short": r"wrong compute input: size 7 in dimension 1 where 8 was asked",
    "a row short": r"wrong new residual: 4 rows where 5 were asked",
    "another dtype": r"wrong compute input: float32 where float64 was asked",
    "not a pair": r"returned a tensor \(5, 8\) float64 on cpu where a pair \(compute input, new residual\) was asked",
}


class Corrupting:
    """Completes the sum correctly, then returns `corrupt(input, new_residual)`."""

    def __init__(self, corrupt):
        self.corrupt = corrupt

    def attention_input(self, plan):
        norm = plan.norm

        def run(owed, residual, fwd):
            return self.corrupt(*add_rms_norm(norm, owed.group.all_reduce(owed.partial), residual))

        return (FusedMlpInput(run=run, name="acme.fused_ar_norm", completes=SumGroup.TP),)

    ffn_input = attention_input


def _acme(provider):
    class Plugin:
        @hookimpl
        def layer_boundary_fusion_providers(self):
            yield FusionProvider(name="acme.ar_add_rmsnorm", factory=lambda stage: provider, priority=10)

    return Plugin()


def _layer(parallel, reached):
    """Attention -> FFN -> attention; `reached` logs each compute that ran."""
    attn, ffn, attn2 = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), (declare_attn(), _norm()),
                                   terminal=True, parallel=parallel)
    fwd = Forward(parallel, ROWS)
    residual_batch.start(fwd)
    x = torch.arange(ROWS * H, dtype=torch.float64).reshape(ROWS, H) / 16
    h = attn.finish(attn.prepare(x, fwd) * 0.5, fwd)
    y = ffn.prepare(h, fwd)
    reached.append("ffn")
    with ffn.exit(fwd) as out:
        y = y * 0.25
    h = out.finish(y)
    h = attn2.finish(attn2.prepare(h, fwd), fwd)
    reached.append("final norm")
    return residual_batch.norm(h, fwd, _norm())


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_a_wrong_fusion_result_fails_at_the_candidate_naming_the_plugin(inline_plugin, fresh_registry, how):
    inline_plugin(_acme(Corrupting(CORRUPTIONS[how])), name="acme")
    reached = []
    with pytest.raises(FusionError) as info:
        run_threaded(lambda p: _layer(p, reached), Topology(tp=2))
    message = str(info.value)
    assert message.startswith("fusion candidate 'acme.fused_ar_norm' from record 'acme.ar_add_rmsnorm' of plugin 'acme'")
    assert message.endswith("set LAYER_BOUNDARY_DISABLE_PLUGINS=acme to run without it")
    assert len(message.splitlines()) == 1
    assert re.search(EXPECTED[how], message), message
    assert reached == []  # the first input that completed a sum raised: no compute read the wrong tensor


def test_a_correct_fusion_result_passes_and_equals_the_unfused_path(inline_plugin, fresh_registry):
    want = run_threaded(lambda p: _layer(p, []), Topology(tp=2))
    inline_plugin(_acme(Corrupting(lambda inp, res: (inp, res))), name="acme")
    got = run_threaded(lambda p: _layer(p, []), Topology(tp=2))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_raising_candidate_names_the_switch_that_disables_its_plugin(inline_plugin, fresh_registry):
    def boom(inp, res):
        raise RuntimeError("workspace too small")

    inline_plugin(_acme(Corrupting(boom)), name="acme")
    with pytest.raises(FusionError, match=r"'acme.fused_ar_norm'.*workspace too small; set LAYER_BOUNDARY_DISABLE_PLUGINS=acme"):
        run_threaded(lambda p: _layer(p, []), Topology(tp=2))


class AddNormPlugin:
    """An add + norm kernel (and a plain norm) whose returns `corrupt` spoils."""

    def __init__(self, corrupt=lambda out: out, corrupt_norm=lambda out: out):
        def kernel(contribution, residual, weight):
            norm = RMSNorm(weight.shape[0], dtype=residual.dtype)
            norm.weight.data.copy_(weight)
            return corrupt(norm.add_forward(contribution, residual))

        def plain(x, weight):
            norm = RMSNorm(weight.shape[0], dtype=x.dtype)
            norm.weight.data.copy_(weight)
            return corrupt_norm(norm.torch_forward(x))

        self.record = AddNormKernel(name="acme.add_rmsnorm", factory=lambda request: kernel,
                                    norm_factory=lambda request: plain, priority=400)

    @hookimpl
    def layer_boundary_add_norm_kernels(self):
        yield self.record


@pytest.mark.parametrize("how", ["one-row residual", "a row short", "another dtype", "not a pair"])
def test_a_wrong_add_norm_result_fails_at_the_kernel(inline_plugin, fresh_registry, how):
    inline_plugin(AddNormPlugin(corrupt=lambda out: CORRUPTIONS[how](*out)), name="acme")
    norm = _norm()
    c, r = torch.randn(ROWS, H, dtype=torch.float64), torch.randn(ROWS, H, dtype=torch.float64)
    with pytest.raises(FusionError) as info:
        norm.fused_add_forward(c, r)
    message = str(info.value)
    assert message.startswith("add + norm kernel record 'acme.add_rmsnorm' of plugin 'acme'")
    assert message.endswith("set LAYER_BOUNDARY_DISABLE_PLUGINS=acme to run without it")
    assert re.search(EXPECTED[how].replace("compute input", "normed output"), message), message


def test_a_right_add_norm_result_passes(inline_plugin, fresh_registry):
    inline_plugin(AddNormPlugin(), name="acme")
    norm = _norm()
    c, r = torch.randn(ROWS, H, dtype=torch.float64), torch.randn(ROWS, H, dtype=torch.float64)
    got, want = norm.fused_add_forward(c, r), norm.add_forward(c, r)
    assert norm.add_norm_kernel() == "acme.add_rmsnorm" and all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_raising_add_norm_kernel_names_its_plugin(inline_plugin, fresh_registry):
    def boom(out):
        raise RuntimeError("no kernel for sm_75")

    inline_plugin(AddNormPlugin(corrupt=boom), name="acme")
    with pytest.raises(FusionError, match=r"'acme.add_rmsnorm' of plugin 'acme'.*raised RuntimeError: no kernel for sm_75; "
                                          r"set LAYER_BOUNDARY_DISABLE_PLUGINS=acme"):
        _norm().fused_add_forward(torch.ones(2, H, dtype=torch.float64), torch.ones(2, H, dtype=torch.float64))


def test_a_wrong_plain_norm_result_fails_at_the_kernel(inline_plugin, fresh_registry):
    inline_plugin(AddNormPlugin(corrupt_norm=lambda out: out[..., :-1]), name="acme")
    with pytest.raises(FusionError, match=r"norm kernel record 'acme.add_rmsnorm' of plugin 'acme'.*wrong normed output: size 7 "
                                          r"in dimension 2 where 8 was asked"):
        _norm()(torch.randn(3, 2, H, dtype=torch.float64))


def test_check_result_reads_metadata_only():
    like = torch.zeros(4, 3)
    out = torch.ones(4, 3)
    assert check_result(out, like.shape, like, "k", "p") is out
    with pytest.raises(FusionError, match=r"k returned a wrong result: on meta where cpu was asked"):
        check_result(torch.empty(4, 3, device="meta"), like.shape, like, "k", "p")
    with pytest.raises(FusionError, match=r"k returned a wrong activation: not a tensor \(got a list"):
        check_result([1], like.shape, like, "k", "p", "activation")
