"""LoRA for the reference decoder: tensor-parallel low-rank adapters, several in one batch.

`y = W x + s * B (A x)` per adapter (`s = alpha / rank`, as peft computes it), sharded like the
base weight it adapts:

- column-parallel projections (q, k, v, gate, up) keep A whole and take B's rows for this
  rank's output features: each rank adds its own features' delta, with no communication;
- row-parallel projections (o, down) take A's columns for this rank's input shard and keep B
  whole: `B (A_shard x_shard)` is a partial, added to the base partial before the sum
  (`RowParallelLinear.shard_addend`), so the one sum that completes the base output completes
  the LoRA output too, whether compute runs it or the boundary defers it.

Which adapter each row uses comes from the rows the stage published for its compute input
(the stage is built with `publish_rows=("lora",)`; the layer-boundary-lora plugin fills in
`get_compute_rows().published["lora"]`): DP-local rows for attention, every DP rank's rows for
an FFN under attention DP. The engine names each row's adapter in `Forward.extras["lora_ids"]`.
"""

from __future__ import annotations

from typing import Mapping, Optional

import attrs
import torch
from torch import nn

from layer_boundary import get_compute_rows
from layer_boundary import shard_cols, shard_rows
from .mlp import TPGatedMLP

__all__ = [
    "QWEN3_TARGETS",
    "LORA_IDS",
    "LoraAdapterSpec",
    "LoraSpec",
    "LoraSlots",
    "LoraGatedMLP",
    "attach_attention_lora",
    "random_lora_spec",
    "random_lora_weights",
    "load_lora",
    "request_adapters",
    "row_adapter_ids",
]

QWEN3_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
#: the Forward.extras key the lora plugin reads: the adapter slot of each of this rank's rows
LORA_IDS = "lora_ids"


@attrs.frozen
class LoraAdapterSpec:
    name: str
    rank: int
    alpha: float

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@attrs.frozen
class LoraSpec:
    """The adapters a model holds (slot i is `adapters[i]`) and the projections they adapt."""

    adapters: tuple = attrs.field(converter=tuple)
    targets: tuple = attrs.field(default=QWEN3_TARGETS, converter=tuple)

    def __attrs_post_init__(self):
        if not self.adapters:
            raise ValueError("a LoRA spec needs at least one adapter")
        unknown = sorted(set(self.targets) - set(QWEN3_TARGETS))
        if unknown:
            raise ValueError(f"LoRA targets {unknown} are not projections of the reference decoder; choose from {QWEN3_TARGETS}")
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA adapter names must be unique, got {names}")


def random_lora_spec(count: int, targets=QWEN3_TARGETS) -> LoraSpec:
    """`count` adapters of different ranks (4, 8, 2, ...) and scalings (2, 1, 0.5, ...)."""
    if count < 1:
        raise ValueError(f"--lora needs at least one adapter, got {count}")
    ranks, scales = (4, 8, 2), (2.0, 1.0, 0.5)
    return LoraSpec(
        tuple(LoraAdapterSpec(f"adapter{i}", ranks[i % 3], scales[i % 3] * ranks[i % 3]) for i in range(count)),
        targets,
    )


def _shapes(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every target projection, unsharded."""
    H, D, I = config.hidden_size, config.head_dim, config.intermediate_size
    return {
        "q_proj": (H, config.num_heads * D),
        "k_proj": (H, config.num_kv_heads * D),
        "v_proj": (H, config.num_kv_heads * D),
        "o_proj": (config.num_heads * D, H),
        "gate_proj": (H, I),
        "up_proj": (H, I),
        "down_proj": (I, H),
    }


def _module_name(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if target in ATTENTION_TARGETS else 'mlp'}.{target}"


def weight_name(layer: int, target: str, adapter: str, part: str) -> str:
    """The name of one LoRA matrix (`part` "A" or "B"), as peft names it below the model."""
    return f"{_module_name(layer, target)}.lora_{part}.{adapter}.weight"


def random_lora_weights(config, spec: LoraSpec, dtype: torch.dtype, seed: int) -> dict:
    """Seeded random A [rank, in] and B [out, rank] for every adapter, layer and target.

    Both are random (peft starts B at zero, which would make every adapter the base model):
    std 1/sqrt(fan_in) keeps each delta O(1), so a delta on the wrong rows is a large error.
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = _shapes(config)
    out = {}
    for layer in range(config.num_layers):
        for target in spec.targets:
            n_in, n_out = shapes[target]
            for adapter in spec.adapters:
                r = adapter.rank
                out[weight_name(layer, target, adapter.name, "A")] = torch.randn(r, n_in, generator=gen, dtype=torch.float64) / n_in**0.5
                out[weight_name(layer, target, adapter.name, "B")] = torch.randn(n_out, r, generator=gen, dtype=torch.float64) / r**0.5
    return {k: v.to(dtype) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# per-row adapter selection
# ---------------------------------------------------------------------------------------------


def _published_rows(x: torch.Tensor):
    rows = get_compute_rows()
    lora = None if rows is None else rows.published.get("lora")
    if lora is None:
        raise RuntimeError(
            "a LoRA layer ran where no stage published its rows to 'lora': build the stage with "
            "options {'publish_rows': ('lora',)} (needs layer-boundary-lora) and run the layer after the stage's prepare()"
        )
    if rows.num_rows != x.shape[0]:
        raise RuntimeError(
            f"a LoRA layer got {x.shape[0]} rows but stage {rows.stage} published {rows.num_rows} "
            f"({rows.layout.value}) rows; run a stage's compute before the next stage's prepare()"
        )
    return lora


class LoraSlots(nn.Module):
    """The (already sharded) A and B of every adapter slot for one projection.

    `forward(x)` is the delta `s * B (A x)` for each row's adapter (zero for rows without
    one), one pair of GEMMs per adapter present in the batch.
    """

    def __init__(self, in_features: int, out_features: int, spec: LoraSpec, *, dtype=None, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.scalings = tuple(a.scaling for a in spec.adapters)
        for i, adapter in enumerate(spec.adapters):
            self.register_buffer(f"a{i}", torch.zeros(adapter.rank, in_features, dtype=dtype, device=device))
            self.register_buffer(f"b{i}", torch.zeros(out_features, adapter.rank, dtype=dtype, device=device))

    @property
    def num_adapters(self) -> int:
        return len(self.scalings)

    def load(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        with torch.no_grad():
            getattr(self, f"a{slot}").copy_(a)
            getattr(self, f"b{slot}").copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _published_rows(x)
        if rows.segments is None:  # inside a compiled region: every adapter on every row
            return self._dense(x, rows.adapter_ids)
        segments = rows.segments
        delta = x.new_zeros(x.shape[0], self.out_features)
        for slot, rows in segments:
            if slot >= self.num_adapters:
                raise ValueError(f"a row asks for LoRA adapter slot {slot}, but the model holds {self.num_adapters} adapters")
            whole = rows.numel() == x.shape[0]
            xs = x if whole else x.index_select(0, rows)
            a, b = getattr(self, f"a{slot}"), getattr(self, f"b{slot}")
            out = nn.functional.linear(nn.functional.linear(xs, a), b) * self.scalings[slot]
            if whole:
                delta = out
            else:
                delta.index_copy_(0, rows, out)
        return delta

    def _dense(self, x: torch.Tensor, adapter_ids: torch.Tensor) -> torch.Tensor:
        """Each adapter's delta on every row, kept on the rows that use it (zero elsewhere):
        no row count depends on tensor data, so the graph holds it."""
        ids = torch.ops.layer_boundary.checked_adapter_slots(adapter_ids, self.num_adapters).unsqueeze(1)
        delta = x.new_zeros(x.shape[0], self.out_features)
        for slot, scaling in enumerate(self.scalings):
            a, b = getattr(self, f"a{slot}"), getattr(self, f"b{slot}")
            delta = torch.where(ids == slot, nn.functional.linear(nn.functional.linear(x, a), b) * scaling, delta)
        return delta

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, adapters={self.num_adapters}"


def _check_adapter_slots(adapter_ids: torch.Tensor, num_adapters: int) -> None:
    above = adapter_ids[adapter_ids >= num_adapters]
    if above.numel():
        raise ValueError(f"a row asks for LoRA adapter slot {int(above.min())}, but the model holds {num_adapters} adapters")


@torch.library.custom_op("layer_boundary::checked_adapter_slots", mutates_args=())
def checked_adapter_slots(adapter_ids: torch.Tensor, num_adapters: int) -> torch.Tensor:
    """The ids, after the eager layer's check that every slot names an adapter the model holds
    (run when a compiled graph runs; its output feeds the masks, so no compiler drops it)."""
    _check_adapter_slots(adapter_ids, num_adapters)
    return adapter_ids.clone()


@checked_adapter_slots.register_fake
def _(adapter_ids, num_adapters):
    return torch.empty_like(adapter_ids)


#: the `TPAttention` attribute that adds each column-parallel target's delta to its slice of
#: the fused q/k/v projection
QKV_ADDENDS = {"q_proj": "q_addend", "k_proj": "k_addend", "v_proj": "v_addend"}


def attach_attention_lora(attn, spec: LoraSpec, *, dtype=None, device=None) -> None:
    """Give a `TPAttention` the LoRA slots of `spec`'s attention targets.

    q/k/v add their delta to their slice of the fused projection's output (the attention's
    `q_addend`, `k_addend`, `v_addend`); o adds its partial before the attention-TP sum, which
    the boundary owns (`shard_addend`).
    """
    H = attn.qkv_proj.in_features
    local_in_o = attn.o_proj.weight.shape[1]
    column = {"q_proj": attn.q_width, "k_proj": attn.kv_width, "v_proj": attn.kv_width}
    for target, n_out in column.items():
        if target in spec.targets:
            setattr(attn, QKV_ADDENDS[target], LoraSlots(H, n_out, spec, dtype=dtype, device=device))
    if "o_proj" in spec.targets:
        attn.o_proj.shard_addend = LoraSlots(local_in_o, attn.o_proj.out_features, spec, dtype=dtype, device=device)


class LoraGatedMLP(TPGatedMLP):
    """The gated MLP with LoRA on gate, up (column-parallel) and down (row-parallel)."""

    def __init__(self, hidden: int, intermediate: int, group, act: str, spec: LoraSpec, *, dtype=None, device=None):
        super().__init__(hidden, intermediate, group, act, dtype=dtype, device=device)
        targets = spec.targets
        self.lora_gate = LoraSlots(hidden, self.local, spec, dtype=dtype, device=device) if "gate_proj" in targets else None
        self.lora_up = LoraSlots(hidden, self.local, spec, dtype=dtype, device=device) if "up_proj" in targets else None
        if "down_proj" in targets:
            self.down.shard_addend = LoraSlots(self.local, hidden, spec, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the deltas go into the halves of the projection's (fresh) output in place (the same
        # adds as `gate + delta`), so `activate` reads one [tokens, 2 * local] buffer, which is
        # what a gated-activation kernel takes
        gate_up = nn.functional.linear(x, self.gate_up)
        if self.lora_gate is not None:
            gate_up[..., : self.local] += self.lora_gate(x)
        if self.lora_up is not None:
            gate_up[..., self.local :] += self.lora_up(x)
        return self.down(self.activate(gate_up))


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def _sites(layer) -> dict:
    """target -> (slots, shard of A, shard of B) for one decoder layer on this rank."""
    attn, mlp = layer.self_attn, layer.mlp
    a_group, group = attn.group, mlp.group
    whole = lambda t: t  # noqa: E731
    sites = {}
    for target, attribute in QKV_ADDENDS.items():
        slots = getattr(attn, attribute)
        if slots is not None:
            rows = (lambda t: shard_rows(t, a_group.rank, a_group.size)) if target == "q_proj" else (lambda t: t[attn.kv_rows()])
            sites[target] = (slots, whole, rows)
    if attn.o_proj.shard_addend is not None:
        sites["o_proj"] = (attn.o_proj.shard_addend, lambda t: shard_cols(t, a_group.rank, a_group.size), whole)
    by_rows = lambda t: shard_rows(t, group.rank, group.size)  # noqa: E731
    if mlp.lora_gate is not None:
        sites["gate_proj"] = (mlp.lora_gate, whole, by_rows)
    if mlp.lora_up is not None:
        sites["up_proj"] = (mlp.lora_up, whole, by_rows)
    if mlp.down.shard_addend is not None:
        sites["down_proj"] = (mlp.down.shard_addend, lambda t: shard_cols(t, group.rank, group.size), whole)
    return sites


@torch.no_grad()
def load_lora(model, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy every adapter's A and B (full, `weight_name` names) into the model, sharded per rank."""
    spec: Optional[LoraSpec] = getattr(model, "lora", None)
    if spec is None:
        raise ValueError("this model was built without LoRA; build it with lora=LoraSpec(...)")
    ref = next(model.parameters())

    def take(name):
        t = weights.get(name)
        if t is None:
            raise KeyError(f"the LoRA weights have no tensor {name!r}; were they drawn for this spec and config?")
        return t.to(dtype=ref.dtype, device=ref.device)

    for i, layer in zip(model.layer_ids, model.layers):
        for target, (slots, shard_a, shard_b) in _sites(layer).items():
            for slot, adapter in enumerate(spec.adapters):
                a = take(weight_name(i, target, adapter.name, "A"))
                b = take(weight_name(i, target, adapter.name, "B"))
                slots.load(slot, shard_a(a), shard_b(b))


# ---------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------


def request_adapters(num_requests: int, count: int, assignment=None) -> tuple[int, ...]:
    """The adapter slot of every request: round-robin over `count` adapters, or `assignment`
    (a slot per request, -1 for the base model)."""
    if assignment is None:
        return tuple(r % count for r in range(num_requests))
    assignment = tuple(int(a) for a in assignment)
    if len(assignment) != num_requests or not all(-1 <= a < count for a in assignment):
        raise ValueError(f"a LoRA assignment needs one slot in [-1, {count}) per request ({num_requests}), got {assignment}")
    return assignment


def row_adapter_ids(adapters, counts, device=None) -> torch.Tensor:
    """Per-row ids (`Forward.extras["lora_ids"]`) for requests of `counts` rows each."""
    if not counts:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.repeat_interleave(torch.tensor(list(adapters), dtype=torch.long), torch.tensor(list(counts))).to(device)
