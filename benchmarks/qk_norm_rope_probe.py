"""The q/k norm + rope of one qwen3 attention layer: the three launches the model ran (its q_norm
and k_norm modules with the norm kernel prepare_model chose, then the chosen rope kernel) against
the one `QKNormRopeKernel` launch (GPU; group `probe-qk-norm-rope` of scripts/gpu_tests.sh).

Per token count: both checked against the float64 math first (the relative error of each), then timed as CUDA-graph replay of 20
back-to-back layers' worth of calls (median of many, random data), reported per layer and as the
ratio fused / unfused measured in the same run. JSON to --out.

    python3 benchmarks/qk_norm_rope_probe.py --out qk_norm_rope_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from layer_boundary.bench.decode import _events_us

HEADS, KV_HEADS, D, HIDDEN = 32, 8, 128, 4096
CALLS = 20


def _attention():
    """One prepared qwen3 layer's attention (random weights): its norms, rope and fused kernel."""
    from layer_boundary import Parallel, prepare_model
    from layer_boundary.models import build_model, model_config

    hf = dict(model_config("qwen3").hf, hidden_size=HIDDEN, head_dim=D, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
              num_hidden_layers=1, intermediate_size=4 * HIDDEN)
    model = build_model(model_config("qwen3", hf), Parallel.single(), dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
    prepare_model(model, max_tokens=4096)
    attn = model.layers[0].self_attn
    chosen = model.attention_kernels
    if attn.qk_norm_rope_kernel is None or attn.rope_kernel is None:
        raise SystemExit(f"needs both a rope and a q/k norm + rope kernel; prepare_model chose {chosen}")
    return model, attn, chosen


def _graph_us(fn) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    for _ in range(3):
        graph.replay()
    return _events_us(graph.replay, 100) / CALLS


@torch.inference_mode()
def probe(attn, tokens: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    fused_out = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * D, device="cuda", generator=gen).bfloat16()
    q, k, _ = fused_out.split((HEADS * D, KV_HEADS * D, KV_HEADS * D), dim=-1)
    q, k = q.view(tokens, HEADS, D), k.view(tokens, KV_HEADS, D)
    # below the tables' length (the model's max_position_embeddings; a static cache never goes past it)
    positions = torch.randint(0, min(4096, attn.rope_positions), (tokens,), device="cuda", generator=gen)

    def unfused():
        return attn.rope_kernel(attn.q_norm(q), attn.k_norm(k), positions)

    def fused():
        return attn.qk_norm_rope_kernel(q, k, positions, attn.q_norm.weight, attn.k_norm.weight)

    # both against the float64 math (the fused kernel's own table), each on untouched inputs
    from layer_boundary_cutedsl.kernels.reference import qk_norm_rope_reference

    table, eps, pristine = attn.qk_norm_rope_kernel.table, attn.q_norm.eps, fused_out.clone()
    want = [qk_norm_rope_reference(x, positions, n.weight, table, eps) for x, n in ((q, attn.q_norm), (k, attn.k_norm))]
    errors = {}
    for name, fn in (("unfused", unfused), ("fused", fused)):
        fused_out.copy_(pristine)
        got = fn()
        errors[name] = max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for g, w in zip(got, want))
    unfused_us, fused_us = _graph_us(unfused), _graph_us(fused)
    return {"tokens": tokens, "unfused_us": unfused_us, "fused_us": fused_us, "fused_over_unfused": fused_us / unfused_us,
            "unfused_error": errors["unfused"], "fused_error": errors["fused"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="qk_norm_rope_probe.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048])
    args = parser.parse_args(argv)
    model, attn, chosen = _attention()
    rows = [probe(attn, t) for t in args.tokens]
    names = {"norm": type(attn.q_norm).__name__, "rope": chosen.rope.name, "fused": chosen.qk_norm_rope.name}
    print(f"unfused: q_norm + k_norm + {names['rope']}; fused: {names['fused']} (us a layer, graph replay of {CALLS} calls)")
    for r in rows:
        print(f"tokens {r['tokens']:>5}  unfused {r['unfused_us']:6.2f}  fused {r['fused_us']:6.2f}  "
              f"ratio {r['fused_over_unfused']:.2f}  (vs float64: unfused {r['unfused_error']:.1e}, fused {r['fused_error']:.1e})")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "kernels": names, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
