"""FP8 quantizing reads: the torch reference, capability-matched candidates, parity across ranks."""

import json
import subprocess
import sys

import pytest

from layer_boundary.testing import requires_plugins
import torch

from layer_boundary import Forward, FusedMlpInput, GemmaRMSNorm, RMSNorm, SumGroup, Topology, declare_attn, declare_ffn, make_stages, residual_batch
from layer_boundary._residual.quant import FP8_MAX, Fp8Input, QuantNormRead, fp8_residual
from layer_boundary.testing.grid import quant
from layer_boundary.testing.threaded import run_threaded

H = 8


def _manual(norm, total, scale=None):
    """The documented reference, written out: fp32 norm output, then E4M3."""
    t32 = total.to(torch.float32)
    y = t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + norm.eps)
    w = norm.weight.float() + (1.0 if isinstance(norm, GemmaRMSNorm) else 0.0)
    y = y * w
    if scale is None:
        scale = y.abs().amax(-1, keepdim=True) / FP8_MAX
    return torch.clamp(y / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("fmt, scale", [("fp8_dynamic", None), ("fp8_static", 0.02)])
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_the_read_bit_matches_its_torch_reference(norm_cls, fmt, scale, rows):
    gen = torch.Generator().manual_seed(rows)
    norm = norm_cls(H, 1e-6, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(H, generator=gen) * 0.3)
    c = torch.randn(rows, H, generator=gen).to(torch.bfloat16)
    r = torch.randn(rows, H, generator=gen).to(torch.bfloat16)
    read = QuantNormRead(fmt, scale)
    q, new_r = read.update_and_read(fp8_residual().attn_update, c, r, norm)
    want, want_scale = _manual(norm, c.float() + r.float(), None if scale is None else torch.tensor(scale))
    assert isinstance(q, Fp8Input) and q.data.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16
    assert torch.equal(q.data.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(q.scale, want_scale.float())
    assert torch.equal(new_r, (c.float() + r.float()).to(torch.bfloat16))
    if rows:
        assert (q.dequantize(torch.float32) - (want.float() * want_scale)).abs().max() == 0


def test_bad_formats_are_rejected():
    with pytest.raises(ValueError, match="one of"):
        QuantNormRead("int8")
    with pytest.raises(ValueError, match="fp8_static needs static_scale"):
        QuantNormRead("fp8_static")


class Formats:
    """One candidate per output format (all decline): which ones a read is offered."""

    def attention_input(self, plan):
        return tuple(FusedMlpInput(run=lambda o, r, f: None, name=f"c.{fmt}", completes=SumGroup.TP, output_format=fmt) for fmt in ("plain", "fp8_static", "fp8_dynamic"))

    ffn_input = attention_input


@pytest.mark.parametrize(
    "residual, expected",
    [(None, ["c.plain", "core.unfused"]), (fp8_residual("fp8_dynamic"), ["c.fp8_dynamic", "core.unfused"]), (fp8_residual("fp8_static", static_scale=0.1), ["c.fp8_static", "core.unfused"])],
    ids=["plain", "dynamic", "static"],
)
def test_construction_offers_only_candidates_of_the_reads_format(residual, expected):
    def fn(parallel):
        attn, ffn = make_stages(
            (declare_attn(residual=residual), RMSNorm(H), {"fusions": Formats()}),
            (declare_ffn(residual=residual), RMSNorm(H), {"fusions": Formats()}),
            terminal=True, parallel=parallel,
        )
        entry = next(iter(ffn.plan.paths.values())).entry
        return [c.name for c in entry.candidates], ffn.plan.describe()

    names, described = run_threaded(fn, Topology(tp=2))[0]
    assert names == expected
    if residual is not None:
        assert "quantized to fp8" in json.dumps(described)


def _fp8_stack(parallel, fmt, counts, sp):
    """attention -> FFN -> attention with FP8 reads; compute dequantizes, rounds to the grid and
    multiplies by grid weights, so every sum is exact and the result is bit-comparable."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randint(-2, 3, (H, H), generator=gen).double() / 8 for _ in range(3)]
    res = fp8_residual(fmt, static_scale=0.05 if fmt == "fp8_static" else None)
    norms = [RMSNorm(H, dtype=torch.float64) for _ in range(3)]
    b = make_stages((declare_attn(residual=res), norms[0]), (declare_ffn(residual=res), norms[1]), (declare_attn(residual=res), norms[2]), terminal=True, parallel=parallel)
    g_attn, g_tp = parallel.groups["attn_tp"], parallel.groups["tp"]
    n = counts[parallel.attn_dp_rank]
    fwd = Forward(parallel, n, dp_counts=counts, sequence_parallel=sp)
    residual_batch.start(fwd)
    x = torch.randint(-8, 9, (n, H), generator=torch.Generator().manual_seed(10 + parallel.attn_dp_rank)).double() / 4

    def shard(w, group):
        cols = H // group.size
        return w[:, group.rank * cols : (group.rank + 1) * cols]

    def compute(inp, w, group):
        assert isinstance(inp, Fp8Input)
        xs = quant(inp.dequantize(torch.float64))
        return xs[:, group.rank * (H // group.size) : (group.rank + 1) * (H // group.size)] @ shard(w, group).T

    h = b[0].finish(compute(b[0].prepare(x, fwd), weights[0], g_attn), fwd)
    y = b[1].prepare(h, fwd)
    with b[1].exit(fwd) as out:
        y = compute(y, weights[1], g_tp)
        if not out.flags.skips_reduction:
            y = g_tp.all_reduce(y)
    h = out.finish(y)
    h = b[2].finish(compute(b[2].prepare(h, fwd), weights[2], g_attn), fwd)
    return residual_batch.norm(h, fwd, RMSNorm(H, dtype=torch.float64))


@pytest.mark.parametrize("fmt", ["fp8_dynamic", "fp8_static"])
@pytest.mark.parametrize(
    "topology, counts, sp",
    [(Topology(tp=2), (5,), False), (Topology(tp=4), (6,), True), (Topology(tp=4, attn_dp=2), (3, 0), False)],
    ids=["tp2", "tp4-sp", "dp2xtp2-zero"],
)
def test_fp8_reads_give_the_same_bits_on_every_layout(fmt, topology, counts, sp):
    single = [run_threaded(lambda p: _fp8_stack(p, fmt, (n,), False), Topology())[0] for n in counts]
    results = run_threaded(lambda p: _fp8_stack(p, fmt, counts, sp), topology)
    for rank, out in enumerate(results):
        assert torch.equal(out, single[topology.coordinates(rank)["attn_dp"]])


@pytest.mark.gloo
@requires_plugins("models")
def test_run_with_fp8_reads_stays_within_the_documented_tolerance():
    out = subprocess.run(
        [sys.executable, "-m", "layer_boundary", "run", "--model", "qwen3", "--tp", "2", "--fp8", "dynamic", "--json", "--decode-steps", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    check = json.loads(out.stdout)["check"]
    assert check["passed"] and check["tolerance"] == 0.1 and 1e-3 < check["rel_err"] < 0.1
