"""The multi-rank GPU check of the flashinfer plugin (run it before the benchmark):

    python -m layer_boundary_flashinfer.gpu_check --out DIR [--ranks 2] [--only STEP ...]

Ranks are placed on the visible GPUs (`layer_boundary.place_ranks`): one GPU a rank over NCCL,
or several ranks sharing a GPU over gloo (the trtllm workspaces map peer memory inside the
device). The shared world checks correctness only; it is slow (the ranks' spin-waiting kernels
time-slice), so the steps keep their fused launches to tens or hundreds.

Steps (`--only` picks some):
- memory: a workspace takes what `workspace_bytes` says (as CUDA reports it) and gives it back;
- boundary: fused all-reduce + add + RMSNorm (and Gemma's (1 + w)) against the unfused path and
  float64, token counts across the one-shot/two-shot switch and up to the limit (+1 falls back,
  bitwise); every rank identical; a CUDA graph of fused boundaries replays what eager computes;
- twoshot: the same with two-shot forced wherever FlashInfer allows it (tokens > ranks);
- finalize: a MoE finalize handoff through the kernel (<= 128 tokens) and the torch combine +
  fused all-reduce (> 128);
- fallback: one rank failing its probe or its memory preflight turns the fusion off on every
  rank, and the boundary computes what the unfused path computes, bitwise;
- defects: FlashInfer 0.7.2 kernel limits confirmed on the GPU (the finalize kernel's spare warp
  lanes, its missing fp32 variant, fp32 rows above 32768) and the plugin declining them;
- fp8: the fused all-reduce + add + RMSNorm + FP8 quantization against the unfused quantizing read;
- models: qwen3, gemma, qwen3_moe at TP=N in bf16, logits with the plugin on and off (and against
  float32), and the all-reduces the fusion removed;
- graph decode: a whole decode step (qwen3 and qwen3_moe) captured in one CUDA graph with fused
  boundaries and every remaining sum on FlashInfer's all-reduce (`flashinfer_collectives`);
  replay equals eager.

Writes DIR/gpu_check.json (with the placement: ranks, GPUs, shared), prints PASS/FAIL per check,
exits non-zero on any failure. A step that takes longer than `--watchdog` seconds dumps every
rank's Python stack (a hang shows where it waits).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

#: the largest relative error allowed between two bf16 paths of one boundary (the contract's)
BF16_TOL = 2e-2
#: bf16 logits: max |difference| / max |reference|, the tolerance `layer-boundary run` checks with
BF16_LOGITS_TOL = 3e-2
#: float32 logits, the same measure (`layer-boundary run`'s float32 tolerance)
FP32_LOGITS_TOL = 1e-4
#: memory CUDA may report beyond the workspace formula per rank (pointer tables, allocator blocks)
MEMORY_SLACK = 8 << 20

MODEL_SIZES = {
    "qwen3": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4, "num_attention_heads": 16,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 8192},
    "gemma": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 8192},
    "qwen3_moe": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4, "num_attention_heads": 16,
                  "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 8192, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 768, "mlp_only_layers": [3]},
}
STEPS = ("memory", "boundary", "twoshot", "finalize", "fallback", "defects", "fp8", "models", "graph decode")


class Checks:
    def __init__(self, rank: int):
        self.rank, self.items, self.step = rank, [], ""

    def add(self, name: str, ok: bool, **facts) -> None:
        self.items.append({"step": self.step, "check": name, "ok": bool(ok), **facts})
        if self.rank == 0:
            print(f"{'PASS' if ok else 'FAIL'} {name} {json.dumps(facts, default=str)}", flush=True)


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


def _inputs(tokens, hidden, dtype, rank, seed):
    shared = torch.Generator().manual_seed(seed)
    mine = torch.Generator().manual_seed(seed + 7919 * (rank + 1))
    residual = torch.randn(tokens, hidden, generator=shared).to(_device(), dtype)
    partial = torch.randn(tokens, hidden, generator=mine).to(_device(), dtype)
    return residual, partial


#: where the check's tensors live: the rank's GPU ("cpu" only for the CPU test of the check's logic)
DEVICE = "cuda"


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device(DEVICE)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _empty_cache():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _pairs(parallel, hidden, dtype=torch.bfloat16, **kinds):
    from .bench import BoundaryPair

    return BoundaryPair(parallel, hidden, dtype, _device(), **kinds)


# boundary -------------------------------------------------------------------------------------
def _boundary_case(checks, pair, group, tokens, rank, limit, label):
    hidden, dtype = pair.norm.hidden_size, pair.norm.weight.dtype
    residual, partial = _inputs(tokens, hidden, dtype, rank, seed=tokens)
    # the core's unfused path: the sum, then the add + norm the norm runs (a plugin's local kernel
    # where one accepts, else torch)
    want_normed, want_residual = pair.norm.fused_add_forward(_summed(group, partial), residual)
    ref_normed, ref_residual = _reference64(_summed(group, partial.double()), residual, pair.norm)
    fwd = pair.start(residual)
    normed, new_residual = pair.step(partial.clone(), fwd)
    _sync()
    facts = {"tokens": tokens, "err_vs_unfused": _rel(normed, want_normed), "err_vs_fp64": _rel(normed, ref_normed),
             "unfused_err_vs_fp64": _rel(want_normed, ref_normed), "residual_err_vs_fp64": _rel(new_residual, ref_residual),
             "residual_bitwise_unfused": bool(torch.equal(new_residual, want_residual))}
    same = _same_on_all_ranks(normed, group) and _same_on_all_ranks(new_residual, group)
    if tokens > limit:  # above the limit the candidate declines: the core's unfused path, bitwise
        ok = torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)
        checks.add(f"{label}: above the limit the unfused path runs", ok and same, **facts)
        return
    ok = facts["err_vs_unfused"] <= BF16_TOL and facts["err_vs_fp64"] <= max(2 * facts["unfused_err_vs_fp64"], 1e-3)
    ok = ok and facts["residual_err_vs_fp64"] <= BF16_TOL
    checks.add(f"{label}: fused equals unfused within bf16, ranks identical", ok and same, ranks_identical=same, **facts)


def _graph_case(checks, pair, rank, label):
    """A CUDA graph of a stack entry and three fused boundaries replays what eager computes."""
    if DEVICE != "cuda":
        return
    tokens, hidden, dtype = 7, pair.norm.hidden_size, pair.norm.weight.dtype
    residual, partial = _inputs(tokens, hidden, dtype, rank, seed=99)
    static = partial.clone()

    def entry_and_three_boundaries():
        fwd = pair.start(residual)
        return [pair.step(static, fwd) for _ in range(3)]

    graph, outs = _capture(entry_and_three_boundaries, warmup=1)
    ok = True
    for seed in (123, 124):  # new inputs each replay: the Lamport buffers rotate
        static.copy_(_inputs(tokens, hidden, dtype, rank, seed=seed)[1])
        graph.replay()
        _sync()
        replayed = [(a.clone(), b.clone()) for a, b in outs]
        eager = entry_and_three_boundaries()
        ok = ok and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(replayed, eager))
    checks.add(f"{label}: CUDA-graph replay equals eager", ok, tokens=tokens)
    _rebuild_refused(checks, pair, label, graph, outs, entry_and_three_boundaries)
    del graph
    _graphs_dropped()


def _rebuild_refused(checks, pair, label, graph, outs, eager_fn):
    """A prepare that would rebuild the workspace under the captured graph raises on every rank
    and keeps the workspace: the graph still replays what eager computes."""
    from .service import default_manager, prepare_flashinfer_fusion
    from .workspace import WorkspaceCapturedError

    plan = pair.attn1.plan  # the input whose fused candidate the graph captured
    group = plan.group(plan.description.incoming_sum)
    slot = default_manager().slots.get((tuple(group.ranks), plan.norm.weight.dtype, group.rank))
    if slot is None or not slot.available:
        checks.add(f"{label}: a rebuild under the captured graph is refused", False, error="no workspace for the pair")
        return
    captured = slot.captured
    refused, error = False, ""
    try:
        prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=4 * slot.spec.max_tokens)
    except WorkspaceCapturedError as exc:
        refused, error = True, str(exc)
    kept = slot.available
    graph.replay()
    _sync()
    replayed = [(a.clone(), b.clone()) for a, b in outs]
    eager = eager_fn()
    still = all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(replayed, eager))
    checks.add(f"{label}: a rebuild under the captured graph is refused, the graph still replays", captured and refused and kept and still,
               launch_seen_captured=captured, refused=refused, workspace_kept=kept, replay_equals_eager=still, error=error[:200])


def _graphs_dropped():
    """The check's graphs are gone: later prepares may rebuild the workspaces they were captured on."""
    from .service import default_manager

    default_manager().graphs_dropped()


def _token_counts(args, world):
    counts = (1, 2, world, world + 1, 64, 127, 128, 129, 511, 1000, args.max_tokens, args.max_tokens + 1)
    return sorted(set(t for t in counts if t > 0))


def check_boundary(checks, parallel, rank, args):
    from .service import prepare_flashinfer_fusion

    group = _tp(parallel)
    pairs = {gemma: _pairs(parallel, args.hidden, gemma=gemma) for gemma in (False, True)}
    if rank == 0:
        print("preparing the workspace (a cold machine JIT-builds FlashInfer's trtllm_comm first: minutes)", flush=True)
    report = prepare_flashinfer_fusion([b for p in pairs.values() for b in p.boundaries], max_tokens=args.max_tokens)
    checks.add("boundary: workspace agreed and candidates bound", report.available and len(report.bound) == 6, report=str(report))
    if not report.available:
        return
    from .backend import oneshot_table

    if DEVICE == "cuda":  # how slow this world is (ranks sharing a GPU time-slice their spinning kernels)
        pair = pairs[False]
        residual, partial = _inputs(1, args.hidden, torch.bfloat16, rank, seed=1)
        fwd = pair.start(residual)
        for calls in (1, 10):
            _sync()
            group.agree(True)
            t0 = time.perf_counter()
            for _ in range(calls):
                pair.step(partial, fwd)
            _sync()
            per_call = (time.perf_counter() - t0) / calls
        if rank == 0:
            print(f"  (one fused boundary, 1 token, eager: {per_call * 1e3:.2f} ms in this world)", file=sys.stderr, flush=True)
        gloo_t0 = time.perf_counter()
        _summed(group, torch.ones(2048, args.hidden, device=_device(), dtype=torch.bfloat16))
        _sync()
        checks.add("boundary: this world's speed (not a measurement of the kernels)", True, fused_call_ms=per_call * 1e3,
                   group_all_reduce_2048_rows_ms=(time.perf_counter() - gloo_t0) * 1e3)
    table = oneshot_table(args.max_tokens, args.hidden, torch.bfloat16, group.size)
    checks.add("boundary: the token counts cover the algorithms auto picks", True,
               two_shot_from=next((t for t in range(1, args.max_tokens + 1) if not table[t]), None))
    for gemma, pair in pairs.items():
        kind = "gemma" if gemma else "rms"
        counts = _token_counts(args, group.size) if not gemma else (1, 3, 129, args.max_tokens)
        for tokens in counts:
            _boundary_case(checks, pair, group, tokens, rank, args.max_tokens, f"boundary {kind}")
        _graph_case(checks, pair, rank, f"boundary {kind}")


def check_twoshot(checks, parallel, rank, args):
    """Two-shot forced (LAYER_BOUNDARY_FLASHINFER_ALGORITHM=twoshot, set on every rank alike)."""
    from .eligibility import ONESHOT_ENV
    from .service import prepare_flashinfer_fusion

    group = _tp(parallel)
    pair = _pairs(parallel, args.hidden)
    saved = os.environ.get(ONESHOT_ENV)
    os.environ[ONESHOT_ENV] = "twoshot"
    try:
        report = prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=args.max_tokens)
        checks.add("twoshot: workspace agreed with two-shot forced", report.available, report=str(report))
        if report.available:
            for tokens in (group.size, group.size + 1, 64, 129, 1000, args.max_tokens):
                _boundary_case(checks, pair, group, tokens, rank, args.max_tokens, "twoshot rms")
            _graph_case(checks, pair, rank, "twoshot rms")
    finally:
        if saved is None:
            os.environ.pop(ONESHOT_ENV, None)
        else:
            os.environ[ONESHOT_ENV] = saved
        prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=args.max_tokens)  # rebinds with the default


# finalize -------------------------------------------------------------------------------------
def _finalize_case(checks, pair, group, tokens, with_shared, rank, top_k, label, expect_handoff=True):
    from layer_boundary import MoeFinalizeHandoff, SumGroup

    hidden, dtype = pair.norm.hidden_size, pair.norm.weight.dtype
    gen = torch.Generator().manual_seed(tokens * 31 + with_shared + 1000 * rank)
    rows = torch.randn(tokens, top_k, hidden, generator=gen).to(_device(), dtype)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=torch.Generator().manual_seed(tokens)), -1).to(_device(), dtype)
    shared = torch.randn(tokens, hidden, generator=gen).to(_device(), dtype) if with_shared else None
    residual, _ = _inputs(tokens, hidden, dtype, rank, seed=tokens + 5)
    idx = torch.zeros(tokens, top_k, dtype=torch.long, device=_device())
    deferred = []

    def handoff(out):  # what a MoE returns under the exit's flags
        deferred.append(out.defer_moe_finalize)
        made = MoeFinalizeHandoff(rows, weights, idx, shared, group, SumGroup.MOE_OUTPUT)
        return made if out.defer_moe_finalize else made.finalize_local()

    want = MoeFinalizeHandoff(rows, weights, idx, shared, group, SumGroup.MOE_OUTPUT).complete()
    want_normed, want_residual = pair.norm.add_forward(want, residual)
    fwd = pair.start(residual)
    normed, new_residual = pair.step(handoff, fwd)
    _sync()
    facts = {"tokens": tokens, "hidden": hidden, "shared": with_shared, "handed_off": deferred == [True],
             "path": ("kernel" if tokens <= 128 else "torch combine + fused AR") if deferred == [True] else "MoE finalized itself",
             "err_norm": _rel(normed, want_normed), "err_residual": _rel(new_residual, want_residual)}
    same = _same_on_all_ranks(normed, group) and _same_on_all_ranks(new_residual, group)
    ok = facts["handed_off"] is expect_handoff and facts["err_norm"] <= BF16_TOL and facts["err_residual"] <= BF16_TOL and same
    checks.add(f"{label}: fused equals unfused within bf16, ranks identical", ok, **facts)


def check_finalize(checks, parallel, rank, args):
    from .service import prepare_flashinfer_fusion

    group = _tp(parallel)
    pair = _pairs(parallel, args.hidden, sparse=True)
    report = prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=args.max_tokens)
    handoff = bool(report.finalize)
    checks.add("finalize: workspace agreed, the MoE FFN's stage prepared", report.available and len(report.finalize) + len(report.finalize_declined) == 1,
               report=str(report))
    if DEVICE == "cuda":  # FlashInfer 0.7.2's finalize kernel reads its peers' buffers (a race): declined
        checks.add("finalize: FlashInfer's finalize kernel is not used; the MoE's sum takes the fused all-reduce",
                   not handoff and any("peers' Lamport buffers" in why for _, why in report.finalize_declined))
    if not report.available:
        return
    for tokens in (1, 5, 128, 129, min(300, args.max_tokens)):
        for with_shared in (False, True):
            _finalize_case(checks, pair, group, tokens, with_shared, rank, 8, "finalize", expect_handoff=handoff)


# memory and fallback ------------------------------------------------------------------------------
def _free_on_device(group) -> int:
    """Free device memory once every rank has finished its work (CUDA reports it per device)."""
    _sync()
    group.agree(True)
    free = torch.cuda.mem_get_info()[0]
    group.agree(True)
    return free


def check_memory(checks, parallel, rank, args):
    """Run first, before any workspace exists: the formula against CUDA, and release gives it back."""
    from .backend import workspace_bytes
    from .ranks import world_placement
    from .service import default_manager, prepare_flashinfer_fusion, shutdown_flashinfer_fusion
    from .workspace import WorkspaceSpec

    group = _tp(parallel)
    placement = world_placement()
    sharing = placement.ranks // placement.devices_used if placement is not None and placement.shared else 1
    hidden, tokens = 8192, 2048
    pair = _pairs(parallel, hidden)
    _empty_cache()
    before = _free_on_device(group)
    t0 = time.perf_counter()
    report = prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=tokens)
    created_s = time.perf_counter() - t0
    after = _free_on_device(group)
    expected = workspace_bytes(WorkspaceSpec(tokens, hidden, torch.bfloat16), group.size)
    taken = (before - after) / sharing
    checks.add("memory: the workspace takes what workspace_bytes says, as CUDA reports it",
               report.available and expected <= taken <= expected + MEMORY_SLACK,
               expected_mib=expected / 2**20, measured_mib_per_rank=taken / 2**20, ranks_per_gpu=sharing, create_s=created_s)
    t0 = time.perf_counter()
    shutdown_flashinfer_fusion()
    released_s = time.perf_counter() - t0
    del pair
    _empty_cache()
    back = _free_on_device(group)
    left = (before - back) / sharing
    checks.add("memory: release returns the workspace (no mapping or flag buffer kept) without a hang",
               left <= MEMORY_SLACK and not any(s.available for s in default_manager().slots.values()),
               kept_mib_per_rank=left / 2**20, release_s=released_s)


def check_fallback(checks, parallel, rank, args):
    """A failure injected on the last rank of the group, at the probe and at the memory preflight."""
    from .service import default_manager, prepare_flashinfer_fusion

    group = _tp(parallel)
    backend = default_manager().backend
    pair = _pairs(parallel, args.hidden)
    prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=args.max_tokens)  # a workspace exists
    injected = group.rank == group.size - 1
    for what, attr, fake in (("probe", "probe", lambda device, g: "injected probe failure"),
                             ("memory preflight", "free_bytes", lambda device: 0)):
        saved = getattr(backend, attr)
        if injected:
            setattr(backend, attr, fake)
        try:
            report = prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=4 * args.max_tokens)  # a rebuild
        finally:
            if injected:
                setattr(backend, attr, saved)
        reasons = [g.reason for g in report.groups]
        agreed = not report.available and not any(s.available for s in default_manager().slots.values())
        for tokens in (3, 200):
            residual, partial = _inputs(tokens, args.hidden, torch.bfloat16, rank, seed=tokens + 17)
            want = pair.norm.fused_add_forward(_summed(group, partial), residual)  # what the unfused path runs
            fwd = pair.start(residual)
            got = pair.step(partial.clone(), fwd)
            _sync()
            exact = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            checks.add(f"fallback: a {what} failure on rank {group.size - 1} turns the fusion off on every rank",
                       agreed and exact, tokens=tokens, reasons=reasons, unfused_bitwise=exact)
    report = prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=args.max_tokens)
    checks.add("fallback: the next prepare without failures creates the workspace again", report.available, report=str(report))


# defects of FlashInfer 0.7.2 ---------------------------------------------------------------------
def _raw_finalize(slot, rows, scales, residual, gamma, eps):
    from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

    tokens, k, hidden = rows.shape
    index = torch.arange(tokens * k, dtype=torch.int32, device=_device()).view(tokens, k)
    norm_out, residual_out = torch.empty_like(residual), torch.empty_like(residual)
    ws = slot.workspace
    get_trtllm_comm_module().trtllm_moe_finalize_allreduce_fusion(
        rows.view(tokens * k, hidden), residual, gamma, index, norm_out, residual_out, None, None, False,
        ws.workspace_tensor, int(ws.rank), int(ws.world_size), eps, None, scales, None, 0.0)
    return norm_out, residual_out


def check_defects(checks, parallel, rank, args):
    from layer_boundary import MoeFinalizeHandoff, SumGroup

    from .service import default_manager, prepare_flashinfer_fusion

    group = _tp(parallel)
    # 1. hidden 64 (8 vectors a row): the finalize kernel's spare lanes fold the next token in
    pair = _pairs(parallel, 64, sparse=True)
    report = prepare_flashinfer_fusion(list(pair.boundaries), max_tokens=args.max_tokens)
    checks.add("defects: the plugin keeps the finalize of hidden 64 in the MoE",
               report.available and not report.finalize and len(report.finalize_declined) == 1, report=str(report))
    for with_shared in (False, True):
        _finalize_case(checks, pair, group, 5, with_shared, rank, 2, "defects: hidden 64 through the plugin", expect_handoff=False)
    slot = next(s for s in default_manager().slots.values() if s.available and s.dtype == torch.bfloat16)
    gen = torch.Generator().manual_seed(41 + rank)
    tokens, top_k = 5, 2
    rows = torch.randn(tokens, top_k, 64, generator=gen).to(_device(), torch.bfloat16)
    scales = torch.full((tokens, top_k), 0.5, dtype=torch.bfloat16, device=_device())
    residual = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3)).to(_device(), torch.bfloat16)
    gamma = pair.norm.weight.detach()
    normed, _ = _raw_finalize(slot, rows, scales, residual, gamma, pair.norm.eps)
    _sync()
    want = MoeFinalizeHandoff(rows, scales, None, None, group, SumGroup.MOE_OUTPUT).complete()
    want_normed, _ = pair.norm.add_forward(want, residual)
    per_token = [_rel(normed[t], want_normed[t]) for t in range(tokens)]
    checks.add("defects: FlashInfer's finalize kernel at hidden 64 computes wrong norms (why the plugin declines it)",
               True, reproduces=max(per_token[:-1]) > BF16_TOL, err_per_token=per_token)
    # 2. no fp32 finalize; 3. fp32 rows above 32768 fail the launch check (both before any launch)
    for label, run in (
        ("the finalize kernel has no float32 variant",
         lambda: _raw_finalize(slot, rows.float(), scales.float(), residual.float(), gamma.float(), 1e-6)),
        ("fp32 rows of 32776 fail the all-reduce kernel's launch check", lambda: _raw_all_reduce(slot, torch.float32, 32776)),
    ):
        try:
            run()
            _sync()
            error = None
        except Exception as exc:  # noqa: BLE001 - the finding
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
        checks.add(f"defects: {label} (the plugin declines it)", True, reproduces=error is not None, error=error)


def _raw_all_reduce(slot, dtype, hidden):
    from flashinfer.comm.trtllm_ar import AllReduceFusionPattern, get_trtllm_comm_module

    x = torch.ones(1, hidden, dtype=dtype, device=_device())
    out = torch.empty_like(x)
    ws = slot.workspace
    get_trtllm_comm_module().trtllm_allreduce_fusion(
        x, int(ws.world_size), int(ws.rank), 1, hidden, ws.workspace_tensor, False, True, True, True,
        int(AllReduceFusionPattern.kAllReduce), out, None, None, None, None, None, None, None, None, None, None, None)
    return out


# fp8 ------------------------------------------------------------------------------------------
def check_fp8(checks, parallel, rank, args):
    from .fp8_check import check_fp8_reads

    check_fp8_reads(checks, parallel, rank, args)


# models -------------------------------------------------------------------------------------------
def _reset_registry():
    from layer_boundary.plugin import reset_registry

    reset_registry()


def _plugin_disabled():
    """The flashinfer plugin switched off while models are built (ranks that share a process,
    as in the CPU test of this check, enter together)."""
    global _DISABLED
    if _DISABLED is None:
        from layer_boundary.testing.shared import shared_env

        current = os.environ.get("LAYER_BOUNDARY_DISABLE_PLUGINS")
        _DISABLED = shared_env("LAYER_BOUNDARY_DISABLE_PLUGINS", ",".join(filter(None, [current, "flashinfer"])),
                               after=_reset_registry)
    return _DISABLED


_DISABLED = None  # made on first use: LAYER_BOUNDARY_DISABLE_PLUGINS with flashinfer added


def _sizes(name):
    """The check's model sizes, or the embedded preset's (hidden 64) with --model-sizes preset."""
    return {} if MODEL_SIZES_CHOICE == "preset" else MODEL_SIZES[name]


#: "check" (MODEL_SIZES) or "preset" (the models' embedded tiny configs, as `layer-boundary run` uses)
MODEL_SIZES_CHOICE = "check"


def _trace_stages(model, rank):
    """Print (host side, as each stage's compute is enqueued) where the forward is: a hang shows
    at which stage the ranks stop. On with LAYER_BOUNDARY_CHECK_TRACE=1."""
    if os.environ.get("LAYER_BOUNDARY_CHECK_TRACE") != "1":
        return
    for name, module in model.named_modules():
        if name.endswith((".self_attn", ".mlp", ".moe", ".feed_forward")) or type(module).__name__ in ("TPMoE",):
            module.register_forward_pre_hook(
                lambda m, a, name=name: print(f"    [rank {rank}] enter {name} rows {getattr(a[0], 'shape', ['?'])[0]}",
                                              file=sys.stderr, flush=True))


def _watch_lamport_flags(rank, after_s: float = 15.0):
    """Once `after_s` seconds pass, print every workspace's five control flags (Lamport counter,
    two-shot flag, Lamport buffer index, buffer size, clear size), read through a non-blocking
    stream so that a kernel stuck on the GPU does not block the read. Ranks whose buffer index
    differs have launched a different number of Lamport kernels. On with LAYER_BOUNDARY_CHECK_TRACE=1."""
    if os.environ.get("LAYER_BOUNDARY_CHECK_TRACE") != "1":
        return

    def dump():
        time.sleep(after_s)
        try:
            import ctypes

            import cupy
            import numpy as np

            from .service import default_manager

            stream = cupy.cuda.Stream(non_blocking=True)
            for key, slot in default_manager().slots.items():
                if not slot.available:
                    continue
                table = slot.workspace.workspace_tensor
                flag_ptr = int(table[-1].item()) if table.device.type == "cpu" else slot_flag_ptrs.get(key)
                if not flag_ptr:
                    continue
                host = np.zeros(5, dtype=np.int32)
                cupy.cuda.runtime.memcpyAsync(host.ctypes.data_as(ctypes.c_void_p).value, flag_ptr, 20, 2, stream.ptr)
                stream.synchronize()
                print(f"    [rank {rank}] workspace {key[0]} {key[1]}: lamport flags {host.tolist()}", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - a diagnostic
            print(f"    [rank {rank}] could not read the Lamport flags: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    slot_flag_ptrs = {}
    from .service import default_manager

    for key, slot in default_manager().slots.items():  # read the pointers now, while the stream is free
        if slot.available:
            slot_flag_ptrs[key] = int(slot.workspace.workspace_tensor[-1].item())
    threading.Thread(target=dump, daemon=True).start()


def _build(name, parallel, dtype, state):
    from layer_boundary.models import build_model, family, model_config
    from layer_boundary.models.weights import StateDictSource

    config = model_config(name, dict(family(name).preset, **_sizes(name)))
    model = build_model(config, parallel, dtype=dtype, device=_device())
    family(name).load_weights(model, StateDictSource(state))
    return config, model.eval()


@torch.inference_mode()
def _logits(model, parallel, prompts, decode_steps):
    from layer_boundary import Forward, ForwardMode
    from layer_boundary.models.attention import StepLayout

    cache = model.new_cache()
    slots = list(range(len(prompts)))
    step = StepLayout(slots, [len(p) for p in prompts], [0] * len(prompts), device=_device())
    out = [model(torch.cat(prompts).to(_device()), Forward(parallel, step.num_tokens, mode=ForwardMode.EXTEND), step, cache).float()]
    for s, ids in enumerate(decode_steps):
        step = StepLayout(slots, [1] * len(prompts), [len(p) + s for p in prompts], device=_device())
        out.append(model(ids.to(_device()), Forward(parallel, len(prompts), mode=ForwardMode.DECODE), step, cache).float())
    return out


class _Shadow:
    """Each fused all-reduce + add + RMSNorm of a model run, recomputed from copies of its inputs
    (the group's own all-reduce, then the core's add + RMSNorm): how far every single kernel call
    is from the unfused result, per call. It tells a kernel that rounds differently on some calls
    from logits that merely moved through a MoE routing flip (issue 20's qwen3_moe in bf16)."""

    def __init__(self, group):
        self.group, self.calls = group, []

    def install(self):
        from .backend import FlashInferBackend
        from .testing import reference_add_norm, uncounted

        original, shadow = FlashInferBackend.bind_all_reduce, self

        def bind_all_reduce(backend, slot, gamma, eps, weight_bias, hidden, limit):
            launch = original(backend, slot, gamma, eps, weight_bias, hidden, limit)

            def shadowed(x, residual, tokens):
                x_in, residual_in = x.clone(), residual.clone()
                normed, new_residual = launch(x, residual, tokens)
                total = uncounted(shadow.group).all_reduce(x_in.clone())
                want_norm, want_residual = reference_add_norm(total, residual_in, gamma, eps, weight_bias)
                step = max(float(want_residual.abs().max()), 1e-30)
                shadow.calls.append(dict(
                    call=len(shadow.calls), tokens=int(tokens),
                    norm_err=_max_rel(normed, want_norm), residual_err=_max_rel(new_residual, want_residual),
                    residual_bitwise=bool(torch.equal(new_residual, want_residual)),
                    partial_negative_zeros=int(((x_in == 0) & torch.signbit(x_in)).sum()),
                    partial_absmax=float(x_in.abs().max()) if x_in.numel() else 0.0, residual_absmax=step))
                return normed, new_residual

            return shadowed

        FlashInferBackend.bind_all_reduce = bind_all_reduce
        return lambda: setattr(FlashInferBackend, "bind_all_reduce", original)

    def summary(self):
        worst = sorted(self.calls, key=lambda c: -max(c["norm_err"], c["residual_err"]))[:8]
        return dict(calls=len(self.calls), residual_bitwise_calls=sum(c["residual_bitwise"] for c in self.calls),
                    max_norm_err=max((c["norm_err"] for c in self.calls), default=0.0),
                    max_residual_err=max((c["residual_err"] for c in self.calls), default=0.0), worst_calls=worst)


def check_model(checks, parallel, rank, name, args):
    from layer_boundary import CollectiveCounter, CountingCollectives
    from layer_boundary.models import family, model_config

    from .service import prepare_flashinfer_fusion

    config = model_config(name, dict(family(name).preset, **_sizes(name)))
    state = family(name).random_weights(config, torch.float32, seed=11)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in (17, 9, 33)]
    decode = [torch.randint(0, config.vocab_size, (len(prompts),), generator=gen) for _ in range(2)]
    counters = {}
    logits = {}
    moe = bool(config.sparse_layers)
    # a MoE's routing is discontinuous: in bf16 a near-tie between two experts can flip between any
    # two roundings (fused or not), so its fused path is judged in float32 (plugin on vs off)
    modes = ("on", "off", "fp32") + (("on_fp32",) if moe else ())
    for mode in modes:
        t0 = time.perf_counter()
        counter = CollectiveCounter()
        counted = parallel.with_groups(lambda g: CountingCollectives(g, counter))
        dtype = torch.float32 if mode in ("fp32", "on_fp32") else torch.bfloat16
        plugin_on = mode in ("on", "on_fp32")
        _tp(parallel).agree(True)  # every rank builds with the same registry (ranks may share a process)
        with (_plugin_disabled() if not plugin_on else contextlib.nullcontext()):
            _, model = _build(name, counted, dtype, state)
        _tp(parallel).agree(True)
        if mode == "on_fp32":
            report = prepare_flashinfer_fusion(model, max_tokens=args.max_tokens)
            checks.add(f"{name}: float32 workspace agreed and candidates bound", report.available, report=str(report))
        if mode == "on":
            if getattr(args, "shadow", False):
                shadow = _Shadow(_tp(parallel))
                restore = shadow.install()
            report = prepare_flashinfer_fusion(model, max_tokens=args.max_tokens)
            checks.add(f"{name}: workspace agreed and candidates bound", report.available, report=str(report))
            _trace_stages(model, rank)
            _watch_lamport_flags(rank)
        counter.reset()
        logits[mode] = _logits(model, counted, prompts, decode)
        counters[mode] = counter.snapshot()
        if mode == "on" and getattr(args, "shadow", False):
            restore()
            # one bf16 rounding apart at most: the kernel and the unfused read round the same sum
            calls = shadow.summary()
            checks.add(f"{name}: every fused call within one bf16 rounding of the unfused read (shadowed)",
                       calls["max_residual_err"] <= 2 ** -7 and calls["max_norm_err"] <= 2 ** -6, **calls)
        del model
        _empty_cache()
        if rank == 0:
            print(f"    ({name} plugin {mode}: {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    on_off = [_max_rel(a, b) for a, b in zip(logits["on"], logits["off"])]
    on_ref = [_rel(a, b) for a, b in zip(logits["on"], logits["fp32"])]
    off_ref = [_rel(a, b) for a, b in zip(logits["off"], logits["fp32"])]
    top1 = [float((a.argmax(-1) == b.argmax(-1)).float().mean()) for a, b in zip(logits["on"], logits["off"])]
    same = all(_same_on_all_ranks(t.to(_device()), _tp(parallel)) for t in logits["on"])
    facts = dict(err_on_vs_off=on_off, err_on_vs_fp32=on_ref, err_off_vs_fp32=off_ref, top1_agreement=top1, ranks_identical=same)
    if not moe:
        # equal within bf16 (as `layer-boundary run` checks logits), and no further from float32 than unfused bf16 is
        ok = max(on_off) <= BF16_LOGITS_TOL and all(a <= 1.25 * b + 1e-3 for a, b in zip(on_ref, off_ref))
        checks.add(f"{name}: TP={parallel.topology.tp} bf16 logits equal with the plugin on and off", ok and same, **facts)
        return _count_check(checks, name, counters)
    # bf16: reported (how many tokens a routing flip moved), not judged token by token
    tokens_off = [float(((a - b).abs().amax(-1) > BF16_LOGITS_TOL * b.abs().amax()).float().mean())
                  for a, b in zip(logits["on"], logits["off"])]
    checks.add(f"{name}: TP={parallel.topology.tp} bf16 logits with the plugin on and off (routing flips reported)", same,
               share_of_tokens_beyond_bf16_tolerance=tokens_off, **facts)
    fp32_on_off = [_max_rel(a, b) for a, b in zip(logits["on_fp32"], logits["fp32"])]
    same32 = all(_same_on_all_ranks(t.to(_device()), _tp(parallel)) for t in logits["on_fp32"])
    checks.add(f"{name}: TP={parallel.topology.tp} float32 logits equal with the plugin on and off",
               max(fp32_on_off) <= FP32_LOGITS_TOL and same32, err_on_vs_off=fp32_on_off, ranks_identical=same32)
    _count_check(checks, name, counters)


def _count_check(checks, name, counters):
    ar_on = sum(n for k, n in counters["on"].items() if k.startswith("all_reduce"))
    ar_off = sum(n for k, n in counters["off"].items() if k.startswith("all_reduce"))
    checks.add(f"{name}: the fusion replaced the boundary all-reduces", ar_on < ar_off, collectives_on=counters["on"],
               collectives_off=counters["off"])


def check_models(checks, parallel, rank, args):
    for name in args.models:
        t0 = time.perf_counter()
        check_model(checks, parallel, rank, name, args)
        if rank == 0:
            print(f"  (model {name}: {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)


# graph decode --------------------------------------------------------------------------------------
def _capture(fn, warmup: int = 2):
    """`fn()` captured in a CUDA graph after eager warm-up; (graph, output). Thread-local capture
    mode, so a communicator's watchdog thread's CUDA calls are not refused while this thread captures."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    _sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def _graph_decode(checks, parallel, rank, args, name):
    """The whole decode step of `name` in one graph: fused boundaries, every other sum on the
    workspace (the model is built on `flashinfer_collectives`)."""
    from layer_boundary.models import family, model_config
    from layer_boundary.models.decode import static_decode_step, static_prefill

    from .collectives import flashinfer_collectives, wrapped_flashinfer_collectives
    from .service import prepare_flashinfer_fusion

    config = model_config(name, dict(family(name).preset, **_sizes(name)))
    state = family(name).random_weights(config, torch.float32, seed=11)
    fi_parallel = flashinfer_collectives(parallel)
    _, model = _build(name, fi_parallel, torch.bfloat16, state)
    report = prepare_flashinfer_fusion(model, max_tokens=args.max_tokens)  # before capture
    checks.add(f"graph decode {name}: fused boundaries and the all-reduce collectives bound",
               report.available and bool(report.collectives), report=str(report))
    if not (report.available and report.collectives):
        return
    wrappers = wrapped_flashinfer_collectives(fi_parallel.groups.values())
    batch, prompt_len, steps = 8, 12, 3
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (prompt_len,), generator=gen) for _ in range(batch)]
    decode = [torch.randint(0, config.vocab_size, (batch,), generator=gen).to(_device()) for _ in range(steps)]
    with torch.inference_mode():
        cache = model.new_static_cache(batch, prompt_len + steps + 4)
        slots = torch.arange(batch, device=_device())
        static_prefill(model, fi_parallel, cache, prompts, _device())
        snap = cache.snapshot()
        static_ids = decode[0].clone()
        static_pos = torch.full((batch,), prompt_len, dtype=torch.long, device=_device())
        graph, out = _capture(lambda: static_decode_step(model, fi_parallel, cache, static_ids, slots, static_pos))
        calls_before = sum(w.kernel_calls for w in wrappers)
        ok, diffs = True, []
        for s in range(steps):  # each step: eager from the snapshot, then the replay from the same snapshot
            pos = torch.full((batch,), prompt_len + s, dtype=torch.long, device=_device())
            cache.restore(snap)
            eager = static_decode_step(model, fi_parallel, cache, decode[s], slots, pos).clone()
            cache.restore(snap)
            static_ids.copy_(decode[s])
            static_pos.copy_(pos)
            graph.replay()
            _sync()
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


def check_graph_decode(checks, parallel, rank, args):
    for name in args.graph_models:
        _graph_decode(checks, parallel, rank, args, name)


STEP_FUNCTIONS = {
    "memory": check_memory, "boundary": check_boundary, "twoshot": check_twoshot, "finalize": check_finalize,
    "fallback": check_fallback, "defects": check_defects, "fp8": check_fp8, "models": check_models,
    "graph decode": check_graph_decode,
}


def _rank(rank: int, world: int, args) -> None:
    import flashinfer

    from layer_boundary import Parallel, Topology

    from .ranks import world_placement
    from .service import default_manager

    global MODEL_SIZES_CHOICE
    MODEL_SIZES_CHOICE = args.model_sizes
    if args.dense_moe:
        from layer_boundary.models.moe import TPMoE

        TPMoE.DENSE_DISPATCH_TOKENS = 1 << 30
    parallel = Parallel.from_torch(Topology(tp=world))
    checks = Checks(rank)
    started = time.perf_counter()
    timings = {}
    placement = world_placement()
    for what in STEPS:
        if args.only and what not in args.only or what in (args.skip or ()):
            continue
        checks.step = what
        t0 = time.perf_counter()
        if args.watchdog:
            faulthandler.dump_traceback_later(args.watchdog, repeat=True, file=sys.stderr)
        try:
            with torch.no_grad():
                STEP_FUNCTIONS[what](checks, parallel, rank, args)
        finally:
            faulthandler.cancel_dump_traceback_later()
        timings[what] = time.perf_counter() - t0
        if rank == 0:
            print(f"  ({what}: {timings[what]:.1f} s)", file=sys.stderr, flush=True)
    failed = sum(not c["ok"] for c in checks.items)
    all_passed = _tp(parallel).agree(failed == 0)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"device": torch.cuda.get_device_name(), "world": world,
                  "gpus": placement.devices_used if placement else None, "shared_device": bool(placement and placement.shared),
                  "placement": placement.describe() if placement else None,
                  "flashinfer": flashinfer.__version__, "torch": torch.__version__,
                  "fast_path": dict(default_manager().backend.fast_path), "seconds": time.perf_counter() - started,
                  "step_seconds": timings, "checks": checks.items}
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
        print(f"{len(checks.items) - failed}/{len(checks.items)} checks passed on rank 0 (all ranks: "
              f"{'passed' if all_passed else 'FAILED'}); {result['placement']}; fast path {result['fast_path']}; "
              f"wrote {out / 'gpu_check.json'}", flush=True)
    if not all_passed:
        raise SystemExit(1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/flashinfer_gpu_check")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--models", nargs="*", default=["qwen3", "gemma", "qwen3_moe"])
    ap.add_argument("--graph-models", nargs="*", default=["qwen3", "qwen3_moe"])
    ap.add_argument("--only", nargs="*", choices=STEPS, help="run only these steps")
    ap.add_argument("--skip", nargs="*", choices=STEPS, help="leave these steps out")
    ap.add_argument("--ranks", "--gpus", dest="ranks", type=int, default=2,
                    help="ranks (placed on the visible GPUs; several share a GPU where there are fewer GPUs)")
    ap.add_argument("--watchdog", type=float, default=240.0, help="dump every rank's stack after this many seconds in one step")
    ap.add_argument("--model-sizes", choices=["check", "preset"], default="check",
                    help="the models' sizes: this check's (hidden 2048) or the embedded presets' (hidden 64)")
    ap.add_argument("--dense-moe", action="store_true", help="MoE layers run every expert on every token (no host sync)")
    ap.add_argument("--shadow", action="store_true",
                    help="models step: recompute every fused call unfused from copies of its inputs and report the gap per call")
    args = ap.parse_args(argv)
    global MODEL_SIZES_CHOICE
    MODEL_SIZES_CHOICE = args.model_sizes
    if not torch.cuda.is_available():
        raise SystemExit("the flashinfer GPU check needs a CUDA GPU (Hopper or Blackwell) and flashinfer-python")
    from .ranks import run_ranks

    run_ranks(_rank, (args,), args.ranks)


if __name__ == "__main__":
    main()
