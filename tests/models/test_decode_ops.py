"""What one static-cache decode step of qwen3 runs, counted on the CPU with torch.profiler: the
aten ops the model code calls directly (each is a kernel launch on a GPU). Keys and values go
into the cache in place, the slots are read as views, the rotary factors are looked up, the
mask is built once per step: no cat, no repeat, no clone, no dtype round trip of its own.

The preset qwen3 (4 layers, bf16, batch 1) runs per step 9 index ops (2 cache writes a layer,
one rotary lookup), no copies (no cat, repeat_interleave or masked_fill clone) and 50 casts (the
norms' own).

q, k and v come from one fused GEMM, so each layer runs 4 linears (17 a step, where three
projections would make 25); k and v are strided views of its output, so the cache writes are
index_put_ on a [tokens, kv_heads] index, which reads them as they are (an index_copy_ needs a
contiguous [tokens * kv_heads, D] source: a hidden clone per layer once a step has two rows).
"""

from collections import Counter

import pytest
import torch

from layer_boundary import Parallel
from layer_boundary_models import build_model, family, model_config
from layer_boundary.cli.static_decode import static_decode_step, static_prefill
from layer_boundary.plugin import StateDictSource

#: ops that only make views (no launch)
VIEWS = {"aten::view", "aten::slice", "aten::select", "aten::unsqueeze", "aten::transpose", "aten::reshape", "aten::split",
         "aten::expand", "aten::as_strided", "aten::t", "aten::permute", "aten::promote_types", "aten::result_type",
         "aten::detach", "aten::alias", "aten::split_with_sizes"}
INDEX = {"aten::index", "aten::index_put_", "aten::index_select", "aten::index_copy_", "aten::gather", "aten::scatter", "aten::take"}
COPIES = {"aten::cat", "aten::stack", "aten::repeat_interleave", "aten::repeat", "aten::clone", "aten::contiguous", "aten::copy_",
          "aten::masked_fill", "aten::flip", "aten::roll"}


def _top_level(events):
    """The aten ops called from Python (no aten parent), skipping the embedding's own lookup."""
    return [e for e in events if e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]


def _casts(events, ops) -> int:
    """`to` calls that convert (they run a copy), not the no-op ones."""
    copying = {id(e.cpu_parent.cpu_parent) for e in events if e.name == "aten::copy_" and e.cpu_parent is not None
               and e.cpu_parent.name == "aten::_to_copy" and e.cpu_parent.cpu_parent is not None}
    return sum(1 for e in ops if e.name == "aten::to" and id(e) in copying)


def decode_step_ops(slots_given: bool, batch: int = 1) -> dict:
    """Counts of one decode step (after a prefill and a warm-up step), bf16, the preset qwen3."""
    from torch.profiler import ProfilerActivity, profile

    config = model_config("qwen3")
    model = build_model(config, Parallel.single(), dtype=torch.bfloat16)
    family("qwen3").load_weights(model, StateDictSource(family("qwen3").random_weights(config, torch.float32, seed=5)))
    parallel = Parallel.single()
    prompts = [[1 + r, 2, 3, 4, 5][: 5 - r] for r in range(batch)]
    cache = model.new_static_cache(batch, 16)
    slots = torch.arange(batch) if slots_given else None
    positions = torch.tensor([len(p) for p in prompts])
    ids = torch.arange(7, 7 + batch)
    with torch.inference_mode():
        static_prefill(model, parallel, cache, prompts, "cpu")
        static_decode_step(model, parallel, cache, ids, slots, positions)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            static_decode_step(model, parallel, cache, ids, slots, positions + 1)
    events = list(prof.events())
    ops = _top_level(events)
    names = Counter(e.name for e in ops)
    return {
        "index": sum(n for name, n in names.items() if name in INDEX),
        "copies": sum(n for name, n in names.items() if name in COPIES),
        "casts": _casts(events, ops),
        "launches": sum(n for name, n in names.items() if name not in VIEWS and name != "aten::to") + _casts(events, ops),
        # clones at any depth (a reshape of a strided view copies inside its own op)
        "nested_clones": sum(1 for e in events if e.name == "aten::clone"),
        "names": dict(names),
    }


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_step_runs_no_copies_and_one_index_op_per_cache_write(batch):
    counts = decode_step_ops(slots_given=False, batch=batch)
    layers = model_config("qwen3").num_layers
    # per layer: index_put_ of keys and of values; per step: one rotary lookup
    assert counts["index"] == 2 * layers + 1, counts
    assert counts["names"].get("aten::index_put_") == 2 * layers, counts
    assert counts["copies"] == 0, counts
    assert counts["nested_clones"] == 0, counts
    # one GEMM for q, k and v, o, gate_up and down per layer, and the head
    assert counts["names"].get("aten::linear") == 4 * layers + 1, counts
    # the casts left are the norms' own (fp32 compute, rounded back): 4 per add + norm, 2 per
    # q/k norm; attention and rope add none
    assert counts["casts"] <= 12 * layers + 2, counts


def test_decode_step_with_explicit_slots_gathers_only_the_slots():
    counts = decode_step_ops(slots_given=True)
    layers = model_config("qwen3").num_layers
    # + an index_select of keys and of values per layer: the slots' rows
    assert counts["index"] == 4 * layers + 1, counts
    assert counts["copies"] == 0, counts


def test_decode_step_launches_at_most_246_ops():
    """The whole step (4 layers) launches at most 246 ops, views and no-op casts left out (the
    split of the one q/k/v GEMM's output into q, k and v is a view)."""
    counts = decode_step_ops(slots_given=False)
    assert counts["launches"] <= 246, counts
