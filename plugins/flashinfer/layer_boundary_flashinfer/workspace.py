"""Fusion workspaces per reduction group: created, reused, rebuilt and destroyed in lock-step.

A FlashInfer fusion workspace is symmetric memory that every rank of a group allocates and maps
together (a rendezvous), sized for (max tokens, hidden, dtype). Two hazards shape this module:

- one rank failing (memory, an import, an old GPU) while the others enter the rendezvous or a
  fused kernel leaves them waiting forever; so every step that can fail locally is followed by
  `Collectives.agree`, and the fusion is available only where every rank succeeded;
- graphs captured with a workspace keep its addresses; so workspaces are made before capture
  (prepare), reused while large enough (`is_buffer_size_sufficient`), and a rebuild unbinds
  every candidate bound to the old one (they decline until prepared again). A rebuild of a
  workspace a CUDA graph was captured on is refused (`WorkspaceCapturedError`, on every rank,
  before anything is released), unless the caller says it drops those graphs (`recapture=True`).

The collectives each call issues depend only on agreed values, so every rank issues the same
sequence. The FlashInfer specifics sit behind a `WorkspaceBackend` (see `backend.py`); tests
use a backend whose creation can be made to fail on one rank.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any, Callable, Optional, Protocol

import attrs
import torch

from layer_boundary.plugin import node_hash

from .ordering import LaunchOrder

__all__ = [
    "WorkspaceSpec",
    "WorkspaceBackend",
    "GroupWorkspace",
    "WorkspaceManager",
    "EnsureResult",
    "PREFLIGHT_HEADROOM_BYTES",
    "WorkspaceCapturedError",
]


class WorkspaceCapturedError(RuntimeError):
    """A rebuild would free a workspace that a captured CUDA graph still addresses."""

#: memory the preflight leaves free beyond the workspace itself (allocator slack, NCCL, graphs)
PREFLIGHT_HEADROOM_BYTES = 256 << 20


@attrs.frozen
class WorkspaceSpec:
    """What a workspace must hold: up to `max_tokens` rows of `hidden` `dtype` values."""

    max_tokens: int
    hidden: int
    dtype: torch.dtype

    def capacity(self, hidden: int) -> int:
        """Rows of width `hidden` that fit (the workspace bounds tokens x hidden)."""
        return self.max_tokens * self.hidden // hidden


class WorkspaceBackend(Protocol):
    """What the manager needs from a fusion library. All methods but `create` are local."""

    name: str
    #: the device type of the tensors its launchers take ("cuda")
    device_type: str

    def placement_reason(self, tensor) -> Optional[str]:
        """Why this rank's norm weight cannot feed the launchers (None: it can)."""

    def width_reason(self, hidden: int, dtype) -> Optional[str]:
        """Why the fused all-reduce + add + norm kernel cannot take rows of this width and dtype."""

    def finalize_reason(self, hidden: int, dtype) -> Optional[str]:
        """Why the fused MoE finalize kernel must not run on rows of this width and dtype."""

    def probe(self, device, group) -> Optional[str]:
        """Why this rank cannot create a workspace over `group` (None: it can)."""

    def required_bytes(self, spec: WorkspaceSpec, world: int) -> int: ...

    def free_bytes(self, device) -> int: ...

    def create(self, spec: WorkspaceSpec, group, device) -> Any:
        """Collective over `group`: every rank calls it, or none does."""

    def sufficient(self, workspace, spec: WorkspaceSpec, world: int) -> bool: ...

    def quiesce(self, device) -> None:
        """Wait for this rank's work that may still touch a workspace."""

    def destroy(self, workspace) -> None:
        """Release this rank's part (after every rank quiesced)."""

    def bind_all_reduce(self, slot: "GroupWorkspace", gamma, eps: float, weight_bias: float, hidden: int, limit: int) -> Callable: ...

    def bind_finalize(self, slot: "GroupWorkspace", gamma, eps: float, weight_bias: float, hidden: int, limit: int) -> Optional[Callable]: ...


@attrs.frozen
class EnsureResult:
    """What `ensure` did for one group, identical on every rank except `local_reason`."""

    ranks: tuple
    dtype: str
    available: bool
    action: str  #: "created", "reused", "rebuilt" or "unavailable"
    reason: str = ""
    workspace_bytes: int = 0


def _host_id() -> int:
    """This rank's node (`layer_boundary.nodes`: LAYER_BOUNDARY_NODE_ID, else hostname, boot
    id and torchrun's node rank), so ranks of two nodes that share a hostname are told apart."""
    return node_hash()


def _shared_facts(group, fingerprint: int) -> tuple[bool, bool]:
    """(every rank runs on this host, every rank has this settings fingerprint): one all_gather,
    so every rank gets the same answers."""
    mine = torch.tensor([[_host_id(), fingerprint & 0x7FFFFFFF]], dtype=torch.int64, device=getattr(group, "device", "cpu"))
    facts = group.all_gather(mine)
    same = (facts == facts[0]).all(dim=0)
    return bool(same[0].item()), bool(same[1].item())


def _group_alive(group) -> bool:
    """A torch process group is usable only while torch.distributed is initialised."""
    if getattr(group, "group", None) is None:
        return True
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class GroupWorkspace:
    """The workspace of one (group ranks, dtype) and the candidates bound to it."""

    def __init__(self, manager: "WorkspaceManager", group, dtype: torch.dtype, device):
        self.manager = manager
        self.group = group
        self.ranks = tuple(group.ranks)
        self.world = group.size
        self.rank = group.rank
        self.dtype = dtype
        self.device = device
        self.workspace: Any = None
        self.spec: Optional[WorkspaceSpec] = None
        self._bound: "weakref.WeakSet" = weakref.WeakSet()
        #: every launcher on this workspace calls it first (kernels on it must not overlap)
        self.order = LaunchOrder()

    @property
    def available(self) -> bool:
        return self.workspace is not None

    # binding -------------------------------------------------------------------------------
    def bind(self, candidate) -> None:
        """Remember `candidate` so that a rebuild or a release unbinds it."""
        self._bound.add(candidate)

    def _unbind_all(self) -> None:
        for candidate in list(self._bound):
            candidate.unbind()
        self._bound = weakref.WeakSet()

    # life cycle ----------------------------------------------------------------------------
    @property
    def captured(self) -> bool:
        """A launch on this workspace was recorded into a CUDA graph (which keeps its addresses)."""
        return self.order.captured

    def ensure(self, spec: WorkspaceSpec, local_reason: Optional[str], fingerprint: int = 0, *, recapture: bool = False) -> EnsureResult:
        """Make the workspace hold `spec` on every rank, or on none. Collective. `fingerprint`
        summarises the settings that decide which kernel runs; ranks that differ stay unfused.

        A workspace that must be rebuilt (or given up) after a CUDA graph was captured on it is
        refused with `WorkspaceCapturedError` on every rank (agreed, nothing released): the graph
        would replay into freed memory. `recapture=True` says the caller drops its graphs and
        captures again after this call."""
        backend, group = self.manager.backend, self.group
        single_node, same_settings = _shared_facts(group, fingerprint)
        reason = local_reason
        if reason is None and not single_node:
            reason = "the group spans more than one node (the trtllm workspace maps peer memory over NVLink/PCIe)"
        if reason is None and not same_settings:
            reason = "ranks of the group run with different flashinfer settings (max_tokens or LAYER_BOUNDARY_FLASHINFER_*)"
        if reason is None:
            reason = _safe(lambda: backend.probe(self.device, group), "probing the device")
        reuse = False
        if reason is None and self.workspace is not None:
            reuse = bool(_safe_value(lambda: backend.sufficient(self.workspace, spec, self.world), False))
        need = 0
        if reason is None:
            need = _safe_value(lambda: backend.required_bytes(spec, self.world), None)
            if need is None:
                reason = "could not size the workspace"
        if reason is None and not reuse:
            reason = self._preflight(need)
        ok = group.agree(reason is None)
        reused = ok and group.agree(reuse)
        if self.workspace is not None and not reused and not recapture:  # the old one would be freed
            if not group.agree(not self.captured):
                raise WorkspaceCapturedError(
                    f"the flashinfer fusion workspace of ranks {list(self.ranks)} ({self.dtype}) cannot be "
                    f"{'rebuilt' if ok else 'given up'} ({'it is too small for ' + repr(spec) if ok else reason or 'another rank cannot keep it'}): "
                    "a CUDA graph was captured on it and would replay into freed memory; prepare with the largest "
                    "max_tokens and widest hidden before capturing, or drop the graphs and pass recapture=True"
                )
        if not ok:
            self.release(barrier=True)
            why = reason or "another rank of the group cannot create the workspace"
            return EnsureResult(self.ranks, str(self.dtype), False, "unavailable", why)
        if reused:
            held = _safe_value(lambda: backend.required_bytes(self.spec, self.world), 0)
            return EnsureResult(self.ranks, str(self.dtype), True, "reused", "", held)
        rebuilding = self.workspace is not None
        self.release(barrier=True)
        created, error = None, None
        try:
            created = backend.create(spec, group, self.device)
        except Exception as exc:  # noqa: BLE001 - reported, and the group falls back together
            error = f"creating the workspace failed: {type(exc).__name__}: {exc}"
        if not group.agree(created is not None):
            if created is not None:
                _safe(lambda: backend.quiesce(self.device), "waiting for the device")
            group.agree(True)  # every rank is out of the rendezvous before any part is released
            if created is not None:
                _safe(lambda: backend.destroy(created), "releasing a partial workspace")
            why = error or "another rank of the group failed to create the workspace"
            return EnsureResult(self.ranks, str(self.dtype), False, "unavailable", why)
        self.workspace, self.spec = created, spec
        self.manager._created()
        return EnsureResult(self.ranks, str(self.dtype), True, "rebuilt" if rebuilding else "created", "", need)

    def _preflight(self, need: int) -> Optional[str]:
        backend = self.manager.backend
        free = _safe_value(lambda: backend.free_bytes(self.device), None)
        if free is None:
            return "could not read free device memory"
        if self.workspace is not None and self.spec is not None:  # the old one is released first
            free += _safe_value(lambda: backend.required_bytes(self.spec, self.world), 0)
        wanted = need + PREFLIGHT_HEADROOM_BYTES
        if free < wanted:
            return (
                f"memory preflight: the workspace needs {need / 2**20:.0f} MiB (+{PREFLIGHT_HEADROOM_BYTES >> 20} MiB "
                f"headroom) but {free / 2**20:.0f} MiB are free; lower max_tokens"
            )
        return None

    def release(self, *, barrier: bool) -> None:
        """Unbind every candidate and free this rank's part of the workspace.

        With `barrier` (collective: every rank calls it), no rank frees before every rank has
        finished the kernels that read or write its peers' buffers. Without it (interpreter
        exit, when peers may be gone), only this rank's own work is awaited.
        """
        self._unbind_all()
        self.order.reset()
        workspace, self.workspace, self.spec = self.workspace, None, None
        if workspace is None:
            return
        backend = self.manager.backend
        _safe(lambda: backend.quiesce(self.device), "waiting for the device")
        if barrier and _group_alive(self.group):
            self.group.agree(True)
        _safe(lambda: backend.destroy(workspace), "releasing the workspace")

    def __repr__(self) -> str:
        state = f"{self.spec}" if self.available else "unavailable"
        return f"GroupWorkspace(ranks={self.ranks}, {self.dtype}, {state})"


def _safe(fn: Callable[[], Optional[str]], what: str) -> Optional[str]:
    """`fn()` as a reason; an exception becomes the reason (never raised before an agreement)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return f"{what} failed: {type(exc).__name__}: {exc}"


def _safe_value(fn, default):
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return default


class WorkspaceManager:
    """Every workspace of this process, keyed by (group ranks, dtype)."""

    def __init__(self, backend: WorkspaceBackend):
        self.backend = backend
        self.slots: dict[tuple, GroupWorkspace] = {}
        self._lock = threading.Lock()
        self._exit_hook = False

    def slot(self, group, dtype: torch.dtype, device) -> GroupWorkspace:
        # the group's own rank is part of the key: ranks of a threaded test world share a process
        key = (tuple(group.ranks), dtype, group.rank)
        with self._lock:
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = GroupWorkspace(self, group, dtype, device)
            else:
                slot.group = group  # the same ranks, maybe through a newer Collectives object
            return slot

    def graphs_dropped(self) -> None:
        """The engine destroyed every CUDA graph captured on these workspaces (local, no
        collective; call it on every rank): they may be rebuilt again."""
        for slot in self.slots.values():
            slot.order.captured = False

    def shutdown(self, *, barrier: bool = True) -> None:
        """Release every workspace (in key order, the same on every rank)."""
        for key in sorted(self.slots, key=lambda k: (k[0], str(k[1]), k[2])):
            self.slots[key].release(barrier=barrier)

    def _created(self) -> None:
        if not self._exit_hook:
            self._exit_hook = True
            atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        # peers may already be gone: no barrier, just this rank's work and its mappings
        self.shutdown(barrier=False)
