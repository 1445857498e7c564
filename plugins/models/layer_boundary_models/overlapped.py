"""Running a reference model's layers as two-batch overlap (`Forward.extras["tbo"]`).

A layer offers `operations(hidden_states, forward, step, rope, cache)`, a generator that yields
between its stages; the "tbo" adapter (from layer-boundary-tbo, found through
`layer_boundary.two_batch_overlap`) splits the batch and lets the two microbatches take turns.
"""

from __future__ import annotations

from typing import Optional

from layer_boundary import two_batch_overlap
from .attention import KVCache, StepLayout

__all__ = ["run_layers", "run_overlapped", "step_rows", "run_operations"]


def run_layers(layers, hidden_states, forward, step: StepLayout, rope, cache: Optional[KVCache]):
    """A model's layers in order, or as two-batch overlap when `forward.extras["tbo"]` is set."""
    if forward.extras.get("tbo"):
        return run_overlapped(layers, hidden_states, forward, step, rope, cache)
    for layer in layers:
        hidden_states = layer(hidden_states, forward, step, rope, cache)
    return hidden_states


def run_operations(operations):
    """Run a layer's operations generator to its end (no microbatch to switch to); its result."""
    while True:
        try:
            next(operations)
        except StopIteration as done:
            # the value from `args`: a compiler's tracer (Dynamo) gives `.value` as a new tensor
            # object, which the boundary's identity check of the handle would then reject
            return done.args[0] if done.args else None


def step_rows(step: StepLayout, start: int, stop: int) -> StepLayout:
    """The layout of rows start:stop of a step. A request cut at `start` continues after the rows
    before it: its past grows by them (they reach the KV cache first, in the earlier microbatch)."""
    rids, counts, past = [], [], []
    for rid, first, count, seen in zip(step.rids, step.starts, step.counts, step.past):
        a, b = max(start, first), min(stop, first + count)
        if a < b:
            rids.append(rid)
            counts.append(b - a)
            past.append(seen + a - first)
    return StepLayout(rids, counts, past, device=step.positions.device)


def run_overlapped(layers, hidden_states, forward, step: StepLayout, rope, cache: Optional[KVCache]):
    """Layers as two-batch overlap: the microbatches take turns at each layer's operations
    (`layer.operations(...)`, a generator) and between layers.

    A request cut between the microbatches reads its first rows' keys from the cache: microbatch
    0 runs each attention first, on the CPU and, ordered by the adapter, on GPU streams; without
    a cut request the microbatches share no state and their streams run unordered.
    """
    # On a GPU each microbatch allocates on its own stream: keep every cache tensor this step
    # replaces alive until both streams are done with it (the adapter joins them on return).
    held = [] if cache is not None and hidden_states.is_cuda else None

    def keep_cache():
        if held is not None:
            held.append([dict(entries) for entries in cache.layers])

    def stages(hidden_states, microbatch, facts):
        mb_step, mb_rope = facts
        for layer in layers:
            operations = layer.operations(hidden_states, microbatch, mb_step, mb_rope, cache)
            while True:
                try:
                    next(operations)
                except StopIteration as done:
                    hidden_states = done.args[0] if done.args else None  # see run_operations
                    break
                keep_cache()
                yield
            keep_cache()
            yield
        return hidden_states

    def context(start, stop):
        return step_rows(step, start, stop), (rope[0][start:stop], rope[1][start:stop])

    keep_cache()
    overlap = two_batch_overlap(forward)
    split = overlap.plan(forward).first
    cut = split[forward.parallel.attn_dp_rank]
    shares_a_request = 0 < cut < step.num_tokens and cut not in step.starts
    return overlap.run(stages, hidden_states, forward, context=context, split=split, ordered=shares_a_request)
