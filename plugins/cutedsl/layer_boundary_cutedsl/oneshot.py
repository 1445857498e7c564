"""The one-shot fused all-reduce: a peer-mapped workspace per TP group, and the fused paths that
replace `finalize -> all-reduce -> add + norm` with one launch.

    ws, reason = create_workspace(group, kernels.oneshot, dtype=..., hidden=..., max_tokens=..., device=...)
    normed, new_residual = ws.all_reduce_add_rmsnorm(partial, residual, gamma, eps)   # every rank
    ws.release()                                                                          # every rank

`CuteDSLService.prepare()` creates the workspace (after its kernels vote) and keeps it as
`service.oneshot`; its `finalize()` and the provider's candidates call `finalize_add_norm` /
`all_reduce_add_norm` here first and fall back to the three-launch path when they return None.

Rank uniformity is the whole game: a rank that launches the kernel waits (on the GPU) for every
peer to launch it too, so each decision to launch is taken only from facts every rank of the
group shares:

- the workspace exists on every rank or on none: creation runs the same collectives on every
  rank whatever fails locally (one `all_gather` of a table of handles and settings, then one
  vote on the mappings), and a rank that failed anywhere makes every rank give up;
- per call: the workspace exists, the handoff's group is its group, the batch's token count is
  within its capacity, the dtype and width are the model's. Tensors a kernel cannot read as they
  are (strided, unaligned, expanded weights) are copied locally; that never makes a rank decline.

Inside a compiled region (`torch.compile`) each launch is one custom op (graph_ops.py) that
finds the workspace by its graph key at run time; the decisions above are made while tracing
(they read shapes, dtypes and the workspace's capacity) and become guards.

Environment (read when the workspace is created, checked equal across the group):
`LAYER_BOUNDARY_CUTEDSL_ONESHOT=0` turns the path off; `LAYER_BOUNDARY_CUTEDSL_ONESHOT_MAX_TOKENS`
(default 256) caps the rows per call (above it the old path runs: one-shot traffic grows with
tokens x world); `LAYER_BOUNDARY_CUTEDSL_ONESHOT_TIMEOUT_S` (default 30) bounds a kernel's wait
for a peer, after which it reports to host memory and traps (an error, never a hung device).
"""

from __future__ import annotations

import os
import socket
import struct
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from layer_boundary import MoeFinalizeHandoff, UnreducedOutput
from layer_boundary.plugin import graph_key, is_rms_norm, register_graph_object

from .graph_ops import ONESHOT_ALL_REDUCE_ADD_RMSNORM, ONESHOT_FINALIZE_ALL_REDUCE_ADD_RMSNORM, graph_oneshot_add_norms
from .kernels.allreduce_layout import DIAG_WORDS, STATE_WORDS, WORLD_SIZES, AllReduceNormsVariant, AllReduceVariant, buffer_layout
from .kernels.tiling import MAX_HIDDEN, MAX_TOP_K, SUPPORTED_DTYPES
from .peer_memory import HANDLE_BYTES, CudaIpcMemory, HostWords, PeerMemory

__all__ = [
    "OneShotKernels",
    "OneShotWorkspace",
    "OneShotTimeout",
    "CUDA_ONESHOT",
    "create_workspace",
    "oneshot_settings",
    "all_reduce_add_norm",
    "finalize_add_norm",
    "all_reduce_candidate",
    "finalize_candidate",
    "all_reduce_add_norms",
    "NormsFacts",
    "norms_facts",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_TIMEOUT_S",
]

ENV_ENABLE = "LAYER_BOUNDARY_CUTEDSL_ONESHOT"
ENV_MAX_TOKENS = "LAYER_BOUNDARY_CUTEDSL_ONESHOT_MAX_TOKENS"
ENV_TIMEOUT = "LAYER_BOUNDARY_CUTEDSL_ONESHOT_TIMEOUT_S"
DEFAULT_MAX_TOKENS = 256
DEFAULT_TIMEOUT_S = 30.0


class OneShotTimeout(RuntimeError):
    """A one-shot kernel waited longer than its timeout for a peer's row and trapped."""


@dataclass(frozen=True)
class OneShotKernels:
    """The launches and memory of a one-shot implementation (the CuTe DSL kernels over CUDA IPC,
    or the CPU reference over fake peer memory in `testing.py`)."""

    name: str
    #: a new peer-memory backend for one workspace
    memory: Callable[[], PeerMemory]
    #: (dtype, hidden, world, weight_offsets, moe_shapes [(top_k, shared)], device) -> None:
    #: compile and load ahead of time
    prepare: Callable
    #: (workspace, partial, residual, gamma, eps, *, weight_offset, out, residual_out) -> (normed, new_residual)
    all_reduce_add_rmsnorm: Callable
    #: (workspace, rows [T, k, H], weights [T, k], residual, gamma, eps, *, shared, weight_offset, out, residual_out)
    moe_finalize_all_reduce_add_rmsnorm: Callable
    dtypes: tuple = SUPPORTED_DTYPES
    world_sizes: tuple = WORLD_SIZES
    max_hidden: int = MAX_HIDDEN
    #: wait for this rank's launches that may still touch the workspace
    quiesce: Callable = field(default=lambda device: None)
    #: what tells the ranks' address spaces apart (CUDA IPC maps between processes only)
    process_id: Callable[[], int] = os.getpid
    #: (workspace, partial, residual, gamma, beta, post_gamma, eps, post_eps, shape, *, out, residual_out)
    #: -> (normed, new_residual): the sum with the norms of a `NormsShape` around the add; None: none
    all_reduce_add_norms: Optional[Callable] = None
    #: (dtype, hidden, world, shapes, device) -> None: compile and load those ahead of time
    prepare_norms: Optional[Callable] = None


def _cuda_quiesce(device) -> None:
    torch.cuda.synchronize(device)


def _prepare_cuda(dtype, hidden, world, weight_offsets, moe_shapes, device) -> None:
    from .kernels.allreduce import prepare_allreduce

    for o in sorted(set(weight_offsets)):
        prepare_allreduce(AllReduceVariant(dtype, hidden, world, float(o)), device)
        for top_k, shared in moe_shapes:
            prepare_allreduce(AllReduceVariant(dtype, hidden, world, float(o), top_k=top_k, shared=shared), device)


def _prepare_cuda_norms(dtype, hidden, world, shapes, device) -> None:
    from .kernels.allreduce import prepare_allreduce

    for shape in shapes:
        prepare_allreduce(AllReduceNormsVariant.of(dtype, hidden, world, shape), device)


def _cuda_kernels() -> OneShotKernels:
    from .kernels.allreduce import allreduce_add_norms, allreduce_add_rmsnorm, moe_finalize_allreduce_add_rmsnorm

    return OneShotKernels(
        name="cutedsl-ipc",
        memory=CudaIpcMemory,
        prepare=_prepare_cuda,
        all_reduce_add_rmsnorm=allreduce_add_rmsnorm,
        moe_finalize_all_reduce_add_rmsnorm=moe_finalize_allreduce_add_rmsnorm,
        quiesce=_cuda_quiesce,
        all_reduce_add_norms=allreduce_add_norms,
        prepare_norms=_prepare_cuda_norms,
    )


CUDA_ONESHOT = _cuda_kernels()


# -------------------------------------------------------------------------------------- settings


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


def oneshot_settings() -> dict:
    """(enabled, max tokens, timeout) from the environment."""
    enabled = os.environ.get(ENV_ENABLE, "").strip().lower() not in ("0", "false", "no", "off")
    raw_timeout = os.environ.get(ENV_TIMEOUT, "").strip()
    return {
        "enabled": enabled,
        "max_tokens": _env_int(ENV_MAX_TOKENS, DEFAULT_MAX_TOKENS),
        "timeout_s": float(raw_timeout) if raw_timeout else DEFAULT_TIMEOUT_S,
    }


_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float64: 4}


def _host_id() -> int:
    return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


#: words per rank in the exchanged table: ok, host, pid, capacity, hidden, world, dtype, handle
_TABLE_WORDS = 7 + HANDLE_BYTES // 8


def _handle_words(handle: bytes) -> list:
    if len(handle) > HANDLE_BYTES:
        raise ValueError(f"a peer-memory handle has at most {HANDLE_BYTES} bytes, got {len(handle)}")
    return list(struct.unpack(f"<{HANDLE_BYTES // 8}q", handle.ljust(HANDLE_BYTES, b"\0")))


def _handle_bytes(words) -> bytes:
    return struct.pack(f"<{HANDLE_BYTES // 8}q", *[int(w) for w in words])


# ------------------------------------------------------------------------------------- workspace


class OneShotWorkspace:
    """This rank's part of a group's peer buffers (see kernels/allreduce_layout.py), the local
    state and report words, and the launches over them. Made by `create_workspace`."""

    def __init__(self, *, group, kernels, memory, device, dtype, hidden, capacity, buffer, addresses, state, diag, timeout_s,
                 norm_shapes=()):
        self.group = group
        self.ranks = tuple(group.ranks)
        self.world = group.size
        self.rank = group.rank
        self.kernels = kernels
        self.memory = memory
        self.device = torch.device(device)
        self.dtype = dtype
        self.hidden = hidden
        self.capacity = capacity
        self.layout = buffer_layout(self.world, capacity, hidden, dtype)
        self.buffer = buffer
        self.addresses = tuple(addresses)
        self.state = state
        self.diag = diag
        self.diag_address = diag.device_address
        self.timeout_s = timeout_s
        #: cap on CTAs per launch (None: one per SM); tests lower it to make CTAs loop over rows
        self.max_ctas: Optional[int] = None
        self.launches = 0
        self.released = False
        #: the `NormsShape`s whose variants were compiled with the workspace (`all_reduce_add_norms`)
        self.norm_shapes = frozenset(norm_shapes)
        # inside a compiled region a launch is one op of graph_ops.py, which finds this workspace by its key
        register_graph_object(self, f"cutedsl.oneshot@rank{self.rank}{list(self.ranks)}")

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def fits(self, tokens: int) -> bool:
        return not self.released and 0 < tokens <= self.capacity

    # launches (every rank of the group, same rows) -------------------------------------------
    def all_reduce_add_rmsnorm(self, partial, residual, gamma, eps: float, weight_offset: float = 0.0, *, out=None, residual_out=None):
        """(normed, new_residual) of sum over the group of each rank's `partial`, + `residual`, the
        RMSNorm with `gamma + weight_offset`. `out` / `residual_out`: rows to write (readable
        as they are), default new tensors."""
        self._check_open()
        if torch.compiler.is_compiling() and out is None and residual_out is None:
            return ONESHOT_ALL_REDUCE_ADD_RMSNORM(partial, residual, gamma, float(eps), float(weight_offset), graph_key(self))
        partial, residual, gamma = (_readable(t, self.dtype) for t in (partial, residual, gamma))
        self.launches += 1
        return self.kernels.all_reduce_add_rmsnorm(
            self, partial, residual, gamma, eps, weight_offset=weight_offset, out=out, residual_out=residual_out
        )

    def moe_finalize_all_reduce_add_rmsnorm(
        self, rows, weights, shared, residual, gamma, eps: float, weight_offset: float = 0.0, *, out=None, residual_out=None
    ):
        """The same with this rank's partial = its MoE finalize: dense `rows` [T, top_k, H],
        `weights` [T, top_k], optional `shared` [T, H]."""
        self._check_open()
        if torch.compiler.is_compiling() and out is None and residual_out is None:
            return ONESHOT_FINALIZE_ALL_REDUCE_ADD_RMSNORM(rows, weights, shared, residual, gamma, float(eps), float(weight_offset),
                                                           graph_key(self))
        rows, residual, gamma = (_readable(t, self.dtype) for t in (rows, residual, gamma))
        shared = None if shared is None else _readable(shared, self.dtype)
        weights = _readable(weights, weights.dtype)  # the kernels take the dtype they need
        self.launches += 1
        return self.kernels.moe_finalize_all_reduce_add_rmsnorm(
            self, rows, weights, residual, gamma, eps, shared=shared, weight_offset=weight_offset, out=out, residual_out=residual_out
        )

    def all_reduce_add_norms(self, partial, residual, gamma, beta, post_gamma, eps: float, post_eps: float, shape, *, out=None,
                             residual_out=None):
        """The same sum with the norms of `shape` (a `NormsShape`) around the add: an RMS post-norm
        before it (the sum rounded once, then normed), the read's RMSNorm, LayerNorm or nothing
        after it (an identity read returns the new residual twice)."""
        self._check_open()
        if torch.compiler.is_compiling() and out is None and residual_out is None:
            return graph_oneshot_add_norms(partial, residual, gamma, beta, post_gamma, float(eps), float(post_eps), shape, graph_key(self))
        partial, residual = (_readable(t, self.dtype) for t in (partial, residual))
        gamma, beta, post_gamma = (None if t is None else _readable(t, self.dtype) for t in (gamma, beta, post_gamma))
        self.launches += 1
        return self.kernels.all_reduce_add_norms(self, partial, residual, gamma, beta, post_gamma, eps, post_eps, shape, out=out,
                                                 residual_out=residual_out)

    def _check_open(self) -> None:
        if self.released:
            raise RuntimeError("the one-shot workspace was released")

    # diagnostics -----------------------------------------------------------------------------
    def report(self) -> Optional[str]:
        """What a timed-out kernel of this rank wrote before it trapped (None: nothing)."""
        words = self.diag.read() if self.diag is not None else []
        if not words or words[0] != 1:
            return None
        _, rank, peer, row, epoch, seen, waited = words[:7]
        return (
            f"one-shot all-reduce on rank {rank} of {self.ranks}: waited {waited / 1e9:.1f} s for rank {peer}'s row {row} "
            f"of call {epoch} (its flag says {seen}); that rank did not launch the same call (a rank-dependent decision, "
            "a dead rank, or a call count that differs between ranks)"
        )

    def check(self) -> None:
        """Raise OneShotTimeout if a kernel of this rank timed out."""
        message = self.report()
        if message is not None:
            raise OneShotTimeout(message)

    # release ---------------------------------------------------------------------------------
    def release(self, *, barrier: bool = True) -> None:
        """Give the memory back. With `barrier` (every rank calls it, in lock-step): wait for this
        rank's kernels, then for every rank's (nobody reads this buffer or writes its flags any
        more), unmap the peers, wait until every rank has unmapped this one, free it. Without it
        (a failure path, peers may be gone) only the local part, in the same order."""
        if self.released:
            return
        self.released = True
        _safe(lambda: self.kernels.quiesce(self.device))
        if barrier:
            self.group.agree(True)
        for r, address in enumerate(self.addresses):
            if r != self.rank and address:
                _safe(lambda a=address: self.memory.close(a, self.device))
        if barrier:
            self.group.agree(True)
        _safe(lambda: self.memory.free(self.buffer, self.device))
        if self.diag is not None:
            _safe(self.diag.free)
        self.addresses, self.state, self.diag = (), None, None

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.nbytes} bytes, {self.launches} launches"
        return f"OneShotWorkspace({self.kernels.name}, rank {self.rank} of {self.ranks}, {self.dtype}, hidden={self.hidden}, capacity={self.capacity}, {state})"


def _safe(fn) -> Optional[str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - release goes on with the rest
        return f"{type(exc).__name__}: {exc}"
    return None


def _readable(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as rows back to back, 16-byte aligned, of `dtype` (a local copy when it is not)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()  # a fresh allocation (the caching allocator aligns to 512 bytes)
    return t


def create_workspace(
    group,
    kernels: OneShotKernels,
    *,
    dtype: torch.dtype,
    hidden: int,
    max_tokens: int,
    device,
    weight_offsets=(0.0,),
    moe_shapes=(),
    local_reason: Optional[str] = None,
    norm_shapes=(),
):
    """(workspace, "") on every rank of `group`, or (None, why) on every rank. Collective: every
    rank calls it, with the same arguments; it runs the same collectives whatever fails locally.

    `moe_shapes`: (top_k, shared) pairs whose MoE variants to compile now, with every offset;
    `norm_shapes`: the `NormsShape`s whose norms variants to compile now (the kernels must have
    `all_reduce_add_norms`)."""
    settings = oneshot_settings()
    world = group.size
    capacity = min(int(max_tokens), settings["max_tokens"])
    reason = local_reason
    if reason is None and not settings["enabled"]:
        reason = f"{ENV_ENABLE}=0"
    if reason is None and world not in kernels.world_sizes:
        reason = f"the one-shot kernels are built for groups of {kernels.world_sizes} ranks, this one has {world}"
    if reason is None and dtype not in kernels.dtypes:
        reason = f"the one-shot kernels take {kernels.dtypes}, not {dtype}"
    if reason is None and not 0 < hidden <= kernels.max_hidden:
        reason = f"hidden size {hidden} is beyond the one-shot kernels' {kernels.max_hidden}"
    if reason is None and capacity <= 0:
        reason = f"no rows to hold ({ENV_MAX_TOKENS}={settings['max_tokens']}, max_tokens={max_tokens})"
    if reason is None and norm_shapes and kernels.prepare_norms is None:
        reason = f"the {kernels.name} one-shot kernels have no norms variants"
    if reason is None:
        try:
            kernels.prepare(dtype, hidden, world, tuple(weight_offsets), tuple(moe_shapes), device)
            if norm_shapes:
                kernels.prepare_norms(dtype, hidden, world, tuple(norm_shapes), device)
        except Exception as exc:  # noqa: BLE001 - voted on below
            reason = f"compiling the one-shot kernels failed: {type(exc).__name__}: {exc}"
    memory, buffer, handle, state, diag = None, None, b"", None, None
    if reason is None:
        try:
            memory = kernels.memory()
            layout = buffer_layout(world, capacity, hidden, dtype)
            buffer = memory.allocate(layout.nbytes, device)
            handle = memory.export(buffer)
            diag = _report_words(memory, device)
            state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=device)
            state[2] = int(settings["timeout_s"] * 1e9)
            kernels.quiesce(device)  # the state is in memory before any launch, on any stream
        except Exception as exc:  # noqa: BLE001 - voted on below
            reason = f"allocating the peer buffer failed: {type(exc).__name__}: {exc}"
    # one table for the group: what each rank has and wants (identical on every rank afterwards)
    row = [0 if reason is None else 1, _host_id(), kernels.process_id(), capacity, hidden, world, _DTYPE_CODES.get(dtype, 0)]
    row += _handle_words(handle)
    table = group.all_gather(torch.tensor([row], dtype=torch.int64, device=getattr(group, "device", "cpu"))).cpu().tolist()
    why = _table_problem(table)
    addresses = [0] * world
    if why is None:
        try:
            for r in range(world):
                addresses[r] = buffer if r == group.rank else memory.open(_handle_bytes(table[r][7:]), device)
        except Exception as exc:  # noqa: BLE001 - voted on below
            reason = f"mapping a peer's buffer failed: {type(exc).__name__}: {exc}"
        if group.agree(reason is None):
            ws = OneShotWorkspace(
                group=group, kernels=kernels, memory=memory, device=device, dtype=dtype, hidden=hidden, capacity=capacity,
                buffer=buffer, addresses=addresses, state=state, diag=diag, timeout_s=settings["timeout_s"], norm_shapes=norm_shapes,
            )
            return ws, ""
        why = reason or "another rank of the group could not map a peer's buffer"
        for r, address in enumerate(addresses):
            if r != group.rank and address:
                _safe(lambda a=address: memory.close(a, device))
        group.agree(True)  # every rank has unmapped every buffer before any is freed
    else:
        why = reason or why
    if buffer is not None:
        _safe(lambda: memory.free(buffer, device))
    if diag is not None:
        _safe(diag.free)
    return None, why


def _report_words(memory, device) -> HostWords:
    """Host words for a timed-out kernel's report; device words (no report, the trap stays)
    where host memory cannot be mapped."""
    try:
        return memory.host_words(DIAG_WORDS, device)
    except Exception:  # noqa: BLE001 - the report is a convenience, the trap is the guarantee
        words = torch.zeros(DIAG_WORDS, dtype=torch.int64, device=device)
        fallback = HostWords(DIAG_WORDS, words.data_ptr(), lambda: [], None)
        fallback.keep = words  # alive as long as the workspace
        return fallback


def _table_problem(table) -> Optional[str]:
    """Why the group cannot map its buffers, from the exchanged table (the same on every rank)."""
    failed = [r for r, row in enumerate(table) if row[0] != 0]
    if failed:
        return f"rank(s) {failed} of the group could not prepare the one-shot workspace"
    if len({row[1] for row in table}) != 1:
        return "the group spans more than one host (CUDA IPC maps memory within one host)"
    if len({row[2] for row in table}) != len(table):
        return "two ranks of the group share a process (CUDA IPC maps memory between processes)"
    if len({tuple(row[3:7]) for row in table}) != 1:
        return "ranks of the group disagree on the workspace (capacity, hidden, world or dtype; check LAYER_BOUNDARY_CUTEDSL_ONESHOT_*)"
    return None


# ------------------------------------------------------------------------------------ the paths


def _eligible(ws, group, residual) -> bool:
    """Facts every rank of the group shares, nothing else."""
    return (
        ws is not None
        and group is not None
        and tuple(getattr(group, "ranks", ())) == ws.ranks
        and isinstance(residual, torch.Tensor)
        and residual.dim() == 2
        and residual.dtype == ws.dtype
        and residual.shape[1] == ws.hidden
        and residual.device == ws.device
        and ws.fits(residual.shape[0])
    )


def all_reduce_add_norm(ws, owed, residual, gamma, offset: float, eps: float):
    """(normed, new_residual) of an `UnreducedOutput` in one launch, or None (untouched, on every
    rank alike) when the one-shot path does not apply."""
    if not isinstance(owed, UnreducedOutput) or not _eligible(ws, owed.group, residual):
        return None
    partial = owed.partial
    if not isinstance(partial, torch.Tensor) or partial.shape != residual.shape or partial.dtype != ws.dtype or gamma.dtype != ws.dtype:
        return None
    return ws.all_reduce_add_rmsnorm(partial, residual, gamma, eps, offset)


def finalize_add_norm(ws, owed, residual, gamma, offset: float, eps: float):
    """(normed, new_residual) of a `MoeFinalizeHandoff` in one launch (finalize, exchange, add,
    norm), or None (untouched, on every rank alike) when the one-shot path does not apply."""
    if not isinstance(owed, MoeFinalizeHandoff) or not _eligible(ws, owed.group, residual) or gamma.dtype != ws.dtype:
        return None
    tokens, hidden = residual.shape
    rows, weights, shared = owed.expert_rows, owed.weights, owed.shared
    dense = (
        isinstance(rows, torch.Tensor)
        and rows.dim() == 3
        and rows.shape[0] == tokens
        and rows.shape[2] == hidden
        and 1 <= rows.shape[1] <= MAX_TOP_K
        and rows.dtype == ws.dtype
        and isinstance(weights, torch.Tensor)
        and tuple(weights.shape) == (tokens, rows.shape[1])
        and weights.is_floating_point()
        and (shared is None or (isinstance(shared, torch.Tensor) and shared.shape == residual.shape and shared.dtype == ws.dtype))
    )
    if dense:
        return ws.moe_finalize_all_reduce_add_rmsnorm(rows, weights, shared, residual, gamma, eps, offset)
    partial = owed.finalize_local()  # a layout the MoE kernel does not take: finalize here, then exchange
    if not isinstance(partial, torch.Tensor) or partial.shape != residual.shape:
        return None
    return ws.all_reduce_add_rmsnorm(partial, residual, gamma, eps, offset)


class NormsFacts:
    """A stage's norms as the norms kernels take them: the `NormsShape` and the modules whose
    weights each call reads (never copies: a weight loaded or moved later is the one used)."""

    __slots__ = ("shape", "norm", "post_norm")

    def __init__(self, shape, norm, post_norm):
        self.shape, self.norm, self.post_norm = shape, norm, post_norm

    @property
    def gamma(self):
        return None if self.shape.norm == "none" else self.norm.weight.detach()

    @property
    def beta(self):
        return self.norm.bias.detach() if self.shape.bias else None

    @property
    def post_gamma(self):
        return self.post_norm.weight.detach() if self.shape.post else None

    @property
    def eps(self) -> float:
        return 0.0 if self.shape.norm == "none" else float(self.norm.eps)

    @property
    def post_eps(self) -> float:
        return float(self.post_norm.eps) if self.shape.post else 0.0

    def __repr__(self) -> str:
        return f"NormsFacts({self.shape.tag})"


def norms_facts(stage, compute_dtypes=(torch.float32,)) -> Optional[NormsFacts]:
    """The norms kernels' view of a stage input that the add + RMSNorm kernels do not take (an RMS
    post-norm owed before the add; a LayerNorm or identity read), or None: the stage needs no such
    kernel, or its norms are not ones the kernels compute (statistics in `compute_dtypes`;
    a LayerNorm's `None`, as wide as bf16/fp16 rows' fp32, included)."""
    from .kernels.norms import NormsShape

    desc = getattr(stage, "description", None)
    if desc is None:  # a stand-in for a stage that names only its norm: the add + RMSNorm kernels' case
        return None
    post_kind, kind = getattr(desc, "post_norm_kind", None), desc.norm_kind
    if post_kind is None and kind not in ("layer", "none"):
        return None
    if post_kind is not None and post_kind not in ("rms", "gemma_rms"):
        return None
    if kind not in ("rms", "gemma_rms", "layer", "none") or (kind == "none" and post_kind is None):
        return None
    norms = [n for n in (stage.norm if kind != "none" else None, stage.post_norm if post_kind is not None else None) if n is not None]
    if any(getattr(n, "compute_dtype", torch.float32) not in (*compute_dtypes, None) for n in norms):
        return None
    if kind in ("rms", "gemma_rms") and getattr(stage.norm, "compute_dtype", torch.float32) is None:
        return None
    post = post_kind is not None
    shape = NormsShape(
        "rms" if kind in ("rms", "gemma_rms") else kind,
        weight_offset=float(type(stage.norm).offset) if kind in ("rms", "gemma_rms") else 0.0,
        bias=kind == "layer" and stage.norm.bias is not None,
        post=post,
        post_offset=float(type(stage.post_norm).offset) if post else 0.0,
    )
    return NormsFacts(shape, stage.norm, stage.post_norm if post else None)


def all_reduce_add_norms(ws, owed, residual, facts):
    """(normed, new_residual) of an `UnreducedOutput` with the norms of a stage (`NormsFacts`:
    a post-norm, a LayerNorm or identity read) in one launch, or None (untouched, on every rank
    alike) when the one-shot path does not apply."""
    if ws is None or ws.kernels.all_reduce_add_norms is None or facts.shape not in ws.norm_shapes:
        return None
    if not isinstance(owed, UnreducedOutput) or not _eligible(ws, owed.group, residual):
        return None
    partial = owed.partial
    if not isinstance(partial, torch.Tensor) or partial.shape != residual.shape or partial.dtype != ws.dtype:
        return None
    if any(t is not None and t.dtype != ws.dtype for t in (facts.gamma, facts.beta, facts.post_gamma)):
        return None
    return ws.all_reduce_add_norms(partial, residual, facts.gamma, facts.beta, facts.post_gamma, facts.eps, facts.post_eps, facts.shape)


def _candidate(path, service, norm, owed, residual):
    """`path` with the multiplier, offset and epsilon of a core RMSNorm computing as the kernels
    do, over the service's workspace; None (untouched) when there is none or the norm differs."""
    ws = getattr(service, "oneshot", None)
    if ws is None or not is_rms_norm(norm) or getattr(norm, "compute_dtype", torch.float32) not in service.kernels.norm_compute_dtypes:
        return None
    return path(ws, owed, residual, norm.weight.detach(), float(getattr(type(norm), "offset", 0.0)), float(norm.eps))


def finalize_candidate(service, norm, owed, residual):
    """The provider's MoE-handoff candidate, one-shot: None unless the service's workspace takes it."""
    return _candidate(finalize_add_norm, service, norm, owed, residual)


def all_reduce_candidate(service, norm, owed, residual):
    """The provider's partial-sum candidate, one-shot: None unless the service's workspace takes it."""
    return _candidate(all_reduce_add_norm, service, norm, owed, residual)


def create_for_service(service, max_tokens: int):
    """`create_workspace` for a `CuteDSLService` (its group, dtype, width, norms and MoE shapes)."""
    shapes = []
    if service.top_k is not None:
        shared = (False, True) if service.shared_expert is None else (bool(service.shared_expert),)
        shapes = [(int(service.top_k), s) for s in shared]
    return create_workspace(
        service.group,
        service.kernels.oneshot,
        dtype=service.dtype,
        hidden=service.hidden_size,
        max_tokens=max_tokens,
        device=service.device,
        weight_offsets=service.weight_offsets,
        moe_shapes=shapes,
        norm_shapes=service.norm_shapes,
    )
