"""Test support: the float64 references as a `KernelSet`, so a whole model, its service, its
decisions and its collectives run with the plugin on CPU ranks (threaded or gloo worlds).

    fusion = CuteDSLFusion(kernels=reference_kernels(calls))   # calls: a list that records launches

Each "launch" computes the exact float64 result and rounds it once to the output dtype, as the
kernels do; it accepts any device and bf16/fp16/fp32/fp64 rows and fp32/fp64 norm statistics.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import struct
import threading
import time
from typing import Callable, Optional

import torch

from layer_boundary.testing import shared_env

from .kernel_set import CUTEDSL_KERNELS, KernelSet
from .kernels.reference import add_norms_reference, add_rmsnorm_reference, moe_finalize_add_rmsnorm_reference, moe_finalize_reference
from .oneshot import OneShotKernels, OneShotTimeout
from .peer_memory import HostWords, PeerMemory

__all__ = ["reference_kernels", "reference_oneshot", "FakePeerMemory", "ContractPreparation"]


def _into(result: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def reference_kernels(calls: Optional[list] = None, *, oneshot: Optional[OneShotKernels] = None) -> KernelSet:
    """The references as kernels; every launch appends (name, tokens, details) to `calls`.
    `oneshot`: the one-shot all-reduce to use under TP (`reference_oneshot()`; default none)."""

    def record(*entry):
        if calls is not None:
            calls.append(entry)

    def fused_add_rmsnorm(x, residual, gamma, eps, out=None, *, residual_out=None, weight_offset=0.0):
        record("fused_add_rmsnorm", x.shape[0], {"eps": eps, "weight_offset": weight_offset})
        normed, new_residual = add_rmsnorm_reference(x, residual, gamma, eps, weight_offset=weight_offset)
        return _into(normed, out), _into(new_residual, residual_out)

    def moe_finalize(routed, indices, weights, *, shared=None, out=None):
        record("moe_finalize", weights.shape[0], {"top_k": weights.shape[1], "shared": shared is not None, "into_buffer": out is not None})
        return _into(moe_finalize_reference(routed, indices, weights, shared), out)

    def moe_finalize_add_rmsnorm(routed, indices, weights, residual, gamma, eps, *, shared=None, weight_offset=0.0, out=None, residual_out=None):
        record("moe_finalize_add_rmsnorm", weights.shape[0], {"eps": eps, "weight_offset": weight_offset, "shared": shared is not None})
        normed, new_residual = moe_finalize_add_rmsnorm_reference(routed, indices, weights, shared, residual, gamma, eps, weight_offset=weight_offset)
        return _into(normed, out), _into(new_residual, residual_out)

    def prepare(dtype, hidden, device, add_norm_offsets, moe_shapes):
        record("prepare", 0, {"dtype": dtype, "hidden": hidden, "offsets": tuple(add_norm_offsets), "moe": tuple(moe_shapes)})

    def add_norms(x, residual, gamma, beta, post_gamma, eps, post_eps, shape):
        record("add_norms", x.shape[0], {"shape": shape, "eps": eps, "post_eps": post_eps})
        return add_norms_reference(x, residual, gamma, beta, post_gamma, eps, post_eps, shape)

    def prepare_add_norms(dtype, hidden, shapes, device):
        record("prepare_add_norms", 0, {"dtype": dtype, "hidden": hidden, "shapes": tuple(shapes)})

    return KernelSet(
        name="float64-reference",
        fused_add_rmsnorm=fused_add_rmsnorm,
        moe_finalize=moe_finalize,
        moe_finalize_add_rmsnorm=moe_finalize_add_rmsnorm,
        prepare=prepare,
        available=lambda: True,
        on_device=lambda t: True,
        dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
        norm_compute_dtypes=(torch.float32, torch.float64),
        oneshot=oneshot,
        add_norms=add_norms,
        prepare_add_norms=prepare_add_norms,
    )


# ---------------------------------------------------------------------------------------------
# the one-shot all-reduce on CPU ranks: fake peer memory and the protocol in torch
# ---------------------------------------------------------------------------------------------


class FakePeerMemory(PeerMemory):
    """Peer memory of a threaded world: zeroed CPU bytes in this process; a "handle" is a
    registry key, "mapping" it finds the same tensor. `fail` makes one step raise on this rank
    ("allocate", "export" or "open"), for the fallback tests."""

    name = "fake"
    _lock = threading.Lock()
    _keys = itertools.count(1)
    _by_key: dict = {}
    _by_address: dict = {}

    def __init__(self, fail: Optional[str] = None):
        self.fail = fail
        self.opened: dict = {}
        self.freed: list = []

    def _maybe_fail(self, step: str) -> None:
        if self.fail == step:
            raise OSError(f"fake peer memory: {step} failed on purpose")

    def allocate(self, nbytes, device):
        self._maybe_fail("allocate")
        t = torch.zeros(nbytes, dtype=torch.uint8)
        with self._lock:
            key = (os.getpid() << 24) | next(self._keys)  # unknown to any other process
            self._by_key[key] = t
            self._by_address[t.data_ptr()] = (key, t)
        return t.data_ptr()

    def export(self, address):
        self._maybe_fail("export")
        key, _ = self._by_address[address]
        return struct.pack("<q", key)

    def open(self, handle, device):
        self._maybe_fail("open")
        (key,) = struct.unpack("<q", handle[:8])
        t = self._by_key[key]
        self.opened[t.data_ptr()] = t
        return t.data_ptr()

    def close(self, address, device):
        del self.opened[address]

    def free(self, address, device):
        with self._lock:
            key, _ = self._by_address.pop(address)
            del self._by_key[key]
        self.freed.append(address)

    def host_words(self, count, device):
        words = torch.zeros(count, dtype=torch.int64)
        return HostWords(count, words.data_ptr(), words.tolist, None)

    def free_bytes(self, device):
        """A pretend 1 TiB device: what the live buffers of this process leave."""
        return (1 << 40) - sum(t.numel() for _, t in self._by_address.values())

    @classmethod
    def view(cls, address) -> torch.Tensor:
        return cls._by_address[address][1]

    @classmethod
    def live(cls) -> int:
        """Buffers allocated and not freed (all ranks of this process)."""
        return len(cls._by_key)


def _flags(buf, layout):
    return buf[: layout.flags_bytes].view(torch.int64).view(layout.world, layout.capacity)


def _staging(buf, layout, dtype, hidden):
    ebytes = torch.empty((), dtype=dtype).element_size()
    rows = buf[layout.staging_offset : layout.nbytes].view(2, layout.capacity, layout.row_stride)
    return rows[..., : hidden * ebytes].view(dtype)


def _exchange(ws, partial: torch.Tensor) -> torch.Tensor:
    """The kernel's protocol, in torch: publish this rank's (rounded) partial rows in the staging
    of the call's parity, raise the call's epoch in every peer's flags, wait for every peer's
    flags, sum every rank's rows in rank order (float64). Returns the sum."""
    layout, view = ws.layout, FakePeerMemory.view
    tokens, hidden = partial.shape
    epoch = int(ws.state[0]) + 1
    parity = epoch % 2
    own = view(ws.buffer)
    _staging(own, layout, ws.dtype, hidden)[parity, :tokens] = partial
    for p in range(ws.world):
        if p != ws.rank:
            _flags(view(ws.addresses[p]), layout)[ws.rank, :tokens] = epoch
    mine = _flags(own, layout)
    peers = [p for p in range(ws.world) if p != ws.rank]
    deadline = time.monotonic() + ws.timeout_s
    while bool((mine[peers, :tokens] < epoch).any()):
        if time.monotonic() > deadline:
            raise OneShotTimeout(f"reference one-shot on rank {ws.rank}: a peer did not publish call {epoch} within {ws.timeout_s} s")
        time.sleep(0.0002)
    total = torch.zeros(tokens, hidden, dtype=torch.float64)
    for r in range(ws.world):
        total += _staging(view(ws.addresses[r]), layout, ws.dtype, hidden)[parity, :tokens].to(torch.float64)
    ws.state[0] = epoch
    return total


def reference_oneshot(calls: Optional[list] = None, *, memory: Optional[Callable] = None) -> OneShotKernels:
    """The one-shot all-reduce on CPU ranks of a threaded world: `FakePeerMemory` (or `memory()`)
    and the kernel's protocol in torch, float64 sums rounded once; launches are recorded."""

    def record(*entry):
        if calls is not None:
            calls.append(entry)

    def norm(total, residual, gamma, eps, weight_offset, out, residual_out):
        normed, new_residual = add_rmsnorm_reference(total, residual, gamma, eps, weight_offset=weight_offset)
        return _into(normed.to(residual.dtype), out), _into(new_residual, residual_out)

    def all_reduce_add_rmsnorm(ws, partial, residual, gamma, eps, *, weight_offset=0.0, out=None, residual_out=None):
        record("oneshot_all_reduce_add_rmsnorm", residual.shape[0], {"eps": eps, "weight_offset": weight_offset, "world": ws.world})
        return norm(_exchange(ws, partial.to(ws.dtype)), residual, gamma, eps, weight_offset, out, residual_out)

    def moe_finalize_all_reduce_add_rmsnorm(ws, rows, weights, residual, gamma, eps, *, shared=None, weight_offset=0.0, out=None, residual_out=None):
        record(
            "oneshot_moe_finalize_all_reduce_add_rmsnorm",
            residual.shape[0],
            {"eps": eps, "weight_offset": weight_offset, "world": ws.world, "top_k": rows.shape[1], "shared": shared is not None},
        )
        partial = moe_finalize_reference(rows, None, weights, shared)
        return norm(_exchange(ws, partial), residual, gamma, eps, weight_offset, out, residual_out)

    def prepare(dtype, hidden, world, weight_offsets, moe_shapes, device):
        record("oneshot_prepare", 0, {"dtype": dtype, "hidden": hidden, "world": world, "offsets": weight_offsets, "moe": moe_shapes})

    def all_reduce_add_norms(ws, partial, residual, gamma, beta, post_gamma, eps, post_eps, shape, *, out=None, residual_out=None):
        record("oneshot_all_reduce_add_norms", residual.shape[0], {"shape": shape, "eps": eps, "post_eps": post_eps, "world": ws.world})
        total = _exchange(ws, partial.to(ws.dtype))
        if shape.post:  # the completed sum, rounded once, goes through the post-norm
            normed, new_residual = add_norms_reference(total.to(ws.dtype), residual, gamma, beta, post_gamma, eps, post_eps, shape)
        else:
            normed, new_residual = add_norms_reference(total, residual, gamma, beta, post_gamma, eps, post_eps, shape)
        new_residual = _into(new_residual, residual_out)
        return (new_residual if shape.norm == "none" else _into(normed, out)), new_residual

    def prepare_norms(dtype, hidden, world, shapes, device):
        record("oneshot_prepare_norms", 0, {"dtype": dtype, "hidden": hidden, "world": world, "shapes": tuple(shapes)})

    return OneShotKernels(
        name="reference-oneshot",
        memory=memory or FakePeerMemory,
        prepare=prepare,
        all_reduce_add_rmsnorm=all_reduce_add_rmsnorm,
        moe_finalize_all_reduce_add_rmsnorm=moe_finalize_all_reduce_add_rmsnorm,
        dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
        process_id=lambda: (os.getpid() << 24) ^ threading.get_ident(),
        all_reduce_add_norms=all_reduce_add_norms,
        prepare_norms=prepare_norms,
    )


class ContractPreparation:
    """How the provider contract suite (`layer_boundary.testing.contract`) readies this plugin's
    record without a GPU: the opt-in switch is on for the pass, so the factory builds providers,
    and each provider computes with the float64 references instead of the CuTe DSL kernels (the
    candidates' own declines, rank uniformity and parity are what the suite then checks)."""

    def __enter__(self):
        _OPT_IN.__enter__()
        return self

    def __exit__(self, *exc):
        return _OPT_IN.__exit__(*exc)

    def bind(self, provider, plan) -> None:
        from .provider import CuteDSLFusion

        if isinstance(provider, CuteDSLFusion) and provider.service is None:
            # the references in place of the kernels, taking exactly what the kernels take
            # (their dtypes, an fp32 norm statistic): elsewhere the candidates decline as on a GPU
            provider._kernels = dataclasses.replace(
                reference_kernels(), dtypes=CUTEDSL_KERNELS.dtypes, norm_compute_dtypes=CUTEDSL_KERNELS.norm_compute_dtypes,
                max_hidden=CUTEDSL_KERNELS.max_hidden)


#: the plugin's opt-in switch, on while any rank of a contract pass is inside
_OPT_IN = shared_env("LAYER_BOUNDARY_CUTEDSL", "1")
