"""`Topology` (sizes) and `Parallel` (sizes, this rank, and one Collectives per group).

These two objects replace the process-wide parallel state a serving engine usually keeps in
globals: a boundary is built against one `Parallel` and reads nothing else.

Rank layout inside one pipeline stage (`tp` ranks):

    tp_rank = (dp_rank * attn_cp + cp_rank) * attn_tp + attn_tp_rank
    tp_rank = ep_rank * moe_tp + moe_tp_rank
    global  = pp_rank * tp + tp_rank
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import attrs

from ._graph import register_graph_object
from .collectives import Collectives, SingleRankCollectives, TorchCollectives

__all__ = ["Topology", "Parallel", "GROUP_NAMES", "TopologyError"]

#: Every group a Parallel carries, in the order groups are created on every rank.
GROUP_NAMES = ("tp", "attn_tp", "attn_cp", "attn_dp", "moe_ep", "moe_tp", "pp")


class TopologyError(ValueError):
    """The requested sizes do not describe a valid layout of ranks."""


def _positive(instance, attribute, value):
    if value is not None and (not isinstance(value, int) or value < 1):
        raise TopologyError(f"{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen(kw_only=True)
class Topology:
    """Parallel sizes. `attn_tp` and `moe_tp` default to what divides the rest of `tp`."""

    tp: int = attrs.field(default=1, validator=_positive)
    attn_dp: int = attrs.field(default=1, validator=_positive)
    attn_cp: int = attrs.field(default=1, validator=_positive)
    attn_tp: int = attrs.field(default=None, validator=_positive)
    moe_ep: int = attrs.field(default=1, validator=_positive)
    moe_tp: int = attrs.field(default=None, validator=_positive)
    pp: int = attrs.field(default=1, validator=_positive)

    def __attrs_post_init__(self):
        outer = self.attn_dp * self.attn_cp
        if self.attn_tp is None:
            if self.tp % outer:
                raise TopologyError(
                    f"tp={self.tp} is not divisible by attn_dp*attn_cp={outer}; choose tp as a multiple of attn_dp*attn_cp"
                )
            object.__setattr__(self, "attn_tp", self.tp // outer)
        if self.attn_tp * outer != self.tp:
            raise TopologyError(
                f"tp={self.tp} must equal attn_dp*attn_cp*attn_tp={self.attn_dp}*{self.attn_cp}*{self.attn_tp}; "
                "tp must be divisible by attn_tp"
            )
        if self.moe_tp is None:
            if self.tp % self.moe_ep:
                raise TopologyError(f"tp={self.tp} is not divisible by moe_ep={self.moe_ep}; choose moe_ep dividing tp")
            object.__setattr__(self, "moe_tp", self.tp // self.moe_ep)
        if self.moe_ep * self.moe_tp != self.tp:
            raise TopologyError(
                f"tp={self.tp} must equal moe_ep*moe_tp={self.moe_ep}*{self.moe_tp}; choose moe sizes whose product is tp"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def coordinates(self, rank: int) -> dict[str, int]:
        """Per-axis ranks of a global rank."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside a world of {self.world_size} ranks")
        pp_rank, tp_rank = divmod(rank, self.tp)
        attn_tp_rank = tp_rank % self.attn_tp
        cp_rank = (tp_rank // self.attn_tp) % self.attn_cp
        dp_rank = tp_rank // (self.attn_tp * self.attn_cp)
        ep_rank, moe_tp_rank = divmod(tp_rank, self.moe_tp)
        return {
            "pp": pp_rank,
            "tp": tp_rank,
            "attn_tp": attn_tp_rank,
            "attn_cp": cp_rank,
            "attn_dp": dp_rank,
            "moe_ep": ep_rank,
            "moe_tp": moe_tp_rank,
        }

    def groups(self) -> dict[str, list[tuple[int, ...]]]:
        """Every group of every axis as tuples of global ranks, in a fixed order."""
        out: dict[str, list[tuple[int, ...]]] = {name: [] for name in GROUP_NAMES}
        coords = [self.coordinates(r) for r in range(self.world_size)]

        def members(axis: str, fixed: Sequence[str]) -> list[tuple[int, ...]]:
            buckets: dict[tuple[int, ...], list[int]] = {}
            for r, c in enumerate(coords):
                buckets.setdefault(tuple(c[f] for f in fixed), []).append(r)
            return [tuple(sorted(v, key=lambda r: coords[r][axis])) for _, v in sorted(buckets.items())]

        out["tp"] = members("tp", ["pp"])
        out["attn_tp"] = members("attn_tp", ["pp", "attn_dp", "attn_cp"])
        out["attn_cp"] = members("attn_cp", ["pp", "attn_dp", "attn_tp"])
        out["attn_dp"] = members("attn_dp", ["pp", "attn_cp", "attn_tp"])
        out["moe_ep"] = members("moe_ep", ["pp", "moe_tp"])
        out["moe_tp"] = members("moe_tp", ["pp", "moe_ep"])
        out["pp"] = members("pp", ["tp"])
        return out

    def describe(self) -> str:
        parts = [f"tp={self.tp}"]
        for name in ("attn_dp", "attn_cp", "attn_tp", "moe_ep", "moe_tp", "pp"):
            parts.append(f"{name}={getattr(self, name)}")
        return " ".join(parts)


@attrs.frozen(kw_only=True)
class Parallel:
    """A frozen topology seen from one rank, with one Collectives per group.

    Build it with `Parallel.single()` (one rank), `Parallel.from_torch()` (an initialised
    `torch.distributed` world; the groups are created here), `Parallel.from_process_groups()`
    (groups an engine already has) or `Parallel.create()` (any Collectives factory, e.g. the
    threaded test world).
    """

    topology: Topology
    rank: int
    groups: Mapping[str, Collectives] = attrs.field(repr=False)
    coords: Mapping[str, int] = attrs.field(init=False, repr=False)
    # sizes (tp, attn_tp, ...) read through to the topology; *_rank give this rank's coordinates.
    # Plain attributes, set once here: the hot path and a compiler's tracer (Dynamo) read them
    # like any other attribute.
    tp: int = attrs.field(init=False, repr=False, eq=False)
    attn_tp: int = attrs.field(init=False, repr=False, eq=False)
    attn_cp: int = attrs.field(init=False, repr=False, eq=False)
    attn_dp: int = attrs.field(init=False, repr=False, eq=False)
    moe_ep: int = attrs.field(init=False, repr=False, eq=False)
    moe_tp: int = attrs.field(init=False, repr=False, eq=False)
    pp: int = attrs.field(init=False, repr=False, eq=False)
    world_size: int = attrs.field(init=False, repr=False, eq=False)
    tp_rank: int = attrs.field(init=False, repr=False, eq=False)
    attn_tp_rank: int = attrs.field(init=False, repr=False, eq=False)
    attn_cp_rank: int = attrs.field(init=False, repr=False, eq=False)
    attn_dp_rank: int = attrs.field(init=False, repr=False, eq=False)
    moe_ep_rank: int = attrs.field(init=False, repr=False, eq=False)
    moe_tp_rank: int = attrs.field(init=False, repr=False, eq=False)
    pp_rank: int = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self):
        coords = self.topology.coordinates(self.rank)
        object.__setattr__(self, "coords", coords)
        for name in GROUP_NAMES:
            object.__setattr__(self, name, getattr(self.topology, name))
            object.__setattr__(self, f"{name}_rank", coords[name])
        object.__setattr__(self, "world_size", self.topology.world_size)
        missing = [g for g in GROUP_NAMES if g not in self.groups]
        if missing:
            raise TopologyError(f"Parallel needs a Collectives for every group; missing {missing}")
        for name in GROUP_NAMES:
            group = self.groups[name]
            expected = getattr(self.topology, name) if name != "tp" else self.topology.tp
            if group.size != expected:
                raise TopologyError(f"group {name!r} has {group.size} ranks but the topology says {expected}")
            if group.rank != coords[name]:
                raise TopologyError(
                    f"group {name!r} reports rank {group.rank}, but global rank {self.rank} is rank {coords[name]} of {name}"
                )
        for name, group in self.groups.items():  # what a compiled region's collective ops find them by
            try:
                register_graph_object(group, f"{name}@rank{self.rank}")
            except TypeError:
                pass  # a slotted Collectives of an engine's own: usable where it traces natively

    # sizes and ranks ----------------------------------------------------------------------
    def group(self, name: str) -> Collectives:
        try:
            return self.groups[name]
        except KeyError:
            raise KeyError(f"unknown group {name!r}; groups are {GROUP_NAMES}") from None

    # constructors -------------------------------------------------------------------------
    @classmethod
    def create(
        cls, topology: Topology, rank: int, make_group: Callable[[str, tuple[int, ...]], Collectives]
    ) -> "Parallel":
        """Call `make_group(name, ranks)` for this rank's group of each axis.

        Groups of size one become `SingleRankCollectives` without calling the factory.
        """
        groups: dict[str, Collectives] = {}
        for name, all_groups in topology.groups().items():
            mine = next(g for g in all_groups if rank in g)
            groups[name] = SingleRankCollectives(name, rank) if len(mine) == 1 else make_group(name, mine)
        return cls(topology=topology, rank=rank, groups=groups)

    @classmethod
    def single(cls) -> "Parallel":
        """One rank, no communication."""
        return cls.create(Topology(), 0, lambda name, ranks: SingleRankCollectives(name))

    @classmethod
    def from_torch(cls, topology: Topology) -> "Parallel":
        """Create every group on an initialised `torch.distributed` world.

        `new_group` is collective: every rank creates every group in the same order, and each
        keeps the groups it belongs to. Identical rank sets share one process group.
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
        if dist.get_world_size() != topology.world_size:
            raise TopologyError(
                f"the world has {dist.get_world_size()} ranks but the topology needs {topology.world_size} ({topology.describe()})"
            )
        rank = dist.get_rank()
        created: dict[tuple[int, ...], object] = {}
        mine: dict[str, Collectives] = {}
        for name, all_groups in topology.groups().items():
            for ranks in all_groups:
                if len(ranks) > 1 and ranks not in created:
                    created[ranks] = dist.new_group(list(ranks))
                if rank in ranks:
                    mine[name] = (
                        SingleRankCollectives(name, rank)
                        if len(ranks) == 1
                        else TorchCollectives(name, created[ranks], ranks)
                    )
        return cls(topology=topology, rank=rank, groups=mine)

    @classmethod
    def from_process_groups(cls, topology: Topology, rank: int, process_groups: Mapping[str, object]) -> "Parallel":
        """Wrap process groups an engine already created (one per axis of size > 1)."""
        import torch.distributed as dist

        def make(name, ranks):
            if name not in process_groups:
                raise TopologyError(f"no process group given for axis {name!r} (ranks {ranks})")
            pg = process_groups[name]
            got = tuple(dist.get_process_group_ranks(pg))
            if tuple(sorted(got)) != tuple(sorted(ranks)):
                raise TopologyError(f"process group for {name!r} holds ranks {got}, the topology expects {ranks}")
            return TorchCollectives(name, pg, ranks)

        return cls.create(topology, rank, make)

    def with_groups(self, wrap: Callable[[Collectives], Collectives]) -> "Parallel":
        """The same topology with every group wrapped (e.g. by CountingCollectives)."""
        return Parallel(topology=self.topology, rank=self.rank, groups={k: wrap(v) for k, v in self.groups.items()})

