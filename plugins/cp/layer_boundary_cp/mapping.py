"""The token mapping of a context-parallel batch: which of the batch's rows each attention-CP
rank holds, and the three row moves that all use it.

Every request is partitioned on its own, so each CP rank holds a share of every request:
- "contiguous": the request is cut into `attn_cp` consecutive pieces; rank r takes piece r;
- "zigzag": it is cut into `2 * attn_cp` pieces; rank r takes pieces r and 2*attn_cp-1-r, so
  under a causal mask every rank attends about as many (query, key) pairs (load balance).
Lengths need not divide: pieces follow `split_sizes` (earlier pieces take the extra token), and
a rank may hold no row of a short request.

Row orders:
- token order: the batch's attention rows, request after request (what the model feeds in);
- local order: this rank's rows, request after request, ascending inside a request;
- rank order: every rank's local rows, rank after rank (what an all-gather returns).

Moves (every rank of the attention-CP group builds the mapping from the same lengths, so the
sizes each collective uses agree):
- `take_local(x)`: token order -> local order (no communication);
- `gather(x)`: local order -> token order (all_gatherv over attention CP);
- `reduce_scatter(partial, group)`: token-order partial sums over the TP group -> complete local
  rows (reduce_scatterv over TP, then all_gatherv over attention TP when it is larger than one);
  equal to an all-reduce followed by `take_local`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from layer_boundary import BatchFactsError, split_sizes

__all__ = ["ORDERS", "TokenMapping", "request_pieces"]

ORDERS = ("zigzag", "contiguous")


def request_pieces(length: int, cp_size: int, order: str) -> list[list[tuple[int, int]]]:
    """Per CP rank, the (offset, count) pieces of one request of `length` tokens it holds."""
    if order == "contiguous":
        sizes = split_sizes(length, cp_size)
        starts = [sum(sizes[:i]) for i in range(cp_size)]
        return [[(starts[r], sizes[r])] for r in range(cp_size)]
    if order == "zigzag":
        sizes = split_sizes(length, 2 * cp_size)
        starts = [sum(sizes[:i]) for i in range(2 * cp_size)]
        last = 2 * cp_size - 1
        return [[(starts[r], sizes[r]), (starts[last - r], sizes[last - r])] for r in range(cp_size)]
    raise ValueError(f"unknown CP token order {order!r}; choose one of {', '.join(ORDERS)}")


class TokenMapping:
    """The partition of one CP batch over the attention-CP ranks, seen from one rank.

    Build it on every rank of the CP group from the same per-request lengths (new tokens of each
    request, in batch row order) and pass it as `Forward(parallel, sum(lengths), cp=mapping)`.
    """

    __slots__ = (
        "parallel",
        "order",
        "lengths",
        "cp_size",
        "cp_rank",
        "total",
        "counts",
        "request_counts",
        "local_index",
        "rank_order",
        "restore",
        "_local_range",
    )

    def __init__(self, parallel, lengths: Sequence[int], *, order: str = "zigzag", device=None):
        topo = parallel.topology
        if order not in ORDERS:
            raise ValueError(f"unknown CP token order {order!r}; choose one of {', '.join(ORDERS)}")
        lengths = tuple(int(n) for n in lengths)
        if any(n < 0 for n in lengths):
            raise BatchFactsError(f"request lengths must be >= 0, got {lengths}")
        self.parallel = parallel
        self.order = order
        self.lengths = lengths
        self.cp_size = topo.attn_cp
        self.cp_rank = parallel.attn_cp_rank
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.cp_size)]
        request_counts: list[list[int]] = [[] for _ in range(self.cp_size)]
        start = 0
        for length in lengths:
            for rank, pieces in enumerate(request_pieces(length, self.cp_size, order)):
                request_counts[rank].append(sum(c for _, c in pieces))
                per_rank[rank].extend(torch.arange(start + a, start + a + c) for a, c in pieces if c)
            start += length
        self.total = start
        indices = [torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long) for parts in per_rank]
        self.counts = tuple(int(ix.numel()) for ix in indices)
        self.request_counts = tuple(request_counts[self.cp_rank])
        local = indices[self.cp_rank]
        first = int(local[0]) if local.numel() else 0
        # a run of consecutive rows is taken as a view, without copying
        consecutive = bool(torch.equal(local, torch.arange(first, first + local.numel())))
        self._local_range = (first, first + local.numel()) if consecutive else None
        self.rank_order = torch.cat(indices).to(device)
        restore = torch.empty(self.total, dtype=torch.long)
        restore[torch.cat(indices)] = torch.arange(self.total)
        self.restore = restore.to(device)
        self.local_index = local.to(device)

    # facts ------------------------------------------------------------------------------------
    @property
    def num_local(self) -> int:
        return self.counts[self.cp_rank]

    def check(self, fwd) -> None:
        """Raise before any collective when this mapping cannot describe `fwd`'s batch."""
        topo = fwd.parallel.topology
        if self.cp_size != topo.attn_cp or self.cp_rank != fwd.parallel.attn_cp_rank:
            raise BatchFactsError(
                f"the CP token mapping was built for rank {self.cp_rank} of attn_cp={self.cp_size}, but this forward runs "
                f"on rank {fwd.parallel.attn_cp_rank} of attn_cp={topo.attn_cp}; build it with this forward's Parallel"
            )
        if self.total != fwd.num_tokens:
            raise BatchFactsError(
                f"the CP token mapping covers {self.total} rows but the forward has num_tokens={fwd.num_tokens}; "
                "build the mapping from the lengths of the requests in this batch"
            )

    def tp_shares(self, attn_tp: int) -> tuple[int, ...]:
        """Rows each TP rank gets from `reduce_scatter`: CP rank by CP rank, each split over attention TP."""
        return tuple(s for c in self.counts for s in split_sizes(c, attn_tp))

    def describe(self) -> str:
        return f"{self.order} over attn_cp={self.cp_size}: rows per rank {list(self.counts)}"

    def __repr__(self) -> str:
        return f"TokenMapping({self.describe()}, rank {self.cp_rank})"

    # moves ------------------------------------------------------------------------------------
    def take_local(self, x: torch.Tensor) -> torch.Tensor:
        """Token-order rows -> this rank's rows (a view when they are consecutive)."""
        if x.shape[0] != self.total:
            raise ValueError(f"take_local needs the batch's {self.total} token-order rows, got {x.shape[0]}")
        if self._local_range is not None:
            return x[self._local_range[0] : self._local_range[1]]
        return x.index_select(0, self.local_index)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows -> every row in token order (all_gatherv over attention CP)."""
        gathered = self.parallel.groups["attn_cp"].all_gatherv(x, self.counts)
        return gathered.index_select(0, self.restore)

    def reduce_scatter(self, partial: torch.Tensor, group) -> torch.Tensor:
        """Token-order partial sums over `group` (the TP group: attention CP x attention TP) ->
        this rank's complete rows; the same values as `take_local(group.all_reduce(partial))`."""
        attn_tp = self.parallel.groups["attn_tp"]
        if group.size != self.cp_size * attn_tp.size:
            raise ValueError(
                f"a CP reduce-scatter runs over attention CP x attention TP ({self.cp_size * attn_tp.size} ranks), "
                f"not over {group.name} of {group.size}"
            )
        share = group.reduce_scatterv(partial.index_select(0, self.rank_order), self.tp_shares(attn_tp.size))
        return attn_tp.all_gatherv(share, split_sizes(self.num_local, attn_tp.size))


def token_mapping(request) -> TokenMapping:
    """The `TokenMappingProvider` factory: the mapping of a `TokenMappingRequest` (zigzag unless
    the request names another order)."""
    return TokenMapping(request.parallel, request.lengths, order=request.order or "zigzag", device=request.device)
