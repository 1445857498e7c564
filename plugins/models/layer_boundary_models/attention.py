"""Tensor-parallel attention with rotary embeddings and a simple per-request KV cache.

Arithmetic mirrors Hugging Face's eager attention (cos/sin in fp32 then cast, softmax in fp32,
the causal mask added as the dtype's minimum), so float64 runs agree to ~1e-12.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from layer_boundary import Linear, RMSNorm, RowParallelLinear, shard_rows
from layer_boundary.plugin import DecodeLayout, StepLayout

__all__ = ["RotaryEmbedding", "KernelRope", "KVCache", "StaticKVCache", "TPAttention", "StepLayout", "DecodeLayout", "BoundDecodeLayout",
           "attend_requests", "attend_static_prefill", "attend_static_decode", "causal_probs"]


class BoundDecodeLayout(DecodeLayout):
    """A decode step with its cache facts, computed once per step for every layer
    (`StaticKVCache.bind`): where each row's keys land in the flattened cache (`write_index`),
    the additive mask over the cache length (`key_bias`), what a step-bound decode-attention
    kernel returned from its `bind_step` (it then writes the keys and values itself), and the
    mask of the sliding-window layers (`window_bias`, a cache made with a `sliding_window`:
    `key_bias` that also hides the keys the window has passed)."""

    __slots__ = ("write_index", "key_bias", "kernel_state", "window_bias")

    def __init__(
        self, slots: Optional[torch.Tensor], positions: torch.Tensor, *, write_index=None, key_bias=None, kernel_state=None, window_bias=None
    ):
        super().__init__(slots, positions)
        self.write_index = write_index
        self.key_bias = key_bias
        self.kernel_state = kernel_state
        self.window_bias = window_bias

    @property
    def bound(self) -> bool:
        """Whether `StaticKVCache.bind` filled in this step's cache facts."""
        return self.write_index is not None or self.kernel_state is not None


def _static(t: torch.Tensor) -> torch.Tensor:
    """`t`, marked as living at one address for the whole of its life (what
    `torch._dynamo.mark_static_address` records: an attribute, no guard, nothing in eager)."""
    from torch._dynamo import mark_static_address

    mark_static_address(t)
    return t


class StaticKVCache:
    """Preallocated keys/values [slots, kv_heads_local, max_len, head_dim] per layer; writes and
    reads use device index tensors, so a decode step has fixed shapes and no host sync.

    `rope_table` ([max_len, 2, rotary channels]: cos, sin, in the dtype the model's rotation
    takes them; set by the model that made the cache) lets a step look its rotary factors up
    instead of computing them.

    Every tensor it holds is marked a static address for torch.compile: a compiled step writes
    the cache in place, and CUDA graph trees (`mode="reduce-overhead"`) capture a graph that
    mutates an input only when that input's address is static (as parameters' are); unmarked,
    they skip the capture and run the compiled graph uncaptured.

    `sliding_window` (a model with sliding-window layers): `bind` also computes the step's
    window mask (`DecodeLayout.window_bias`). `rope_tables` holds named tables in
    `rope_table`'s layout, for a model whose layers rotate with different bases."""

    def __init__(
        self, num_layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int, *, dtype, device, sliding_window: Optional[int] = None
    ):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [_static(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
        self.v = [_static(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
        self.slots, self.kv_heads, self.max_len, self.head_dim = slots, kv_heads, max_len, head_dim
        self.sliding_window = sliding_window
        self._rope_table: Optional[torch.Tensor] = None
        self.rope_tables: dict[str, torch.Tensor] = {}

    @property
    def rope_table(self) -> Optional[torch.Tensor]:
        return self._rope_table

    @rope_table.setter
    def rope_table(self, table: Optional[torch.Tensor]) -> None:
        self._rope_table = None if table is None else _static(table)

    def set_rope_tables(self, tables: dict) -> None:
        """Named rotary tables ([max_len, 2, head_dim] each), looked up by `rope(positions, name)`."""
        self.rope_tables = {name: _static(table) for name, table in tables.items()}

    def write_span(self, layer: int, slot: int, start: int, k, v) -> None:
        """k, v: [tokens, kv_heads, D] at positions start.. of one slot (a prefill's request)."""
        stop = start + k.shape[0]
        self.k[layer][slot, :, start:stop] = k.transpose(0, 1)
        self.v[layer][slot, :, start:stop] = v.transpose(0, 1)

    def bind(self, step: DecodeLayout, kernel=None) -> BoundDecodeLayout:
        """`step` with its cache facts, computed once per step for every layer.

        With the torch path (`kernel=None`): the flattened write index [tokens * kv_heads] and
        the additive mask [tokens, 1, 1, max_len] (0 where visible, the dtype's minimum after
        the row's position). With a plugin's decode-attention kernel: no mask (it masks by
        position itself); a step-bound kernel (one with `bind_step`) gets the step here and
        writes the keys and values itself, so no write index either (`kernel_state`)."""
        positions = step.positions
        if step.slots is None and positions.shape[0] > self.slots:
            raise ValueError(
                f"a decode step of {positions.shape[0]} rows with slots=None (row i in slot i) needs as many cache slots; "
                f"this cache has {self.slots}: make it with new_static_cache(slots={positions.shape[0]}, ...) or pass the slots"
            )
        bind_step = getattr(kernel, "bind_step", None)
        if bind_step is not None:
            return BoundDecodeLayout(step.slots, positions, kernel_state=bind_step(self.k[0], step.slots, positions))
        rows = torch.arange(positions.shape[0], device=positions.device) if step.slots is None else step.slots
        heads = torch.arange(self.kv_heads, device=positions.device)
        write_index = ((rows[:, None] * self.kv_heads + heads[None, :]) * self.max_len + positions[:, None]).reshape(-1)
        if kernel is not None:
            return BoundDecodeLayout(step.slots, positions, write_index=write_index)
        dtype = self.k[0].dtype
        keys = torch.arange(self.max_len, device=positions.device)[None, :]
        hidden = keys > positions[:, None]
        key_bias = torch.zeros(hidden.shape, dtype=dtype, device=positions.device).masked_fill_(hidden, torch.finfo(dtype).min)
        window_bias = None
        if self.sliding_window is not None:  # also hidden: keys the window has passed
            passed = keys <= positions[:, None] - self.sliding_window
            window_bias = key_bias.masked_fill(passed, torch.finfo(dtype).min)[:, None, None, :]
        return BoundDecodeLayout(step.slots, positions, write_index=write_index, key_bias=key_bias[:, None, None, :], window_bias=window_bias)

    def write_decode(self, layer: int, step: BoundDecodeLayout, k, v) -> None:
        """k, v: [tokens, kv_heads, D] into the rows `step.write_index` names: one index_put_
        each into the flattened cache (in place, no temporaries). The index is viewed [tokens,
        kv_heads] so k and v are read as they are: views of the fused q/k/v projection (rows
        strided by its width) need no copy to a contiguous [tokens * kv_heads, D] first."""
        D = self.head_dim
        rows = step.write_index.view(k.shape[0], k.shape[1])
        self.k[layer].view(-1, D).index_put_((rows,), k)
        self.v[layer].view(-1, D).index_put_((rows,), v)

    def read_decode(self, layer: int, step: BoundDecodeLayout):
        """(keys, values) [tokens, kv_heads, max_len, D] of the step's slots: views of the cache
        when rows are slots (`slots=None`), else gathered."""
        k, v = self.k[layer], self.v[layer]
        if step.slots is None:
            T = step.positions.shape[0]
            return k[:T], v[:T]
        return k.index_select(0, step.slots), v.index_select(0, step.slots)

    def rope(self, positions: torch.Tensor, table: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [tokens, head_dim] of `positions`: one lookup in `rope_table`, or in the
        named table of `rope_tables`."""
        both = (self.rope_table if table is None else self.rope_tables[table]).index_select(0, positions)
        return both[:, 0], both[:, 1]

    def snapshot(self):
        return [t.clone() for t in self.k], [t.clone() for t in self.v]

    def restore(self, snap) -> None:
        for dst, src in zip(self.k + self.v, snap[0] + snap[1]):
            dst.copy_(src)


class RotaryEmbedding(nn.Module):
    """Rotary factors of base `theta`; `factor` > 1 is linear scaling (positions divided by it,
    applied to the inverse frequencies as Hugging Face's "linear" rope type does)."""

    def __init__(self, head_dim: int, theta: float, factor: float = 1.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if factor != 1.0:
            inv_freq = inv_freq / factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def table(self, length: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        """[length, 2, head_dim]: (cos, sin) of positions 0..length-1, the values `forward`
        gives them, built once (a static cache's steps look theirs up)."""
        device = self.inv_freq.device if device is None else device
        cos, sin = self(torch.arange(length, device=device), dtype)
        return torch.stack((cos, sin), dim=1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim]. `x * cos + rotate_half(x) *
    sin` written into one new tensor: the rotated half is read from slices of `x` (no cat, no
    negated copy)."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


def causal_probs(scores: torch.Tensor, count: int, *, softcap: Optional[float] = None, window: Optional[int] = None) -> torch.Tensor:
    """Softmax weights of `scores` [heads, count, total]: the last `count` of `total` positions
    query (rows in order), the soft cap first, then the causal mask (and the sliding window's),
    softmax in fp32, as Hugging Face's eager attention computes them."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    total = scores.shape[-1]
    if count > 1 or (window is not None and total > window):
        # key j is visible to row i (position total - count + i) when j <= that position and,
        # in a window, j > that position - window
        mask = torch.ones(count, total, dtype=torch.bool, device=scores.device).tril(total - count)
        if window is not None:
            mask = mask.triu(total - count - window + 1)
        scores = scores + torch.zeros_like(mask, dtype=scores.dtype).masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


def attend_requests(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step, cache: Optional["KVCache"], layer: int, scaling: float, *,
                    softcap: Optional[float] = None, window: Optional[int] = None):
    """Causal attention of each request of `step` over its cached past and its new rows, as
    Hugging Face's eager attention computes it (scores in the input's dtype, `causal_probs`):
    q [tokens, heads, D], k and v [tokens, kv_heads, D] (KV heads shared by consecutive query
    heads); the new keys and values join `cache` at `layer`. Returns [tokens, heads, D]."""
    T, heads, D = q.shape
    out = q.new_empty(T, heads, D)
    groups = heads // k.shape[1]
    for rid, start, count in zip(step.rids, step.starts, step.counts):
        qs = q[start : start + count].transpose(0, 1)  # [heads, count, D]
        ks = k[start : start + count].transpose(0, 1)
        vs = v[start : start + count].transpose(0, 1)
        if cache is not None:
            ks, vs = cache.append(layer, rid, ks, vs)
        ks = ks.repeat_interleave(groups, dim=0)
        vs = vs.repeat_interleave(groups, dim=0)
        probs = causal_probs(torch.matmul(qs, ks.transpose(1, 2)) * scaling, count, softcap=softcap, window=window)
        out[start : start + count] = torch.matmul(probs, vs).transpose(0, 1)
    return out


def attend_static_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepLayout, cache: "StaticKVCache", layer: int,
                          scaling: float, *, softcap: Optional[float] = None, window: Optional[int] = None) -> torch.Tensor:
    """`attend_requests` against a static cache: each request of `step` (its slot is its rid)
    writes its keys and values at its positions, then attends over the slot's keys so far, as
    Hugging Face's eager attention does. q [tokens, heads, D], k and v [tokens, kv_heads, D];
    returns [tokens, heads, D]."""
    T, heads, D = q.shape
    groups = heads // k.shape[1]
    out = q.new_empty(T, heads, D)
    for slot, start, count, past in zip(step.rids, step.starts, step.counts, step.past):
        rows = slice(start, start + count)
        cache.write_span(layer, slot, past, k[rows], v[rows])
        total = past + count
        ks = cache.k[layer][slot, :, :total].repeat_interleave(groups, dim=0)
        vs = cache.v[layer][slot, :, :total].repeat_interleave(groups, dim=0)
        qs = q[rows].transpose(0, 1)
        probs = causal_probs(torch.matmul(qs, ks.transpose(1, 2)) * scaling, count, softcap=softcap, window=window)
        out[rows] = torch.matmul(probs, vs).transpose(0, 1)
    return out


def attend_static_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: DecodeLayout, cache: "StaticKVCache", layer: int,
                         scaling: float, *, softcap: Optional[float] = None, window: Optional[int] = None, kernel=None) -> torch.Tensor:
    """One token per row against the whole cache length: q [tokens, heads, D], k and v [tokens,
    kv_heads, D] of the step's rows; returns [tokens, heads, D]. No host sync, no data-dependent
    shape: a decode step through it can be captured in a CUDA graph.

    Writes in place (index_put_ on the step's precomputed index), reads the slots as views,
    and shares each KV head across its query group by a view of the queries ([tokens,
    kv_heads, group, D]) instead of repeating keys and values. `kernel`: a plugin's decode
    attention (`DecodeAttentionKernel`), else the torch path."""
    if not isinstance(step, BoundDecodeLayout) or not step.bound or (kernel is None and step.key_bias is None):  # a layout nobody bound for this path
        step = cache.bind(step, kernel)
    if window is not None and step.window_bias is None:
        raise ValueError(
            f"layer {layer} has a sliding window of {window}: decode it through a cache made with "
            f"sliding_window={window} (the model's new_static_cache), whose bind() computes the window mask"
        )
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    if step.kernel_state is not None:  # a step-bound kernel: its own write, then its attention
        kernel.write(step.kernel_state, k, v, k_cache, v_cache)
        return kernel.attend(step.kernel_state, q, k_cache, v_cache)
    cache.write_decode(layer, step, k, v)
    if kernel is not None:  # a plugin's decode attention over the cache as it is
        return kernel(q, k_cache, v_cache, step.slots, step.positions)
    keys, values = cache.read_decode(layer, step)  # [T, kv_heads, L, D]
    T, heads, D = q.shape
    kv_heads = k.shape[1]
    grouped = q.view(T, kv_heads, heads // kv_heads, D)
    if softcap is not None or window is not None:  # Hugging Face's order: scale, cap, then mask
        scores = torch.matmul(grouped, keys.transpose(-1, -2)) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores + (step.key_bias if window is None else step.window_bias)
    else:
        scores = torch.add(step.key_bias, torch.matmul(grouped, keys.transpose(-1, -2)), alpha=scaling)
    # HF's eager softmax runs in fp32; half types' kernels accumulate in fp32 already (one
    # launch, no round trip), wider types keep the fp32 softmax HF computes
    if scores.dtype in (torch.bfloat16, torch.float16):
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    return torch.matmul(probs, values).view(T, heads, D)


class KernelRope:
    """A plugin's rope kernel bound to a step's positions: what the attention calls on its
    queries and keys in place of the (cos, sin) rotation (`RopeKernel`).

    `fused`, when set, is the model's `QKNormRopeKernel`: an attention with q/k norms calls
    `fused(q, k, positions, q_weight, k_weight)` in place of both norms and the rotation.
    `kernel` may then be None (no rope kernel was chosen); calling this object rotates with the
    (cos, sin) factors of `table` (the static cache's `rope_table`) instead, as the torch path
    does."""

    __slots__ = ("kernel", "positions", "fused", "table")

    def __init__(self, kernel, positions: torch.Tensor, fused=None, table: Optional[torch.Tensor] = None):
        if kernel is None and table is None:
            raise ValueError("a KernelRope without a rope kernel needs the cache's rope table")
        self.kernel = kernel
        self.positions = positions
        self.fused = fused
        self.table = table

    def __call__(self, q: torch.Tensor, k: torch.Tensor):
        if self.kernel is None:
            both = self.table.index_select(0, self.positions)
            cos, sin = both[:, 0], both[:, 1]
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.kernel(q, k, self.positions)


class KVCache:
    """Keys and values per layer per request: [kv_heads_local, length, head_dim]."""

    def __init__(self, num_layers: int):
        self.layers: list[dict] = [dict() for _ in range(num_layers)]

    def append(self, layer: int, rid, k: torch.Tensor, v: torch.Tensor):
        store = self.layers[layer]
        if rid in store:
            pk, pv = store[rid]
            k, v = torch.cat((pk, k), dim=1), torch.cat((pv, v), dim=1)
        else:  # a request's first keys and values may be views of the fused q/k/v projection's
            # output: stored as they are they would keep all of it (queries too) alive
            k, v = k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format)
        store[rid] = (k, v)
        return k, v

    def length(self, rid) -> int:
        # the first layer this rank holds (a later pipeline stage leaves the first ones empty)
        entry = next((store[rid] for store in self.layers if rid in store), None)
        return 0 if entry is None else entry[0].shape[1]

    def clear(self) -> None:
        for store in self.layers:
            store.clear()


class TPAttention(nn.Module):
    """Heads split over the attention-TP group; KV heads split, or replicated when fewer than
    the group. By default the output projection never reduces: the boundary owns its sum
    (PARTIAL). A single-stage mixer (SCOPED) passes `reduce_results=True`, so the projection
    follows its exit's flags. Without `rope` (None at call time) no positions are applied.

    Options beyond the Qwen3 attention (Gemma 2/3): `scaling` of the scores (default
    head_dim**-0.5), `softcap` (scores become `softcap * tanh(scores / softcap)` before the
    mask), `sliding_window` (a query sees itself and the `sliding_window - 1` keys before it),
    `qk_norm_type` (the norm class of the q/k norms). `plugin_kernels=False` keeps the static
    path on torch: the kernel requests describe none of these options."""

    def __init__(
        self,
        config,
        parallel,
        layer: int,
        *,
        reduce_results: bool = False,
        scaling: Optional[float] = None,
        softcap: Optional[float] = None,
        sliding_window: Optional[int] = None,
        qk_norm_type: type = RMSNorm,
        plugin_kernels: bool = True,
        dtype=None,
        device=None,
    ):
        super().__init__()
        group = parallel.groups["attn_tp"]
        self.layer = layer
        self.head_dim = config.head_dim
        self.heads = config.num_heads // group.size
        kv = config.num_kv_heads
        self.kv_heads = max(1, kv // group.size)
        self.kv_replicated = kv < group.size
        self.kv_index = group.rank // (group.size // kv) if self.kv_replicated else None
        self.group = group
        self.scaling = config.head_dim**-0.5 if scaling is None else scaling
        self.softcap = softcap
        self.sliding_window = sliding_window
        self.plugin_kernels = plugin_kernels
        H, D = config.hidden_size, config.head_dim
        if config.num_heads % group.size:
            raise ValueError(f"num_heads={config.num_heads} is not divisible by the {group.name} size {group.size}: choose an attention TP that divides it")
        self.q_width = self.heads * D
        self.kv_width = self.kv_heads * D
        # q, k and v in one GEMM: rows [0, q_width) are this rank's query heads, then its K
        # rows, then its V rows (`load_qkv`); one launch where three small ones (each split-K
        # with its own reduce on a GPU) ran, and FP8 inputs quantize the fused weight once
        self.qkv_proj = Linear(H, self.q_width + 2 * self.kv_width, bias=False, dtype=dtype, device=device)
        # modules of the projection input whose output is added to the q, k or v slice after
        # the fused GEMM (LoRA's column-parallel deltas, `attach_attention_lora`); None: nothing
        self.q_addend: Optional[nn.Module] = None
        self.k_addend: Optional[nn.Module] = None
        self.v_addend: Optional[nn.Module] = None
        self.o_proj = RowParallelLinear(config.num_heads * D, H, group, reduce_results=reduce_results, dtype=dtype, device=device)
        self.q_norm = qk_norm_type(D, config.rms_norm_eps, dtype=dtype, device=device) if config.qk_norm else None
        self.k_norm = qk_norm_type(D, config.rms_norm_eps, dtype=dtype, device=device) if config.qk_norm else None
        # the static-cache path's plugin kernels, chosen once per model by prepare_model
        # (`attention_kernels`); None: the torch path
        self.rope_kernel = None
        self.rope_positions = 0  # the positions the rope kernel's table covers
        self.decode_attention_kernel = None
        self.qk_norm_rope_kernel = None  # both q/k norms and the rope in one kernel (`QKNormRopeKernel`)

    def kv_rows(self) -> slice:
        """The output rows of the full [kv_heads * D, H] K/V projections this rank holds."""
        D = self.head_dim
        if self.kv_replicated:
            return slice(self.kv_index * D, (self.kv_index + 1) * D)
        return slice(self.group.rank * self.kv_width, (self.group.rank + 1) * self.kv_width)

    def load_qkv(self, q_full: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor) -> None:
        """Fill the fused projection from the full (checkpoint) weights: q [num_heads * D, H]
        sharded by rows over attention TP, k and v [kv_heads * D, H] at `kv_rows()` (this
        rank's KV heads, or the one it shares when they are replicated)."""
        rows = self.kv_rows()
        q_rows = shard_rows(q_full, self.group.rank, self.group.size)
        w, q, kv = self.qkv_proj.weight, self.q_width, self.kv_width
        with torch.no_grad():
            w[:q].copy_(q_rows)
            w[q : q + kv].copy_(k_full[rows])
            w[q + kv :].copy_(v_full[rows])

    def _qkv(self, x):
        """q [tokens, heads, D], k and v [tokens, kv_heads, D]: views of one GEMM's output (rows
        strided by the fused width), each with its addend's delta when one is set."""
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split((self.q_width, self.kv_width, self.kv_width), dim=-1)
        if self.q_addend is not None:
            q = q + self.q_addend(x)
        if self.k_addend is not None:
            k = k + self.k_addend(x)
        if self.v_addend is not None:
            v = v + self.v_addend(x)
        return q.view(T, self.heads, D), k.view(T, self.kv_heads, D), v.view(T, self.kv_heads, D)

    def forward(self, x: torch.Tensor, step, rope: Optional[tuple], cache, cp=None) -> torch.Tensor:
        if cp is not None:
            return self._forward_context_parallel(x, step, rope, cache, cp)
        if isinstance(cache, StaticKVCache):
            return self._forward_static(x, step, rope, cache)
        T, D = x.shape[0], self.head_dim
        q, k, v = self._qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend_requests(q, k, v, step, cache, self.layer, self.scaling, softcap=self.softcap, window=self.sliding_window)
        return self.o_proj(out.reshape(T, self.heads * D))

    def _project(self, x, rope):
        q, k, v = self._qkv(x)
        if self.q_norm is not None and isinstance(rope, KernelRope) and rope.fused is not None:
            # the plugin's q/k norm + rope kernel: one launch for the two norms and the rotation
            q, k = rope.fused(q, k, rope.positions, self.q_norm.weight, self.k_norm.weight)
            return q, k, v
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is None:
            return q, k, v
        if isinstance(rope, KernelRope):
            q, k = rope(q, k)
            return q, k, v
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _forward_static(self, x, step, rope, cache: "StaticKVCache") -> torch.Tensor:
        """Prefill (a StepLayout: per request, contiguous positions) or decode (a DecodeLayout)
        against the preallocated cache; decode has no host sync and no data-dependent shape."""
        q, k, v = self._project(x, rope)
        T, D = x.shape[0], self.head_dim
        if isinstance(step, DecodeLayout):
            out = attend_static_decode(q, k, v, step, cache, self.layer, self.scaling, softcap=self.softcap, window=self.sliding_window,
                                       kernel=self.decode_attention_kernel)
        else:
            out = attend_static_prefill(q, k, v, step, cache, self.layer, self.scaling, softcap=self.softcap, window=self.sliding_window)
        return self.o_proj(out.reshape(T, self.heads * D))

    def _forward_context_parallel(self, x, step, rope, cache, cp) -> torch.Tensor:
        """Prefill of a context-parallel batch: `x` holds this CP rank's rows (`cp`, the batch's
        token mapping); `step` and `rope` describe the whole batch.

        Reference path, all-gather KV: queries, keys and values are projected on this rank's
        rows, then one all_gatherv over attention CP brings every row's keys and values in token
        order. Each rank attends its own queries against them (a causal mask by position) and
        appends the full keys and values to its cache, so decode runs ordinary on every CP rank.
        """
        if isinstance(cache, StaticKVCache):
            raise NotImplementedError("context-parallel prefill keeps a KVCache; the static (CUDA-graph) cache is decode-only here")
        if self.softcap is not None or self.sliding_window is not None:
            raise NotImplementedError("context-parallel prefill runs plain causal attention: no soft cap, no sliding window")
        if tuple(step.counts) != tuple(cp.lengths):
            raise ValueError(f"the CP token mapping was built for request lengths {tuple(cp.lengths)}, the step has {tuple(step.counts)}")
        cos, sin = rope
        q, k, v = self._project(x, (cp.take_local(cos), cp.take_local(sin)))
        T, D = x.shape[0], self.head_dim
        keys, values = cp.gather(torch.cat((k, v), dim=-1)).split(D, dim=-1)  # [tokens, kv_heads, D] each
        positions = cp.take_local(step.positions)
        out = x.new_empty(T, self.heads, D)
        groups = self.heads // self.kv_heads
        local_start = 0
        for rid, start, count, local in zip(step.rids, step.starts, step.counts, cp.request_counts):
            ks = keys[start : start + count].transpose(0, 1)
            vs = values[start : start + count].transpose(0, 1)
            if cache is not None:
                ks, vs = cache.append(self.layer, rid, ks, vs)
            rows = slice(local_start, local_start + local)
            local_start += local
            if local == 0:
                continue
            ks = ks.repeat_interleave(groups, dim=0)
            vs = vs.repeat_interleave(groups, dim=0)
            qs = q[rows].transpose(0, 1)
            scores = torch.matmul(qs, ks.transpose(1, 2)) * self.scaling
            visible = torch.arange(ks.shape[1], device=x.device)[None, :] <= positions[rows][:, None]
            scores = scores + torch.zeros_like(visible, dtype=scores.dtype).masked_fill(~visible, torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qs.dtype)
            out[rows] = torch.matmul(probs, vs).transpose(0, 1)
        return self.o_proj(out.reshape(T, self.heads * D))
