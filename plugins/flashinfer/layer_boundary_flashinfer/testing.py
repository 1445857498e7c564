"""Test support for the flashinfer plugin without FlashInfer or a GPU.

`ReferenceBackend` stands in for `FlashInferBackend`: its "workspaces" are records, creation,
probing and memory can be made to fail on chosen ranks, and its launchers compute what the
fused kernels compute (the sum over the group, the add, the RMSNorm from gamma / eps / Gemma
bias, the FP8 quantization) with the group's own all_reduce instead of peer memory. What runs
through it is the plugin's plumbing: which stages bind, what reaches the launchers, when
candidates decline, and how the group agrees; the kernels themselves are checked on the GPU.

`ContractPreparation` is how the provider contract suite (`layer_boundary.testing.contract`)
readies this plugin's record on a machine without FlashInfer: the factory sees the hardware, and
every provider it builds has its candidates bound to the reference launchers, so the contract
compares real candidate code (declines, rank uniformity, parity) instead of passing on candidates
that never accept.
"""

from __future__ import annotations

import threading
import types

import torch

from layer_boundary.plugin import quantize_fp8
from layer_boundary.testing import SharedSetting

from . import plugin as plugin_module
from .backend import workspace_bytes
from .eligibility import SUPPORTED_DTYPES

__all__ = ["ReferenceBackend", "FakeWorkspace", "reference_add_norm", "uncounted", "hardware_present", "ContractPreparation"]


class FakeWorkspace:
    def __init__(self, spec, world, rank):
        self.spec, self.world, self.rank = spec, world, rank
        self.destroyed = False


def reference_add_norm(total, residual, gamma, eps, bias):
    """The fused kernels' add + RMSNorm: the sum in fp32 rounded once into the residual, the
    statistic in fp32 on the unrounded sum, scaled by (gamma + bias)."""
    acc = torch.promote_types(total.dtype, torch.float32)
    summed = total.to(acc) + residual.to(acc)
    new_residual = summed.to(residual.dtype)
    x = summed.to(torch.float32)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (gamma.to(normed.dtype) + bias)).to(residual.dtype), new_residual


def uncounted(group):
    """The group under any CountingCollectives: the fake kernels' own sums are not the model's
    collectives (a real kernel sums through peer memory, not the process group)."""
    while type(group).__name__ == "CountingCollectives":
        group = group.inner
    return group


class ReferenceBackend:
    """A WorkspaceBackend for CPU tests (see the module docstring). Failure injection by the
    group's own rank: `fail_probe`, `fail_create`, `fail_bind` (sets of ranks), `free` (per-rank
    free bytes). `finalize_tokens` is the fake finalize kernel's token limit."""

    name = "reference"
    device_type = "cpu"

    def __init__(self, *, fail_probe=(), fail_create=(), fail_bind=(), free=None, finalize_tokens=4, finalize_declines=None,
                 capability=(9, 0)):
        self.fail_probe, self.fail_create, self.fail_bind = set(fail_probe), set(fail_create), set(fail_bind)
        #: the compute capability the settings' `auto` rules see (a Hopper by default)
        self.device_capability = capability
        #: (hidden, dtype) -> reason: widths the fake finalize kernel refuses, as the real one's rules do
        self.finalize_declines = dict(finalize_declines or {})
        self.free = dict(free or {})
        self.finalize_tokens = finalize_tokens
        self._lock = threading.Lock()
        self.events: list[tuple] = []
        self.launches: list[tuple] = []
        self._rank = threading.local()

    def _log(self, *event):
        with self._lock:
            self.events.append(event)

    def placement_reason(self, tensor):
        return None

    def capability(self, device):
        return self.device_capability

    def width_reason(self, hidden, dtype):
        return None

    def finalize_reason(self, hidden, dtype):
        return self.finalize_declines.get((hidden, dtype))

    def probe(self, device, group):
        self._rank.value = group.rank
        return f"injected probe failure on rank {group.rank}" if group.rank in self.fail_probe else None

    def required_bytes(self, spec, world):
        return workspace_bytes(spec, world)

    def free_bytes(self, device):
        return self.free.get(getattr(self._rank, "value", 0), 1 << 40)

    def create(self, spec, group, device):
        self._log("create", group.rank, spec)
        if group.rank in self.fail_create:
            raise RuntimeError(f"injected creation failure on rank {group.rank}")
        return FakeWorkspace(spec, group.size, group.rank)

    def sufficient(self, workspace, spec, world):
        have = workspace.spec
        return have.dtype == spec.dtype and world == workspace.world and spec.max_tokens * spec.hidden <= have.max_tokens * have.hidden

    def quiesce(self, device):
        pass

    def destroy(self, workspace):
        self._log("destroy", workspace.rank, workspace.spec)
        workspace.destroyed = True

    def bind_all_reduce(self, slot, gamma, eps, weight_bias, hidden, limit):
        if slot.group.rank in self.fail_bind:
            raise RuntimeError(f"injected bind failure on rank {slot.group.rank}")
        group, launches = uncounted(slot.group), self.launches

        def launch(x, residual, tokens):
            assert x.is_contiguous() and residual.is_contiguous() and x.shape == (tokens, hidden)
            launches.append(("all_reduce", group.rank, tokens))
            return reference_add_norm(group.all_reduce(x), residual, gamma, eps, weight_bias)

        return launch

    def bind_all_reduce_fp8(self, slot, gamma, eps, weight_bias, hidden, limit, fmt, static_scale=None):
        """The fused FP8 read as the core's unfused quantizing read computes it (fp32 norm)."""

        group, launches = uncounted(slot.group), self.launches
        assert (fmt == "fp8_static") == (static_scale is not None)

        def launch(x, residual, tokens):
            assert x.is_contiguous() and residual.is_contiguous() and x.shape == (tokens, hidden)
            launches.append(("all_reduce_fp8", group.rank, tokens))
            total = group.all_reduce(x).to(torch.float32) + residual.to(torch.float32)
            y = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * (gamma.to(torch.float32) + weight_bias)
            return quantize_fp8(y, residual.dtype, static_scale), total.to(residual.dtype)

        launch.per_token = static_scale is None
        return launch

    def bind_plain_all_reduce(self, slot):
        from layer_boundary_flashinfer.collectives import FlashInferCollectives

        group, launches = slot.group, self.launches
        while isinstance(group, FlashInferCollectives) or type(group).__name__ == "CountingCollectives":
            group = group.inner  # the process group the "kernel" stands in for

        def launch(rows):
            assert rows.is_contiguous() and rows.dim() == 2
            launches.append(("plain_all_reduce", group.rank, rows.shape[0]))
            return group.all_reduce(rows.clone())

        return launch

    def bind_finalize(self, slot, gamma, eps, weight_bias, hidden, limit):
        group, launches = uncounted(slot.group), self.launches

        def launch(rows, scales, shared, residual):
            assert rows.is_contiguous() and scales.dtype == rows.dtype and scales.shape == rows.shape[:2]
            launches.append(("finalize", group.rank, rows.shape[0]))
            out = (rows * scales.unsqueeze(-1)).sum(dim=1)
            if shared is not None:
                out = out + shared
            return reference_add_norm(group.all_reduce(out), residual, gamma, eps, weight_bias)

        launch.max_tokens = self.finalize_tokens
        launch.max_top_k = 64
        return launch

    def count(self, kind, rank=None):
        return sum(1 for k, r, _ in self.launches if k == kind and (rank is None or r == rank))


def _present():
    saved = plugin_module.hardware_ready
    plugin_module.hardware_ready = lambda: True
    return saved


_HARDWARE = SharedSetting(_present, lambda saved: setattr(plugin_module, "hardware_ready", saved))


def hardware_present() -> SharedSetting:
    """The plugin's factory sees a GPU and flashinfer while any rank is inside (its candidates
    still need binding); ranks of a threaded world share the process, so entries are counted."""
    return _HARDWARE


class ContractPreparation:
    """The contract suite's preparation of `flashinfer.ar_add_rmsnorm` (see the module docstring).
    The candidates are bound for up to `LIMIT` tokens in the dtypes FlashInfer has workspaces for;
    float64 stays unbound (FlashInfer has no such workspace), as it would after a real prepare."""

    LIMIT = 64

    def __init__(self):
        self._present = hardware_present()
        self._backend = ReferenceBackend(finalize_tokens=self.LIMIT)

    def __enter__(self):
        self._present.__enter__()
        return self

    def __exit__(self, *exc):
        return self._present.__exit__(*exc)

    def bind(self, provider, plan) -> None:
        from .provider import FlashInferFinalizeFusion, FlashInferFusion

        if not isinstance(provider, FlashInferFusion):
            return
        if isinstance(provider, FlashInferFinalizeFusion):
            provider.enable_finalize(self.LIMIT)
        desc, norm = provider.description, plan.norm
        if provider.offers_plain:  # the plain all-reduce before the stage's local norms
            weight = next((n.weight for n in (norm, plan.post_norm) if isinstance(getattr(n, "weight", None), torch.Tensor)), None)
            if weight is not None and weight.dtype in SUPPORTED_DTYPES:
                group = plan.group(desc.incoming_sum)
                provider.plain.bind(self._backend.bind_plain_all_reduce(types.SimpleNamespace(group=group)), limit=self.LIMIT,
                                    dtype=weight.dtype, hidden=desc.hidden_size, group=group, cuda=weight.is_cuda)
            return
        if not provider.offers_input or desc.incoming_sum is None or norm is None:
            return
        dtype = norm.weight.dtype
        if dtype not in SUPPORTED_DTYPES:
            return
        group = plan.group(desc.incoming_sum)
        slot = types.SimpleNamespace(group=group)
        backend, hidden, limit = self._backend, desc.hidden_size, self.LIMIT
        gamma, eps, bias = norm.weight.detach(), float(norm.eps), float(type(norm).offset)
        common = dict(limit=limit, dtype=dtype, hidden=hidden, group=group, cuda=norm.weight.is_cuda)
        fmt = provider.read_format
        if fmt != "plain":
            scale = getattr(plan.read, "static_scale", None)
            provider.fp8.bind(backend.bind_all_reduce_fp8(slot, gamma, eps, bias, hidden, limit, fmt, scale), **common)
            return
        provider.all_reduce.bind(backend.bind_all_reduce(slot, gamma, eps, bias, hidden, limit), **common)
        if provider.takes_handoff:
            provider.finalize.bind(backend.bind_finalize(slot, gamma, eps, bias, hidden, limit), **common)
