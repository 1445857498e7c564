"""Test doubles for running the flashinfer plugin's machinery on CPU.

`ReferenceBackend` stands in for `FlashInferBackend`: its "workspaces" are records, creation,
probing and memory can be made to fail on chosen ranks, and its launchers compute what the
fused kernels compute (the sum over the group, the add, the RMSNorm from gamma / eps / Gemma
bias) with the group's own all_reduce instead of peer memory. What the tests check through it
is the plugin's plumbing: which stages bind, what reaches the launchers, when candidates
decline, and how the group agrees; the kernels themselves are checked on the GPU.
"""

from __future__ import annotations

import threading

import torch

from layer_boundary.models import build_model, family, model_config
from layer_boundary.models.weights import StateDictSource
from layer_boundary_flashinfer import plugin as plugin_module
from layer_boundary_flashinfer.backend import workspace_bytes
from layer_boundary_flashinfer.workspace import WorkspaceManager

#: small model configs (hidden a multiple of 8) for the CPU plumbing runs
CONFIGS = {
    "qwen3": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "head_dim": 8, "vocab_size": 96},
    "qwen3_moe": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "head_dim": 8, "vocab_size": 96,
                  "moe_intermediate_size": 16, "mlp_only_layers": [2]},
    "gemma": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "head_dim": 8, "vocab_size": 96},
}

family("qwen3")  # load the model families now: `models._load` is not safe when threads race into it


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

    def __init__(self, *, fail_probe=(), fail_create=(), fail_bind=(), free=None, finalize_tokens=4, finalize_declines=None):
        self.fail_probe, self.fail_create, self.fail_bind = set(fail_probe), set(fail_create), set(fail_bind)
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
        from layer_boundary.plugin import quantize_fp8

        group, launches = uncounted(slot.group), self.launches
        assert (fmt == "fp8_static") == (static_scale is not None)

        def launch(x, residual, tokens):
            assert x.is_contiguous() and residual.is_contiguous() and x.shape == (tokens, hidden)
            launches.append(("all_reduce_fp8", group.rank, tokens))
            total = group.all_reduce(x).to(torch.float32) + residual.to(torch.float32)
            y = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * (gamma.to(torch.float32) + weight_bias)
            return quantize_fp8(y, residual.dtype, static_scale), total.to(residual.dtype)

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


class hardware_present:
    """Make the plugin's factory see a GPU and flashinfer (its candidates still need prepare).
    Re-entrant across the threads of a threaded world: the first in patches, the last out restores."""

    _lock = threading.Lock()
    _depth = 0
    _saved = None

    def __enter__(self):
        cls = type(self)
        with cls._lock:
            if cls._depth == 0:
                cls._saved = plugin_module.hardware_ready
                plugin_module.hardware_ready = lambda: True
            cls._depth += 1
        return self

    def __exit__(self, *exc):
        cls = type(self)
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0:
                plugin_module.hardware_ready = cls._saved


def tiny_model(name, parallel, dtype=torch.float32, seed=3, **extra):
    cfg = dict(family(name).preset, **CONFIGS[name], **extra)
    config = model_config(name, cfg)
    model = build_model(config, parallel, dtype=dtype)
    family(name).load_weights(model, StateDictSource(family(name).random_weights(config, dtype, seed)))
    return config, model.eval()


def prompt_batches(config, sizes=(5, 1, 3), seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in sizes]


@torch.inference_mode()
def model_logits(model, parallel, prompts):
    """Prefill `prompts` (one request each, batched) then one decode step; logits of both."""
    from layer_boundary import Forward, ForwardMode
    from layer_boundary.models.attention import StepLayout

    cache = model.new_cache()
    slots = list(range(len(prompts)))
    step = StepLayout(slots, [len(p) for p in prompts], [0] * len(prompts))
    prefill = model(torch.cat(prompts), Forward(parallel, step.num_tokens, mode=ForwardMode.EXTEND), step, cache)
    step = StepLayout(slots, [1] * len(prompts), [len(p) for p in prompts])
    ids = torch.stack([p[0] for p in prompts])
    decode = model(ids, Forward(parallel, len(prompts), mode=ForwardMode.DECODE), step, cache)
    return prefill, decode


def on_off_run(parallel, name, backend_options, max_tokens=64, collectives=False, config_extra=None):
    """One rank: logits unfused (before prepare), then after prepare with a ReferenceBackend;
    the report, the launch counts and both logits. Module-level so gloo workers can run it.
    `collectives`: build the model on `flashinfer_collectives(parallel)`."""
    from layer_boundary_flashinfer.collectives import flashinfer_collectives
    from layer_boundary_flashinfer.service import prepare_flashinfer_fusion

    backend = ReferenceBackend(**backend_options)
    manager = WorkspaceManager(backend)
    if collectives:
        parallel = flashinfer_collectives(parallel)
    with hardware_present():
        config, model = tiny_model(name, parallel, **(config_extra or {}))
    prompts = prompt_batches(config)
    unfused = model_logits(model, parallel, prompts)
    report = prepare_flashinfer_fusion(model, max_tokens=max_tokens, manager=manager)
    fused = model_logits(model, parallel, prompts)
    manager.shutdown()
    return {
        "report": report,
        "unfused": unfused,
        "fused": fused,
        "launches": {k: backend.count(k, parallel.rank) for k in ("all_reduce", "finalize")
                     + (("plain_all_reduce",) if collectives else ()) + (("all_reduce_fp8",) if config_extra else ())},
        "after_release": model_logits(model, parallel, prompts) if collectives else None,
        "events": [e for e in backend.events if e[1] == parallel.groups["tp"].rank],
    }
