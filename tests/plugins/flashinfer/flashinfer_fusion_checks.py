"""The flashinfer plugin's fused all-reduce + add + RMSNorm checked on every rank of a TP world:
on GPU ranks (`test_flashinfer_fusion_gpu.py`, FlashInfer's kernels) and on threaded CPU ranks
(`test_flashinfer_fusion_checks_cpu.py`, the reference backend standing in for the kernels, so
that what the GPU tests run is exercised on every machine).

Each `check_*(parallel, case, ...)` runs on one rank in lock-step with the others and returns
that rank's checks (`{"check": name, "ok": bool, **facts}`): a failed comparison is recorded, not
raised, so every rank finishes its collectives and a test reports every failure with its facts.
Each releases the workspaces it made before it returns.

- `check_memory`: a workspace takes what `workspace_bytes` says (as CUDA reports it) and release
  gives it back (GPU only);
- `check_boundary`: fused all-reduce + add + RMSNorm (and Gemma's (1 + w)) against the unfused
  path and float64, token counts across the one-shot/two-shot switch and up to the limit (+1 falls
  back, bitwise); every rank identical; on a GPU a CUDA graph of fused boundaries replays what
  eager computes, a rebuild under it is refused, and the eager fast path (the compiled op) runs;
- `check_twoshot`: the same with two-shot forced wherever FlashInfer allows it (tokens > ranks);
- `check_finalize`: a MoE's sum through the plugin: its finalize handed off or kept in the MoE
  (FlashInfer 0.7.2's finalize kernel is declined on a GPU), fused equals unfused;
- `check_fallback`: one rank failing its probe or its memory preflight turns the fusion off on
  every rank, and the boundary computes what the unfused path computes, bitwise;
- `check_defects`: FlashInfer 0.7.2's kernel limits the plugin declines, reproduced on the GPU
  (the finalize kernel's spare warp lanes at hidden 64, its missing fp32 variant, fp32 rows
  above 32768), and the plugin keeping the hidden-64 finalize in the MoE (GPU only);
- `check_fp8_reads`: the fused all-reduce + add + RMSNorm + FP8 quantization against the core's
  unfused quantizing read;
- `check_model`: qwen3, gemma, qwen3_moe in bf16, logits with the plugin on and off (and against
  float32), and the all-reduces the fusion removed; with `shadow=True`, every fused call is
  recomputed unfused from copies of its inputs and held within one bf16 rounding of it (logits
  of a MoE can move through a routing flip; a single call cannot);
- `check_graph_decode`: a whole decode step captured in one CUDA graph with fused boundaries and
  every remaining sum on FlashInfer's all-reduce (`flashinfer_collectives`); replay equals eager
  (GPU only).

On one GPU the ranks share it over gloo (correctness only): their spin-waiting kernels time-slice,
so the checks keep their fused launches to tens or hundreds.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from layer_boundary.testing import SharedSetting, shared_env

#: the largest relative error allowed between two bf16 paths of one boundary (the contract's)
BF16_TOL = 2e-2
#: bf16 logits: max |difference| / max |reference|, the tolerance `layer-boundary run` checks with
BF16_LOGITS_TOL = 3e-2
#: float32 logits, the same measure (`layer-boundary run`'s float32 tolerance)
FP32_LOGITS_TOL = 1e-4
#: memory CUDA may report beyond the workspace formula per rank (pointer tables, allocator blocks)
MEMORY_SLACK = 8 << 20
#: at most this share of E4M3 bytes may differ from the unfused read's (the two round different
#: inputs, and per token with slightly different scales: ~3% differ on an H200, each by one code)
FP8_BYTES_DIFFERING = 0.06

MODEL_SIZES = {
    "qwen3": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4, "num_attention_heads": 16,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 8192},
    "gemma": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 8192},
    "qwen3_moe": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4, "num_attention_heads": 16,
                  "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 8192, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 768, "mlp_only_layers": [3]},
}


@dataclass(frozen=True)
class Case:
    """What the checks run on: "cuda" (this rank's GPU, FlashInfer's kernels) or "cpu" (the
    reference backend), the boundaries' width, the token limit, the models' sizes by name."""

    device: str = "cuda"
    hidden: int = 4096
    max_tokens: int = 2048
    sizes: dict = field(default_factory=lambda: MODEL_SIZES)

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def torch_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.gpu else torch.device(self.device)

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()

    def empty_cache(self) -> None:
        if self.gpu:
            torch.cuda.empty_cache()


class Checks:
    def __init__(self):
        self.items = []

    def add(self, name: str, ok: bool, **facts) -> None:
        self.items.append({"check": name, "ok": bool(ok), **facts})


def on_every_rank(fn):
    """`fn(checks, parallel, case, *args)` as a rank function `(parallel, case, *args) -> checks`:
    without autograd, and the workspaces released after it (in lock-step; after an error without
    waiting for the peers, which may be stuck in another collective)."""

    @functools.wraps(fn)
    def run(parallel, case, *args, **kwargs):
        from layer_boundary_flashinfer.service import default_manager

        checks = Checks()
        try:
            with torch.no_grad():
                fn(checks, parallel, case, *args, **kwargs)
        except BaseException:
            default_manager().shutdown(barrier=False)
            raise
        default_manager().shutdown(barrier=True)
        return checks.items

    return run


def failures(per_rank: list) -> list:
    """Every rank's failed checks, `(rank, check)`; rank 0's checks printed (the facts in the log)."""
    for item in per_rank[0]:
        print(f"{'PASS' if item['ok'] else 'FAIL'} {item['check']} {json.dumps({k: v for k, v in item.items() if k not in ('check', 'ok')}, default=str)}",
              file=sys.stderr)
    return [(rank, item) for rank, items in enumerate(per_rank) for item in items if not item["ok"]]


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _max_rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _tp(parallel):
    return parallel.groups["tp"]


def _summed(group, t):
    """The group's sum of `t` (a copy), through its Collectives (host-staged under gloo)."""
    return group.all_reduce(t.clone())


def _same_on_all_ranks(t, group) -> bool:
    gathered = group.all_gather(t.contiguous().unsqueeze(0))
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _reference64(partials_sum, residual, norm):
    """The boundary in float64: the sum over ranks + residual, RMSNorm, (1 + w) for Gemma."""
    total = partials_sum.double() + residual.double()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + norm.eps)
    return normed * (norm.weight.double() + float(type(norm).offset)), total


def _inputs(case, tokens, hidden, dtype, rank, seed):
    shared = torch.Generator().manual_seed(seed)
    mine = torch.Generator().manual_seed(seed + 7919 * (rank + 1))
    residual = torch.randn(tokens, hidden, generator=shared).to(case.torch_device(), dtype)
    partial = torch.randn(tokens, hidden, generator=mine).to(case.torch_device(), dtype)
    return residual, partial


def _pair(parallel, case, hidden, dtype=torch.bfloat16, **kinds):
    from layer_boundary_flashinfer.bench import BoundaryPair

    return BoundaryPair(parallel, hidden, dtype, case.torch_device(), **kinds)


def _prepare(target, limit):
    """`prepare_flashinfer_fusion` of a model or of stage boundaries, for up to `limit` tokens."""
    from layer_boundary_flashinfer.service import prepare_flashinfer_fusion

    return prepare_flashinfer_fusion(target, max_tokens=limit)


def _graphs_dropped():
    """The check's graphs are gone: later prepares may rebuild the workspaces they were captured on."""
    from layer_boundary_flashinfer.service import default_manager

    default_manager().graphs_dropped()


def _capture(case, fn, warmup: int = 2):
    """`fn()` captured in a CUDA graph after eager warm-up; (graph, output). Thread-local capture
    mode, so a communicator's watchdog thread's CUDA calls are not refused while this thread captures."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    case.sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


# memory -------------------------------------------------------------------------------------------
def _free_on_device(case, group) -> int:
    """Free device memory once every rank has finished its work (CUDA reports it per device)."""
    case.sync()
    group.agree(True)
    free = torch.cuda.mem_get_info()[0]
    group.agree(True)
    return free


@on_every_rank
def check_memory(checks, parallel, case):
    """Before any workspace exists: the formula against CUDA, and release gives it back."""
    from layer_boundary import current_placement
    from layer_boundary_flashinfer.backend import workspace_bytes
    from layer_boundary_flashinfer.service import default_manager, shutdown_flashinfer_fusion
    from layer_boundary_flashinfer.workspace import WorkspaceSpec

    group = _tp(parallel)
    placement = current_placement("cuda")
    sharing = placement.ranks // placement.devices_used if placement is not None and placement.shared else 1
    hidden, tokens = 8192, 2048
    pair = _pair(parallel, case, hidden)
    case.empty_cache()
    before = _free_on_device(case, group)
    report = _prepare(pair.boundaries, tokens)
    after = _free_on_device(case, group)
    expected = workspace_bytes(WorkspaceSpec(tokens, hidden, torch.bfloat16), group.size)
    taken = (before - after) / sharing
    checks.add("memory: the workspace takes what workspace_bytes says, as CUDA reports it",
               report.available and expected <= taken <= expected + MEMORY_SLACK,
               expected_mib=expected / 2**20, measured_mib_per_rank=taken / 2**20, ranks_per_gpu=sharing)
    shutdown_flashinfer_fusion()
    del pair
    case.empty_cache()
    left = (before - _free_on_device(case, group)) / sharing
    checks.add("memory: release returns the workspace (no mapping or flag buffer kept) without a hang",
               left <= MEMORY_SLACK and not any(s.available for s in default_manager().slots.values()),
               kept_mib_per_rank=left / 2**20)


# boundary -----------------------------------------------------------------------------------------
def _boundary_case(checks, case, pair, group, tokens, rank, label):
    hidden, dtype = pair.norm.hidden_size, pair.norm.weight.dtype
    residual, partial = _inputs(case, tokens, hidden, dtype, rank, seed=tokens)
    # the core's unfused path: the sum, then the add + norm the norm runs (a plugin's local kernel
    # where one accepts, else torch)
    want_normed, want_residual = pair.norm.fused_add_forward(_summed(group, partial), residual)
    ref_normed, ref_residual = _reference64(_summed(group, partial.double()), residual, pair.norm)
    normed, new_residual = pair.step(partial.clone(), pair.start(residual))
    case.sync()
    facts = {"tokens": tokens, "err_vs_unfused": _rel(normed, want_normed), "err_vs_fp64": _rel(normed, ref_normed),
             "unfused_err_vs_fp64": _rel(want_normed, ref_normed), "residual_err_vs_fp64": _rel(new_residual, ref_residual),
             "residual_bitwise_unfused": bool(torch.equal(new_residual, want_residual))}
    same = _same_on_all_ranks(normed, group) and _same_on_all_ranks(new_residual, group)
    if tokens > case.max_tokens:  # above the limit the candidate declines: the core's unfused path, bitwise
        ok = torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)
        checks.add(f"{label}: above the limit the unfused path runs", ok and same, **facts)
        return
    ok = facts["err_vs_unfused"] <= BF16_TOL and facts["err_vs_fp64"] <= max(2 * facts["unfused_err_vs_fp64"], 1e-3)
    ok = ok and facts["residual_err_vs_fp64"] <= BF16_TOL
    checks.add(f"{label}: fused equals unfused within bf16, ranks identical", ok and same, ranks_identical=same, **facts)


def _graph_case(checks, case, pair, rank, label):
    """A CUDA graph of a stack entry and three fused boundaries replays what eager computes."""
    tokens, hidden, dtype = 7, pair.norm.hidden_size, pair.norm.weight.dtype
    residual, partial = _inputs(case, tokens, hidden, dtype, rank, seed=99)
    static = partial.clone()

    def entry_and_three_boundaries():
        fwd = pair.start(residual)
        return [pair.step(static, fwd) for _ in range(3)]

    graph, outs = _capture(case, entry_and_three_boundaries, warmup=1)
    ok = True
    for seed in (123, 124):  # new inputs each replay: the Lamport buffers rotate
        static.copy_(_inputs(case, tokens, hidden, dtype, rank, seed=seed)[1])
        ok = ok and _replay_equals_eager(case, graph, outs, entry_and_three_boundaries)
    checks.add(f"{label}: CUDA-graph replay equals eager", ok, tokens=tokens)
    _rebuild_refused(checks, case, pair, label, graph, outs, entry_and_three_boundaries)
    del graph
    _graphs_dropped()


def _replay_equals_eager(case, graph, outs, eager_fn) -> bool:
    graph.replay()
    case.sync()
    replayed = [(a.clone(), b.clone()) for a, b in outs]
    eager = eager_fn()
    return all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(replayed, eager))


def _rebuild_refused(checks, case, pair, label, graph, outs, eager_fn):
    """A prepare that would rebuild the workspace under the captured graph raises on every rank
    and keeps the workspace: the graph still replays what eager computes."""
    from layer_boundary_flashinfer.service import default_manager
    from layer_boundary_flashinfer.workspace import WorkspaceCapturedError

    plan = pair.attn1.plan  # the input whose fused candidate the graph captured
    group = plan.group(plan.description.incoming_sum)
    slot = default_manager().slots.get((tuple(group.ranks), plan.norm.weight.dtype, group.rank))
    if slot is None or not slot.available:
        checks.add(f"{label}: a rebuild under the captured graph is refused", False, error="no workspace for the pair")
        return
    captured = slot.captured
    refused, error = False, ""
    try:
        _prepare(pair.boundaries, 4 * slot.spec.max_tokens)
    except WorkspaceCapturedError as exc:
        refused, error = True, str(exc)
    kept = slot.available
    still = _replay_equals_eager(case, graph, outs, eager_fn)
    checks.add(f"{label}: a rebuild under the captured graph is refused, the graph still replays", captured and refused and kept and still,
               launch_seen_captured=captured, refused=refused, workspace_kept=kept, replay_equals_eager=still, error=error[:200])


def _token_counts(case, world):
    counts = (1, 2, world, world + 1, 64, 127, 128, 129, 511, 1000, case.max_tokens, case.max_tokens + 1)
    return sorted(set(t for t in counts if t > 0))


@on_every_rank
def check_boundary(checks, parallel, case):
    from layer_boundary_flashinfer.service import default_manager

    group = _tp(parallel)
    pairs = {gemma: _pair(parallel, case, case.hidden, gemma=gemma) for gemma in (False, True)}
    report = _prepare([b for p in pairs.values() for b in p.boundaries], case.max_tokens)
    checks.add("boundary: workspace agreed and candidates bound", report.available and len(report.bound) == 6, report=str(report))
    if not report.available:
        return
    if case.gpu:
        fast_path = dict(default_manager().backend.fast_path)
        checks.add("boundary: the eager fast path calls the compiled op", fast_path.get("all_reduce") is True, fast_path=fast_path)
    for gemma, pair in pairs.items():
        kind = "gemma" if gemma else "rms"
        counts = _token_counts(case, group.size) if not gemma else (1, 3, 129, case.max_tokens)
        for tokens in counts:
            _boundary_case(checks, case, pair, group, tokens, parallel.rank, f"boundary {kind}")
        if case.gpu:
            _graph_case(checks, case, pair, parallel.rank, f"boundary {kind}")


#: two-shot forced on every rank of the world (ranks of a threaded world share the environment)
_TWOSHOT = None


def _twoshot_forced():
    global _TWOSHOT
    if _TWOSHOT is None:
        from layer_boundary_flashinfer.eligibility import ONESHOT_ENV

        _TWOSHOT = shared_env(ONESHOT_ENV, "twoshot")
    return _TWOSHOT


@on_every_rank
def check_twoshot(checks, parallel, case):
    """Two-shot forced (LAYER_BOUNDARY_FLASHINFER_ALGORITHM=twoshot, set on every rank alike)."""
    group = _tp(parallel)
    pair = _pair(parallel, case, case.hidden)
    with _twoshot_forced():
        report = _prepare(pair.boundaries, case.max_tokens)
        checks.add("twoshot: workspace agreed with two-shot forced", report.available, report=str(report))
        if report.available:
            for tokens in (group.size, group.size + 1, 64, 129, 1000, case.max_tokens):
                _boundary_case(checks, case, pair, group, tokens, parallel.rank, "twoshot rms")
            if case.gpu:
                _graph_case(checks, case, pair, parallel.rank, "twoshot rms")


# finalize -----------------------------------------------------------------------------------------
def _finalize_case(checks, case, pair, group, tokens, with_shared, rank, top_k, label, expect_handoff=True):
    from layer_boundary import MoeFinalizeHandoff, SumGroup

    hidden, dtype, device = pair.norm.hidden_size, pair.norm.weight.dtype, case.torch_device()
    gen = torch.Generator().manual_seed(tokens * 31 + with_shared + 1000 * rank)
    rows = torch.randn(tokens, top_k, hidden, generator=gen).to(device, dtype)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=torch.Generator().manual_seed(tokens)), -1).to(device, dtype)
    shared = torch.randn(tokens, hidden, generator=gen).to(device, dtype) if with_shared else None
    residual, _ = _inputs(case, tokens, hidden, dtype, rank, seed=tokens + 5)
    idx = torch.zeros(tokens, top_k, dtype=torch.long, device=device)
    deferred = []

    def handoff(out):  # what a MoE returns under the exit's flags
        deferred.append(out.defer_moe_finalize)
        made = MoeFinalizeHandoff(rows, weights, idx, shared, group, SumGroup.MOE_OUTPUT)
        return made if out.defer_moe_finalize else made.finalize_local()

    want = MoeFinalizeHandoff(rows, weights, idx, shared, group, SumGroup.MOE_OUTPUT).complete()
    want_normed, want_residual = pair.norm.add_forward(want, residual)
    normed, new_residual = pair.step(handoff, pair.start(residual))
    case.sync()
    facts = {"tokens": tokens, "hidden": hidden, "shared": with_shared, "handed_off": deferred == [True],
             "path": ("kernel" if tokens <= 128 else "torch combine + fused AR") if deferred == [True] else "MoE finalized itself",
             "err_norm": _rel(normed, want_normed), "err_residual": _rel(new_residual, want_residual)}
    same = _same_on_all_ranks(normed, group) and _same_on_all_ranks(new_residual, group)
    ok = facts["handed_off"] is expect_handoff and facts["err_norm"] <= BF16_TOL and facts["err_residual"] <= BF16_TOL and same
    checks.add(f"{label}: fused equals unfused within bf16, ranks identical", ok, **facts)


@on_every_rank
def check_finalize(checks, parallel, case):
    group = _tp(parallel)
    pair = _pair(parallel, case, case.hidden, sparse=True)
    report = _prepare(pair.boundaries, case.max_tokens)
    handoff = bool(report.finalize)
    checks.add("finalize: workspace agreed, the MoE FFN's stage prepared", report.available and len(report.finalize) + len(report.finalize_declined) == 1,
               report=str(report))
    if case.gpu:  # FlashInfer 0.7.2's finalize kernel reads its peers' buffers (a race): declined
        checks.add("finalize: FlashInfer's finalize kernel is not used; the MoE's sum takes the fused all-reduce",
                   not handoff and any("peers' Lamport buffers" in why for _, why in report.finalize_declined))
    if not report.available:
        return
    for tokens in (1, 5, 128, 129, min(300, case.max_tokens)):
        for with_shared in (False, True):
            _finalize_case(checks, case, pair, group, tokens, with_shared, parallel.rank, 8, "finalize", expect_handoff=handoff)


# fallback -----------------------------------------------------------------------------------------
@on_every_rank
def check_fallback(checks, parallel, case):
    """A failure injected on the last rank of the group, at the probe and at the memory preflight."""
    from layer_boundary_flashinfer.service import default_manager

    group = _tp(parallel)
    backend = default_manager().backend
    pair = _pair(parallel, case, case.hidden)
    _prepare(pair.boundaries, case.max_tokens)  # a workspace exists
    injected = group.rank == group.size - 1
    for what, attr, fake in (("probe", "probe", lambda device, g: "injected probe failure"),
                             ("memory preflight", "free_bytes", lambda device: 0)):
        saved = getattr(backend, attr)
        if injected:
            setattr(backend, attr, fake)
        try:
            report = _prepare(pair.boundaries, 4 * case.max_tokens)  # a rebuild
        finally:
            if injected:
                setattr(backend, attr, saved)
        reasons = [g.reason for g in report.groups]
        agreed = not report.available and not any(s.available for s in default_manager().slots.values())
        for tokens in (3, 200):
            residual, partial = _inputs(case, tokens, case.hidden, torch.bfloat16, parallel.rank, seed=tokens + 17)
            want = pair.norm.fused_add_forward(_summed(group, partial), residual)  # what the unfused path runs
            got = pair.step(partial.clone(), pair.start(residual))
            case.sync()
            exact = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            checks.add(f"fallback: a {what} failure on rank {group.size - 1} turns the fusion off on every rank",
                       agreed and exact, tokens=tokens, reasons=reasons, unfused_bitwise=exact)
    report = _prepare(pair.boundaries, case.max_tokens)
    checks.add("fallback: the next prepare without failures creates the workspace again", report.available, report=str(report))


# FlashInfer 0.7.2's defects -----------------------------------------------------------------------
def _raw_finalize(slot, rows, scales, residual, gamma, eps):
    from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

    tokens, k, hidden = rows.shape
    index = torch.arange(tokens * k, dtype=torch.int32, device=rows.device).view(tokens, k)
    norm_out, residual_out = torch.empty_like(residual), torch.empty_like(residual)
    ws = slot.workspace
    get_trtllm_comm_module().trtllm_moe_finalize_allreduce_fusion(
        rows.view(tokens * k, hidden), residual, gamma, index, norm_out, residual_out, None, None, False,
        ws.workspace_tensor, int(ws.rank), int(ws.world_size), eps, None, scales, None, 0.0)
    return norm_out, residual_out


def _raw_all_reduce(slot, dtype, hidden, device):
    from flashinfer.comm.trtllm_ar import AllReduceFusionPattern, get_trtllm_comm_module

    x = torch.ones(1, hidden, dtype=dtype, device=device)
    out = torch.empty_like(x)
    ws = slot.workspace
    get_trtllm_comm_module().trtllm_allreduce_fusion(
        x, int(ws.world_size), int(ws.rank), 1, hidden, ws.workspace_tensor, False, True, True, True,
        int(AllReduceFusionPattern.kAllReduce), out, None, None, None, None, None, None, None, None, None, None, None)
    return out


def _error_of(case, run) -> Optional[str]:
    try:
        run()
        case.sync()
        return None
    except Exception as exc:  # noqa: BLE001 - the finding
        return f"{type(exc).__name__}: {str(exc)[:200]}"


@on_every_rank
def check_defects(checks, parallel, case):
    """The kernel limits the plugin declines, as FlashInfer 0.7.2 shows them on the GPU (a check
    fails once the installed FlashInfer no longer shows one: the plugin's decline can be revisited)."""
    import flashinfer
    from layer_boundary import MoeFinalizeHandoff, SumGroup
    from layer_boundary_flashinfer.service import default_manager

    group, device = _tp(parallel), case.torch_device()
    version = flashinfer.__version__
    # 1. hidden 64 (8 vectors a row): the finalize kernel's spare lanes fold the next token in
    pair = _pair(parallel, case, 64, sparse=True)
    report = _prepare(pair.boundaries, case.max_tokens)
    checks.add("defects: the plugin keeps the finalize of hidden 64 in the MoE",
               report.available and not report.finalize and len(report.finalize_declined) == 1, report=str(report))
    for with_shared in (False, True):
        _finalize_case(checks, case, pair, group, 5, with_shared, parallel.rank, 2, "defects: hidden 64 through the plugin", expect_handoff=False)
    slot = next(s for s in default_manager().slots.values() if s.available and s.dtype == torch.bfloat16)
    gen = torch.Generator().manual_seed(41 + parallel.rank)
    tokens, top_k = 5, 2
    rows = torch.randn(tokens, top_k, 64, generator=gen).to(device, torch.bfloat16)
    scales = torch.full((tokens, top_k), 0.5, dtype=torch.bfloat16, device=device)
    residual = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    gamma = pair.norm.weight.detach()
    normed, _ = _raw_finalize(slot, rows, scales, residual, gamma, pair.norm.eps)
    case.sync()
    want = MoeFinalizeHandoff(rows, scales, None, None, group, SumGroup.MOE_OUTPUT).complete()
    want_normed, _ = pair.norm.add_forward(want, residual)
    per_token = [_rel(normed[t], want_normed[t]) for t in range(tokens)]
    checks.add("defects: FlashInfer's finalize kernel at hidden 64 computes wrong norms (why the plugin declines it)",
               max(per_token[:-1]) > BF16_TOL, flashinfer=version, err_per_token=per_token)
    # 2. no fp32 finalize; 3. fp32 rows above 32768 fail the launch check (both before any launch)
    for label, run in (
        ("the finalize kernel has no float32 variant",
         lambda: _raw_finalize(slot, rows.float(), scales.float(), residual.float(), gamma.float(), 1e-6)),
        ("fp32 rows of 32776 fail the all-reduce kernel's launch check", lambda: _raw_all_reduce(slot, torch.float32, 32776, device)),
    ):
        error = _error_of(case, run)
        checks.add(f"defects: {label} (the plugin declines it)", error is not None, flashinfer=version, error=error)


# fp8 ----------------------------------------------------------------------------------------------
def e4m3_half_step(q: torch.Tensor) -> torch.Tensor:
    """Half the E4M3 spacing at each code's value (in code units): 2^(e - 4) for normal values,
    2^-10 for subnormals (|q| < 2^-6)."""
    mag = q.abs().clamp_min(2.0**-6)
    return torch.exp2(torch.floor(torch.log2(mag)) - 4.0)


def compare_fp8(got, want, exact=None) -> dict:
    """How the fused read's FP8 input relates to the unfused one and to the exact fp32 norm `exact`.

    FlashInfer quantizes the norm after rounding it to the activation dtype (relative 2^-9), with
    its own per-token scale, and sums the ranks in fp32; the core rounds the cross-rank sum to the
    activation dtype and quantizes the fp32 norm. Each quantizer may round to either neighbour of
    its own input, so the contract is: every fused value lies within half an E4M3 step (at its own
    scale) plus two bf16 roundings (the new residual's and the norm's) of the core's fp32 norm;
    the byte agreement with the unfused read is reported beside it."""
    differ = float((got.data.view(torch.uint8) != want.data.view(torch.uint8)).float().mean())
    out = {"bytes_differing": differ}
    if exact is not None:
        q = got.data.to(torch.float32)
        scale = got.scale.float() if got.per_token else got.scale.float().reshape(1, 1)
        bound = e4m3_half_step(q) * scale + exact.abs() * 2.0**-7 + 1e-12
        out["max_err_over_bound"] = float(((q * scale - exact).abs() / bound).max())
    if want.per_token:
        out["scale_rel_diff"] = float(((got.scale.float() - want.scale.float()).abs() / want.scale.float()).max())
    return out


@on_every_rank
def check_fp8_reads(checks, parallel, case):
    """At an FP8-quantizing read: `kARResidualRMSNormFP8Quant` (the read's fixed scale) and
    `kARResidualRMSNormDynamicFP8Quant` (a scale per token) against the core's unfused read."""
    from layer_boundary import PLAIN_ADD
    from layer_boundary.plugin import norm_fp32

    group, device = _tp(parallel), case.torch_device()
    for fmt, scale in (("fp8_dynamic", None), ("fp8_static", 8.0 / 448.0)):
        for gemma in (False, True):
            pair = _pair(parallel, case, case.hidden, gemma=gemma, fp8=(fmt, scale))
            report = _prepare(pair.boundaries, case.max_tokens)
            label = f"fp8 {fmt[4:]}{' gemma' if gemma else ''}"
            checks.add(f"{label}: the quantizing read's fused candidate is bound", report.available and len(report.bound) == 3,
                       report=str(report))
            if not report.available:
                continue
            for tokens in (1, 7, 129, 1000):
                residual = torch.randn(tokens, case.hidden, generator=torch.Generator().manual_seed(tokens)).to(device, torch.bfloat16)
                partial = torch.randn(tokens, case.hidden, generator=torch.Generator().manual_seed(tokens + 100 * (parallel.rank + 1))).to(
                    device, torch.bfloat16)
                summed = group.all_reduce(partial.clone())
                want, want_residual = pair.read.update_and_read(PLAIN_ADD, summed, residual, pair.norm)
                # the norm the core quantizes: of the cross-rank sum (rounded to bf16, as FlashInfer's
                # is too) plus the residual, in fp32
                exact = norm_fp32(pair.norm, summed.float() + residual.float())
                got, got_residual = pair.step(partial.clone(), pair.start(residual))
                case.sync()
                facts = {"tokens": tokens, "fused": type(got).__name__ == "Fp8Input", **compare_fp8(got, want, exact.float()),
                         "residual_rel_err": _rel(got_residual, want_residual)}
                same = _same_on_all_ranks(got.data.view(torch.uint8), group)
                ok = (facts["fused"] and facts["bytes_differing"] <= FP8_BYTES_DIFFERING
                      and facts["max_err_over_bound"] <= 1.0 and facts["residual_rel_err"] <= 2e-2
                      and facts.get("scale_rel_diff", 0.0) <= 2e-2 and same)
                checks.add(f"{label}: fused FP8 read within half an E4M3 step of the exact norm, like the unfused read", ok,
                           ranks_identical=same, **facts)


# models -------------------------------------------------------------------------------------------
def _reset_registry():
    from layer_boundary.plugin import reset_registry

    reset_registry()


_DISABLED = None  # made on first use: LAYER_BOUNDARY_DISABLE_PLUGINS with flashinfer added


def _plugin_disabled():
    """The flashinfer plugin switched off while models are built (ranks that share a process,
    as threaded ranks do, enter together)."""
    global _DISABLED
    if _DISABLED is None:
        current = os.environ.get("LAYER_BOUNDARY_DISABLE_PLUGINS")
        _DISABLED = shared_env("LAYER_BOUNDARY_DISABLE_PLUGINS", ",".join(filter(None, [current, "flashinfer"])),
                               after=_reset_registry)
    return _DISABLED


def _config(case, name):
    from layer_boundary_models import family, model_config

    return model_config(name, dict(family(name).preset(), **case.sizes[name]))


def _build(case, name, parallel, dtype, state):
    from layer_boundary_models import build_model, family
    from layer_boundary.plugin import StateDictSource

    model = build_model(_config(case, name), parallel, dtype=dtype, device=case.torch_device())
    family(name).load_weights(model, StateDictSource(state))
    return model.eval()


@torch.inference_mode()
def _logits(case, model, parallel, prompts, decode_steps):
    from layer_boundary import Forward, ForwardMode
    from layer_boundary.plugin import StepLayout

    device = case.torch_device()
    cache = model.new_cache()
    slots = list(range(len(prompts)))
    step = StepLayout(slots, [len(p) for p in prompts], [0] * len(prompts), device=device)
    out = [model(torch.cat(prompts).to(device), Forward(parallel, step.num_tokens, mode=ForwardMode.EXTEND), step, cache).float()]
    for s, ids in enumerate(decode_steps):
        step = StepLayout(slots, [1] * len(prompts), [len(p) + s for p in prompts], device=device)
        out.append(model(ids.to(device), Forward(parallel, len(prompts), mode=ForwardMode.DECODE), step, cache).float())
    return out


#: rank -> the fused calls recorded on it while `_SHADOW` is installed
_SHADOW_CALLS: dict = {}


def _install_shadow():
    """Every all-reduce + add + RMSNorm launcher bound from now on also recomputes its call
    unfused from copies of its inputs (the group's own all-reduce, then the reference add +
    RMSNorm) and records how far the kernel's result is, per call."""
    from layer_boundary_flashinfer.service import default_manager
    from layer_boundary_flashinfer.testing import reference_add_norm, uncounted

    backend_type = type(default_manager().backend)
    original = backend_type.bind_all_reduce

    def bind_all_reduce(backend, slot, gamma, eps, weight_bias, hidden, limit):
        launch = original(backend, slot, gamma, eps, weight_bias, hidden, limit)
        group = uncounted(slot.group)
        calls = _SHADOW_CALLS.setdefault(group.rank, [])

        def shadowed(x, residual, tokens):
            x_in, residual_in = x.clone(), residual.clone()
            normed, new_residual = launch(x, residual, tokens)
            total = group.all_reduce(x_in.clone())
            want_norm, want_residual = reference_add_norm(total, residual_in, gamma, eps, weight_bias)
            calls.append(dict(tokens=int(tokens), norm_err=_max_rel(normed, want_norm), residual_err=_max_rel(new_residual, want_residual),
                              residual_bitwise=bool(torch.equal(new_residual, want_residual))))
            return normed, new_residual

        return shadowed

    backend_type.bind_all_reduce = bind_all_reduce
    return backend_type, original


_SHADOW = SharedSetting(_install_shadow, lambda saved: setattr(saved[0], "bind_all_reduce", saved[1]))


def _shadow_summary(calls):
    worst = sorted(calls, key=lambda c: -max(c["norm_err"], c["residual_err"]))[:8]
    return dict(calls=len(calls), residual_bitwise_calls=sum(c["residual_bitwise"] for c in calls),
                max_norm_err=max((c["norm_err"] for c in calls), default=0.0),
                max_residual_err=max((c["residual_err"] for c in calls), default=0.0), worst_calls=worst)


@on_every_rank
def check_model(checks, parallel, case, name, shadow=False):
    from layer_boundary import CollectiveCounter, CountingCollectives
    from layer_boundary_models import family

    config = _config(case, name)
    state = family(name).random_weights(config, torch.float32, seed=11)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in (17, 9, 33)]
    decode = [torch.randint(0, config.vocab_size, (len(prompts),), generator=gen) for _ in range(2)]
    counters, logits = {}, {}
    moe = bool(config.sparse_layers)
    # a MoE's routing is discontinuous: in bf16 a near-tie between two experts can flip between any
    # two roundings (fused or not), so its fused path is judged in float32 (plugin on vs off)
    modes = ("on",) if shadow else ("on", "off", "fp32") + (("on_fp32",) if moe else ())
    for mode in modes:
        counter = CollectiveCounter()
        counted = parallel.with_groups(lambda g: CountingCollectives(g, counter))
        dtype = torch.float32 if mode in ("fp32", "on_fp32") else torch.bfloat16
        plugin_on = mode in ("on", "on_fp32")
        _tp(parallel).agree(True)  # every rank builds with the same registry (ranks may share a process)
        with (_plugin_disabled() if not plugin_on else contextlib.nullcontext()):
            model = _build(case, name, counted, dtype, state)
        _tp(parallel).agree(True)
        with (_SHADOW if shadow else contextlib.nullcontext()):
            calls = _SHADOW_CALLS[_tp(parallel).rank] = []
            if plugin_on:
                report = _prepare(model, case.max_tokens)
                what = "float32 workspace" if mode == "on_fp32" else "workspace"
                checks.add(f"{name}: {what} agreed and candidates bound", report.available, report=str(report))
            counter.reset()
            logits[mode] = _logits(case, model, counted, prompts, decode)
            counters[mode] = counter.snapshot()
        del model
        case.empty_cache()
    if shadow:
        # one bf16 rounding apart at most: the kernel and the unfused read round the same sum
        summary = _shadow_summary(calls)
        checks.add(f"{name}: every fused call within one bf16 rounding of the unfused read (shadowed)",
                   summary["calls"] > 0 and summary["max_residual_err"] <= 2 ** -7 and summary["max_norm_err"] <= 2 ** -6, **summary)
        return
    on_off = [_max_rel(a, b) for a, b in zip(logits["on"], logits["off"])]
    on_ref = [_rel(a, b) for a, b in zip(logits["on"], logits["fp32"])]
    off_ref = [_rel(a, b) for a, b in zip(logits["off"], logits["fp32"])]
    top1 = [float((a.argmax(-1) == b.argmax(-1)).float().mean()) for a, b in zip(logits["on"], logits["off"])]
    same = all(_same_on_all_ranks(t.to(case.torch_device()), _tp(parallel)) for t in logits["on"])
    facts = dict(err_on_vs_off=on_off, err_on_vs_fp32=on_ref, err_off_vs_fp32=off_ref, top1_agreement=top1, ranks_identical=same)
    tp = parallel.topology.tp
    if not moe:
        # equal within bf16 (as `layer-boundary run` checks logits), and no further from float32 than unfused bf16 is
        ok = max(on_off) <= BF16_LOGITS_TOL and all(a <= 1.25 * b + 1e-3 for a, b in zip(on_ref, off_ref))
        checks.add(f"{name}: TP={tp} bf16 logits equal with the plugin on and off", ok and same, **facts)
    else:
        # bf16: reported (how many tokens a routing flip moved), not judged token by token
        tokens_off = [float(((a - b).abs().amax(-1) > BF16_LOGITS_TOL * b.abs().amax()).float().mean())
                      for a, b in zip(logits["on"], logits["off"])]
        checks.add(f"{name}: TP={tp} bf16 logits with the plugin on and off (routing flips reported)", same,
                   share_of_tokens_beyond_bf16_tolerance=tokens_off, **facts)
        fp32_on_off = [_max_rel(a, b) for a, b in zip(logits["on_fp32"], logits["fp32"])]
        same32 = all(_same_on_all_ranks(t.to(case.torch_device()), _tp(parallel)) for t in logits["on_fp32"])
        checks.add(f"{name}: TP={tp} float32 logits equal with the plugin on and off",
                   max(fp32_on_off) <= FP32_LOGITS_TOL and same32, err_on_vs_off=fp32_on_off, ranks_identical=same32)
    ar_on = sum(n for k, n in counters["on"].items() if k.startswith("all_reduce"))
    ar_off = sum(n for k, n in counters["off"].items() if k.startswith("all_reduce"))
    checks.add(f"{name}: the fusion replaced the boundary all-reduces", ar_on < ar_off, collectives_on=counters["on"],
               collectives_off=counters["off"])


# graph decode -------------------------------------------------------------------------------------
@on_every_rank
def check_graph_decode(checks, parallel, case, name):
    """The whole decode step of `name` in one graph: fused boundaries, every other sum on the
    workspace (the model is built on `flashinfer_collectives`)."""
    from layer_boundary_models import family
    from layer_boundary.cli.static_decode import static_decode_step, static_prefill
    from layer_boundary_flashinfer.collectives import flashinfer_collectives, wrapped_flashinfer_collectives

    device = case.torch_device()
    config = _config(case, name)
    state = family(name).random_weights(config, torch.float32, seed=11)
    fi_parallel = flashinfer_collectives(parallel)
    model = _build(case, name, fi_parallel, torch.bfloat16, state)
    report = _prepare(model, case.max_tokens)  # before capture
    checks.add(f"graph decode {name}: fused boundaries and the all-reduce collectives bound",
               report.available and bool(report.collectives), report=str(report))
    if not (report.available and report.collectives):
        return
    wrappers = wrapped_flashinfer_collectives(fi_parallel.groups.values())
    batch, prompt_len, steps = 8, 12, 3
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (prompt_len,), generator=gen) for _ in range(batch)]
    decode = [torch.randint(0, config.vocab_size, (batch,), generator=gen).to(device) for _ in range(steps)]
    with torch.inference_mode():
        cache = model.new_static_cache(batch, prompt_len + steps + 4)
        slots = torch.arange(batch, device=device)
        static_prefill(model, fi_parallel, cache, prompts, device)
        snap = cache.snapshot()
        static_ids = decode[0].clone()
        static_pos = torch.full((batch,), prompt_len, dtype=torch.long, device=device)
        graph, out = _capture(case, lambda: static_decode_step(model, fi_parallel, cache, static_ids, slots, static_pos))
        calls_before = sum(w.kernel_calls for w in wrappers)
        ok, diffs = True, []
        for s in range(steps):  # each step: eager from the snapshot, then the replay from the same snapshot
            pos = torch.full((batch,), prompt_len + s, dtype=torch.long, device=device)
            cache.restore(snap)
            eager = static_decode_step(model, fi_parallel, cache, decode[s], slots, pos).clone()
            cache.restore(snap)
            static_ids.copy_(decode[s])
            static_pos.copy_(pos)
            graph.replay()
            case.sync()
            ok = ok and torch.equal(eager, out)
            diffs.append(float((eager.float() - out.float()).abs().max()))
            snap = cache.snapshot()
        eager_calls = sum(w.kernel_calls for w in wrappers) - calls_before
    same = _same_on_all_ranks(out.float(), _tp(parallel))
    checks.add(f"graph decode {name}: the whole TP={parallel.topology.tp} decode step replays what eager computes",
               ok and same and eager_calls > 0, max_abs_diff=diffs, ranks_identical=same,
               workspace_all_reduces_per_eager_step=eager_calls / steps)
    graph.reset()
    _graphs_dropped()
