"""Which FlashInfer decode-attention configuration the flashinfer plugin should plan (GPU).

Without tensor cores, FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` in its CUDA-graph mode
splits each row's keys and merges the parts in a second kernel (a merge launch per layer), and
ignores `disable_split_kv`; planned outside that mode over device buffers it does not split (a
row is one page). This probe times, per batch size and cache length, one decode step's attention
over 8 layers as CUDA-graph replay (median of many, random data), for: no tensor cores (graph
mode, split), no tensor cores planned outside graph mode (no split), tensor cores, tensor cores
without the split; each checked against a float32 reference first.
Its numbers set the plugin's rule (`decode_kernels.uses_tensor_cores`, `splits_kv`). JSON to --out.

    python3 benchmarks/decode_attention_probe.py --out decode_attention_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from layer_boundary.bench.decode import _events_us  # CUDA events around each call, median

HEADS, KV_HEADS, D, LAYERS = 32, 8, 128, 8
VARIANTS = {
    "cuda_cores": dict(use_tensor_cores=False),
    "cuda_cores_no_split": dict(use_tensor_cores=False, use_cuda_graph=False),
    "tensor_cores": dict(use_tensor_cores=True),
    "tensor_cores_no_split": dict(use_tensor_cores=True, disable_split_kv=True),
}


def _reference(q, k_cache, v_cache, lengths):
    groups = HEADS // KV_HEADS
    keys = k_cache.float().repeat_interleave(groups, dim=1)  # [B, heads, L, D]
    values = v_cache.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhd,bhld->bhl", q.float(), keys) * D**-0.5
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] < lengths[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("bhl,bhld->bhd", torch.softmax(scores, dim=-1), values)


def _wrapper(batch, page_size, variant):
    import flashinfer

    options = dict(VARIANTS[variant])
    disable_split = options.pop("disable_split_kv", False)
    graph_mode = options.pop("use_cuda_graph", True)
    workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    indices = torch.arange(batch, dtype=torch.int32, device="cuda")
    lengths = torch.full((batch,), page_size, dtype=torch.int32, device="cuda")
    plan = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=D**-0.5)
    if disable_split:
        plan["disable_split_kv"] = True
    if not graph_mode:  # planned over the device buffers, which the wrapper then reads as they are
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND", **options)
        wrapper.plan(indptr, indices, lengths, HEADS, KV_HEADS, D, page_size, **plan)
        if wrapper._paged_kv_last_page_len_buf.data_ptr() != lengths.data_ptr():
            raise RuntimeError("this FlashInfer copied the lengths buffer outside CUDA-graph mode")
        return wrapper, lengths
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, kv_layout="HND", use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=lengths, **options,
    )
    wrapper.plan(indptr.cpu(), indices.cpu(), lengths.cpu(), HEADS, KV_HEADS, D, page_size, **plan)
    return wrapper, lengths


@torch.inference_mode()
def probe(batch: int, page_size: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + page_size)
    shape = (batch, KV_HEADS, page_size, D)
    caches = [(torch.randn(shape, device="cuda", generator=gen).bfloat16(), torch.randn(shape, device="cuda", generator=gen).bfloat16())
              for _ in range(LAYERS)]
    q = torch.randn(batch, HEADS, D, device="cuda", generator=gen).bfloat16()
    filled = torch.randint(1, page_size + 1, (batch,), device="cuda", generator=gen).int()
    want = _reference(q, *caches[0], filled)
    row = {"batch": batch, "cache_len": page_size}
    for variant in VARIANTS:
        try:
            wrapper, lengths = _wrapper(batch, page_size, variant)
            lengths.copy_(filled)
            got = wrapper.run(q, caches[0])
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for k, v in caches:
                    wrapper.run(q, (k, v))
            for _ in range(5):
                graph.replay()
            row[variant] = {"us_8_layers": _events_us(graph.replay, 200), "relative_error": err}
        except Exception as exc:  # noqa: BLE001 - a variant this FlashInfer cannot run is reported
            row[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="decode_attention_probe.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    # up to 8200 tokens: whether the split still pays for a long cache at one row (8 KV heads are
    # 8 blocks without it), the cap a "no split" rule needs
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 128, 256, 512, 1032, 2056, 4104, 8200])
    args = parser.parse_args(argv)
    rows = [probe(batch, length) for batch in args.batches for length in args.lengths]
    for row in rows:
        cells = "  ".join(f"{v}: {row[v].get('us_8_layers', float('nan')):.1f} us (err {row[v].get('relative_error', float('nan')):.1e})"
                          if "error" not in row[v] else f"{v}: {row[v]['error'][:80]}" for v in VARIANTS)
        print(f"batch {row['batch']:>3} cache {row['cache_len']:>5}  {cells}")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": D, "layers": LAYERS,
                   "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
