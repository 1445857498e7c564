"""The `fp8` step of the GPU check: FlashInfer's all-reduce + add + RMSNorm + FP8 quantization
(`kARResidualRMSNormFP8Quant` with the read's fixed scale, `kARResidualRMSNormDynamicFP8Quant`
with one scale per token) at an FP8-quantizing read, against the core's unfused quantizing read.

FlashInfer quantizes the norm after rounding it to the activation dtype and sums the ranks in
fp32; the core rounds the cross-rank sum to the activation dtype and quantizes the fp32 norm. So
the two agree up to one E4M3 code on values at a rounding edge: the check holds every fused value
within half an E4M3 step of the exact fp32 norm (plus bf16's rounding) and most bytes identical.
"""

from __future__ import annotations

import torch

#: at most this share of E4M3 bytes may differ from the unfused read's (the two round different
#: inputs, and per token with slightly different scales: ~3% differ on H200, each by one code)
FP8_BYTES_DIFFERING = 0.06


class Fp8Pair:
    """Layer 0's FFN leaves its sum owed to layer 1's attention input, which reads FP8."""

    def __init__(self, parallel, hidden, dtype, device, fmt, static_scale, gemma=False):
        from layer_boundary import GemmaRMSNorm, RMSNorm, declare_attn, declare_ffn, make_stages
        from layer_boundary.plugin import fp8_residual

        gen = torch.Generator().manual_seed(hidden + 1)
        norms = []
        for _ in range(4):
            norm = (GemmaRMSNorm if gemma else RMSNorm)(hidden, 1e-6, dtype=dtype, device=device)
            with torch.no_grad():
                norm.weight.copy_(((0.0 if gemma else 1.0) + 0.1 * torch.randn(hidden, generator=gen)).to(dtype))
            norms.append(norm)
        ops = fp8_residual(fmt, static_scale=static_scale, attention=True, ffn=False)
        tag = f"fp8{fmt[4:]}{hidden}{'g' if gemma else ''}"
        self.attn0, self.ffn0 = make_stages((declare_attn(residual=ops), norms[0]), (declare_ffn(residual=ops), norms[1]),
                                            parallel=parallel, label=f"{tag}.layer0")
        self.attn1, self.ffn1 = make_stages((declare_attn(residual=ops), norms[2]), (declare_ffn(residual=ops), norms[3]),
                                            previous=declare_ffn(residual=ops), terminal=True, parallel=parallel, label=f"{tag}.layer1")
        self.norm, self.read, self.parallel = norms[2], self.attn1.plan.read, parallel

    @property
    def boundaries(self):
        return (self.attn0, self.ffn0, self.attn1, self.ffn1)

    def run(self, residual, partial):
        from layer_boundary import Forward, ForwardMode, residual_batch

        fwd = Forward(self.parallel, residual.shape[0], mode=ForwardMode.DECODE)
        residual_batch.start(fwd)
        self.attn0.prepare(residual, fwd)
        with self.ffn0.exit(fwd) as out:
            pass
        return self.attn1.prepare(out.finish(partial), fwd), fwd.residual_stream.residual


def _e4m3_half_step(q: torch.Tensor) -> torch.Tensor:
    """Half the E4M3 spacing at each code's value (in code units): 2^(e - 4) for normal values,
    2^-10 for subnormals (|q| < 2^-6)."""
    mag = q.abs().clamp_min(2.0**-6)
    return torch.exp2(torch.floor(torch.log2(mag)) - 4.0)


def _compare(got, want, exact=None) -> dict:
    """How the fused read's FP8 input relates to the unfused one and to the exact fp32 norm `exact`.

    Each quantizer may round to either neighbour of its own input, and FlashInfer's input is the
    norm already rounded to bf16 (relative 2^-9) with its own per-token scale: the contract is that
    every fused value lies within half an E4M3 step (at its own scale) plus two bf16 roundings (the
    new residual's and the norm's) of the core's fp32 norm; the byte agreement with the unfused read
    is reported beside it."""
    differ = float((got.data.view(torch.uint8) != want.data.view(torch.uint8)).float().mean())
    out = {"bytes_differing": differ}
    if exact is not None:
        q = got.data.to(torch.float32)
        scale = got.scale.float() if got.per_token else got.scale.float().reshape(1, 1)
        bound = _e4m3_half_step(q) * scale + exact.abs() * 2.0**-7 + 1e-12
        out["max_err_over_bound"] = float(((q * scale - exact).abs() / bound).max())
    if want.per_token:
        out["scale_rel_diff"] = float(((got.scale.float() - want.scale.float()).abs() / want.scale.float()).max())
    return out


def check_fp8_reads(checks, parallel, rank, args):
    from layer_boundary import PLAIN_ADD
    from layer_boundary.plugin import norm_fp32

    from .gpu_check import _device, _sync
    from .service import prepare_flashinfer_fusion

    group = parallel.groups["tp"]
    device = _device()
    for fmt, scale in (("fp8_dynamic", None), ("fp8_static", 8.0 / 448.0)):
        for gemma in (False, True):
            pair = Fp8Pair(parallel, args.hidden, torch.bfloat16, device, fmt, scale, gemma=gemma)
            report = prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=args.max_tokens)
            label = f"fp8 {fmt[4:]}{' gemma' if gemma else ''}"
            checks.add(f"{label}: the quantizing read's fused candidate is bound", report.available and len(report.bound) == 3,
                       report=str(report))
            if not report.available:
                continue
            for tokens in (1, 7, 129, 1000):
                gen = torch.Generator().manual_seed(tokens)
                residual = torch.randn(tokens, args.hidden, generator=gen).to(device, torch.bfloat16)
                partial = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(tokens + 100 * (rank + 1))).to(
                    device, torch.bfloat16)
                summed = group.all_reduce(partial.clone())
                want, want_residual = pair.read.update_and_read(PLAIN_ADD, summed, residual, pair.norm)
                # the norm the core quantizes: of the cross-rank sum (rounded to bf16, as FlashInfer's
                # is too) plus the residual, in fp32
                exact = norm_fp32(pair.norm, summed.float() + residual.float())
                got, got_residual = pair.run(residual, partial.clone())
                _sync()
                facts = {"tokens": tokens, "fused": type(got).__name__ == "Fp8Input", **_compare(got, want, exact.float()),
                         "residual_rel_err": float((got_residual.double() - want_residual.double()).norm()
                                                   / want_residual.double().norm())}
                same = all(torch.equal(g, gathered) for g, gathered in
                           ((got.data.view(torch.uint8), group.all_gather(got.data.view(torch.uint8).unsqueeze(0))[0]),))
                ok = (facts["fused"] and facts["bytes_differing"] <= FP8_BYTES_DIFFERING
                      and facts["max_err_over_bound"] <= 1.0 and facts["residual_rel_err"] <= 2e-2
                      and facts.get("scale_rel_diff", 0.0) <= 2e-2 and same)
                checks.add(f"{label}: fused FP8 read within half an E4M3 step of the exact norm, like the unfused read", ok,
                           ranks_identical=same, **facts)
