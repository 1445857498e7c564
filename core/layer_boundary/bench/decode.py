"""End-to-end decode step time of a realistic-width Qwen3 through the boundaries on GPU:
eager vs CUDA-graph replay (graph checked equal to eager first), per batch size, with peak memory.

TP=1 runs in this process on one GPU. TP>1 (fused vs unfused with the flashinfer plugin) needs as
many GPUs as ranks and runs under torchrun: `torchrun --nproc-per-node 2 -m layer_boundary bench
decode --tp 2`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from ..cli.args import OneLineParser, positive_int

REALISTIC = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def _random_init(model) -> None:
    """Random weights drawn on the GPU (std 1/sqrt(fan_in); norms 1 + 0.1 N): a 1.8B-parameter
    model initialises in a second instead of drawing and copying it on the host."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)


def _events_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def run(batches, layers: int, prompt: int, repeats: int, parallel=None) -> dict:
    from .._cuda_graphs import CapturedStep
    from ..models import build_model, model_config
    from ..models.decode import static_decode_step, static_prefill
    from .._parallel import Parallel

    parallel = parallel or Parallel.single()
    cfg = dict(REALISTIC, num_hidden_layers=layers)
    config = model_config("qwen3", cfg)
    model = build_model(config, parallel, dtype=torch.bfloat16, device="cuda")
    _random_init(model)
    rows = []
    for batch in batches:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cache = model.new_static_cache(batch, prompt + 8)
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, config.vocab_size, (prompt,), generator=gen) for _ in range(batch)]
        slots = torch.arange(batch, device="cuda")
        ids = torch.randint(0, config.vocab_size, (batch,), generator=gen).cuda()
        pos = torch.full((batch,), prompt, dtype=torch.long, device="cuda")
        graph = CapturedStep(lambda i, p: static_decode_step(model, parallel, cache, i, slots, p), (ids.clone(), pos.clone()))
        static_prefill(model, parallel, cache, prompts, "cuda")
        snap = cache.snapshot()
        eager_out = static_decode_step(model, parallel, cache, ids, slots, pos).clone()
        cache.restore(snap)
        replay_out = graph.replay(ids, pos).clone()
        equal = bool(torch.equal(eager_out, replay_out))
        eager_us = _events_us(lambda: static_decode_step(model, parallel, cache, ids, slots, pos), repeats)
        graph_us = _events_us(lambda: graph.replay(ids, pos), repeats * 3)
        rows.append(
            {
                "batch": batch,
                "eager_us": eager_us,
                "graph_us": graph_us,
                "eager_over_graph": eager_us / graph_us,
                "graph_equals_eager": equal,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            }
        )
        del graph, cache
    return {"model": cfg, "tp": parallel.topology.tp, "prompt": prompt, "rows": rows, "device": torch.cuda.get_device_name()}


def main(argv=None) -> dict:
    ap = OneLineParser(prog=f"layer-boundary bench {Path(__file__).stem}", description=__doc__)
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--layers", type=positive_int, default=8)
    ap.add_argument("--prompt", type=positive_int, default=32)
    ap.add_argument("--repeats", type=positive_int, default=30)
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench decode needs a CUDA GPU")
    result = run(args.batches, args.layers, args.prompt, args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"decode step, qwen3 hidden 4096 x {args.layers} layers, bf16, TP={result['tp']}, {result['device']}")
    print(f"{'batch':>6} {'eager us':>10} {'graph us':>10} {'eager/graph':>12} {'graph==eager':>13} {'peak GiB':>9}")
    for r in result["rows"]:
        print(f"{r['batch']:>6} {r['eager_us']:>10.1f} {r['graph_us']:>10.1f} {r['eager_over_graph']:>12.2f} {str(r['graph_equals_eager']):>13} {r['peak_mem_gib']:>9.2f}")
    from .plot import line_plot

    xs = [r["batch"] for r in result["rows"]]
    print(line_plot(str(Path(args.out).with_suffix(".png")), "decode step (TP=%d)" % result["tp"], "batch", "us",
                    {"eager": (xs, [r["eager_us"] for r in result["rows"]]), "graph replay": (xs, [r["graph_us"] for r in result["rows"]])}))
    return result


if __name__ == "__main__":
    main()
