"""GPU checks of the one-shot all-reduce kernels, run on every rank of a world (one process per
rank: the core's `gpu_world` fixture, `ProcessWorld(n, device="cuda")`). test_allreduce_gpu.py
asserts them on the GPU; test_allreduce_cpu.py runs them dry on CPU ranks.

The world: `layer_boundary.placement` places the ranks, NCCL with one GPU a rank, or round-robin
on fewer GPUs with a gloo process group (NCCL refuses two ranks on one device). The one-shot
kernels then exchange through CUDA IPC within the device and two processes' kernels time-slice:
that world checks correctness only.

Each check creates its own workspace over the world's TP group, makes every rank's inputs from
the same seeds (so each rank can build the float64 reference of the whole group locally),
launches a few times, releases the workspace and returns one dict per launch:

    {"case", "rank", "ok", "err_normed", "err_residual", "vs_unfused", "digest", "detail"}

`err_*` are the worst |kernel - float64| / bound over the elements (ok: <= 1), `vs_unfused` the
same against the unfused path (the group's all-reduce, then `fused_add_rmsnorm`) with both
paths' bounds added, `digest` a hash of the outputs (every rank must report the same).

Bounds against the exact float64 value `ref` (u = 2^-8 bf16, 2^-11 fp16, u32 = 2^-24):
- the fp32 sum of W partials and the residual errs by at most (W + 1) u32 sum|terms|;
- a MoE partial is rounded once to the row dtype before the exchange (what every rank sums):
  u |exact partial| plus its own fp32 accumulation, (top_k + 3) u32 sum|terms|;
- the new residual is rounded once: u |ref| on top; the norm adds the RMS statistic's
  (H + 8) u32 |ref| and scales the sum's error by rstd |gamma|;
- the unfused path's all-reduce rounds each partial sum: (W - 1) u sum|partials| in place of
  the fused kernel's fp32 sum error.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from types import SimpleNamespace
from typing import Optional

import torch

from layer_boundary_cutedsl.kernels.allreduce_layout import DIAG_WORDS, STATE_WORDS, buffer_layout
from layer_boundary_cutedsl.kernels.reference import moe_finalize_reference, moe_terms_abs_sum
from layer_boundary_cutedsl.oneshot import CUDA_ONESHOT, ENV_MAX_TOKENS, create_workspace

__all__ = [
    "check_boundary",
    "check_moe",
    "check_graph",
    "check_delayed",
    "check_release",
    "check_timeout_single_process",
    "check_timeout_in_subprocess",
    "rank_device",
    "use_rank_device",
    "world_note",
]

U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
U32 = 2.0**-24
ATOL = 1e-6
EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: what the checks run on (the CPU dry run in test_allreduce_cpu.py swaps in the float64
#: reference protocol over fake peer memory, CPU ranks and an eager "graph")
KERNELS = CUDA_ONESHOT


def _placement(ranks: Optional[int] = None):
    from layer_boundary.placement import current_placement, place_ranks

    placement = current_placement()
    if placement is not None and placement.on_gpu:
        return placement
    return place_ranks(ranks or 1, "cuda")


def rank_device(rank: int) -> int:
    """The GPU index of (local) rank `rank` in this world's placement."""
    return _placement(rank + 1).device_of(rank)


def use_rank_device(rank) -> torch.device:
    """In a rank's process: its GPU, made current (the launcher has normally done so already).
    `rank`: an int or a Parallel."""
    rank = int(getattr(rank, "rank", rank))
    device = torch.device("cuda", rank_device(rank))
    torch.cuda.set_device(device)
    return device


def world_note(ranks: int) -> str:
    """Where `ranks` GPU ranks run here, in words (one GPU each, or sharing: correctness only)."""
    from layer_boundary.placement import place_ranks

    return place_ranks(ranks, "cuda").describe()


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _capture(step):
    """Capture `step()` in a CUDA graph; returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _unfused():
    """(fused_add_rmsnorm, moe_finalize): the three-launch path's kernels."""
    from layer_boundary_cutedsl.kernels import fused_add_rmsnorm, moe_finalize

    return fused_add_rmsnorm, moe_finalize


def _group(parallel):
    return parallel.groups["tp"]


def _workspace(group, device, dtype, hidden, capacity, offsets=(0.0, 1.0), moe_shapes=()):
    ws, why = create_workspace(
        group, KERNELS, dtype=dtype, hidden=hidden, max_tokens=capacity, device=device, weight_offsets=offsets, moe_shapes=moe_shapes
    )
    if ws is None:
        raise RuntimeError(f"no one-shot workspace: {why}")
    return ws


def _with_report(ws, exc: Exception) -> Exception:
    """`exc`, with the report a timed-out kernel of this rank left in host memory, if any."""
    report = ws.report()
    if report is None:
        return exc
    error = RuntimeError(f"{type(exc).__name__}: {exc}\n{report}")
    error.__cause__ = exc
    return error


@contextlib.contextmanager
def _held(ws):
    """`ws` for the block; then `ws.check()`; a failure carries a timed-out kernel's report; the
    workspace is released either way (every rank passes here, so its barriers meet)."""
    try:
        yield ws
        ws.check()
    except Exception as exc:
        raise _with_report(ws, exc)
    finally:
        ws.release()


def _gen(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _digest(*tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _ratio(got, ref, bound) -> float:
    return float(((got.double() - ref).abs() / bound).max().item())


def _gamma(hidden, offset, dtype, gen, device):
    g = torch.randn(hidden, generator=gen, device=device) * 0.1
    return (g if offset else 1.0 + g).to(dtype)


def _reference(parts_exact, parts_abs, residual, gamma, offset, sum_err):
    """The float64 total and norm, and the bounds of both outputs: of the fused kernel, and of
    the unfused path (whose all-reduce rounds each partial sum to the row dtype)."""
    dtype, hidden = residual.dtype, residual.shape[-1]
    u, world = U[dtype], len(parts_exact)
    total = sum(parts_exact) + residual.double()
    rstd = torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS)
    g = gamma.double() + offset
    normed = total * rstd * g
    scale = sum(parts_abs) + residual.double().abs()
    err = sum_err + (world + 1) * U32 * scale
    err_unfused = sum_err + (world - 1) * u * sum(parts_abs) + 2 * U32 * scale

    def bounds(e):
        return u * total.abs() + (1 + u) * e + ATOL, (u + (hidden + 8) * U32) * normed.abs() + 2 * rstd * g.abs() * e + ATOL

    res_bound, norm_bound = bounds(err)
    res_unfused, norm_unfused = bounds(err_unfused)
    return SimpleNamespace(
        total=total, normed=normed, res_bound=res_bound, norm_bound=norm_bound,
        # fused and unfused both within their bounds of the exact value: within the sum of each other
        res_vs=res_bound + res_unfused, norm_vs=norm_bound + norm_unfused,
    )


def _vs_unfused(group, partial, residual, gamma, offset, normed, res, ref) -> float:
    """Worst |fused - unfused| / (the two paths' error bounds added) of both outputs (ok: <= 1)."""
    fused_add_rmsnorm, _ = _unfused()
    total = group.all_reduce(partial.clone())
    u_normed, u_res = fused_add_rmsnorm(total, residual, gamma, EPS, weight_offset=offset)
    return max(_ratio(normed, u_normed.double(), ref.norm_vs), _ratio(res, u_res.double(), ref.res_vs))


def _result(case, rank, normed, res, ref, vs_unfused=None, detail=""):
    err_n = _ratio(normed, ref.normed, ref.norm_bound)
    err_r = _ratio(res, ref.total, ref.res_bound)
    ok = err_n <= 1.0 and err_r <= 1.0 and (vs_unfused is None or vs_unfused <= 1.0)
    return {
        "case": case,
        "rank": rank,
        "ok": bool(ok),
        "err_normed": err_n,
        "err_residual": err_r,
        "vs_unfused": vs_unfused,
        "digest": _digest(normed, res),
        "detail": detail,
    }


def _plain_inputs(seed, world, tokens, hidden, dtype, offset, device):
    gen = _gen(seed, device)
    parts = [torch.randn(tokens, hidden, generator=gen, device=device).to(dtype) for _ in range(world)]
    residual = (torch.randn(tokens, hidden, generator=gen, device=device) * 2).to(dtype)
    gamma = _gamma(hidden, offset, dtype, gen, device)
    return parts, residual, gamma


def _plain_reference(parts, residual, gamma, offset):
    exact = [p.double() for p in parts]
    return _reference(exact, [p.abs() for p in exact], residual, gamma, offset, 0.0)


# ---------------------------------------------------------------------------------------- checks


def check_boundary(parallel, dtype_name="bf16", hidden=4096, offset=0.0, token_counts=(1, 7, 128), *, unfused=True, max_ctas=None, seed=0):
    """All-reduce + residual add + RMSNorm at each token count, on one workspace (the epochs and
    parities advance from launch to launch). `max_ctas`: per-rank CTA caps (a list: ranks may
    run different grids) to make CTAs loop over rows."""
    device = use_rank_device(parallel)
    group, dtype = _group(parallel), DTYPES[dtype_name]
    out = []
    with _held(_workspace(group, device, dtype, hidden, max(token_counts), offsets=(offset,))) as ws:
        if max_ctas is not None:
            ws.max_ctas = max_ctas[group.rank]
        for i, tokens in enumerate(token_counts):
            parts, residual, gamma = _plain_inputs(seed * 1000 + i, group.size, tokens, hidden, dtype, offset, device)
            normed, res = ws.all_reduce_add_rmsnorm(parts[group.rank], residual, gamma, EPS, offset)
            _sync(device)
            ref = _plain_reference(parts, residual, gamma, offset)
            vs = _vs_unfused(group, parts[group.rank], residual, gamma, offset, normed, res, ref) if unfused else None
            name = f"boundary {dtype_name} h{hidden}{' gemma' if offset else ''} T={tokens}" + (f" ctas={max_ctas}" if max_ctas else "")
            out.append(_result(name, group.rank, normed, res, ref, vs))
    return out


def check_moe(parallel, hidden=2048, top_k=8, shared=True, token_counts=(7, 133), offset=0.0, *, seed=1):
    """MoE finalize (dense expert rows of this rank, weights shared by the group, an optional
    shared-expert partial) + exchange + add + norm, one launch per token count."""
    device = use_rank_device(parallel)
    group, dtype = _group(parallel), torch.bfloat16
    world = group.size
    out = []
    with _held(_workspace(group, device, dtype, hidden, max(token_counts), offsets=(offset,), moe_shapes=[(top_k, shared)])) as ws:
        for i, tokens in enumerate(token_counts):
            gen = _gen(seed * 1000 + i, device)
            rows = [torch.randn(tokens, top_k, hidden, generator=gen, device=device).to(dtype) for _ in range(world)]
            weights = torch.rand(tokens, top_k, generator=gen, device=device)
            shareds = [torch.randn(tokens, hidden, generator=gen, device=device).to(dtype) if shared else None for _ in range(world)]
            residual = (torch.randn(tokens, hidden, generator=gen, device=device) * 2).to(dtype)
            gamma = _gamma(hidden, offset, dtype, gen, device)
            r = group.rank
            normed, res = ws.moe_finalize_all_reduce_add_rmsnorm(rows[r], weights, shareds[r], residual, gamma, EPS, offset)
            _sync(device)
            exact = [moe_finalize_reference(rows[q], None, weights, shareds[q], exact=True) for q in range(world)]
            zeros = torch.zeros_like(residual)
            terms = [moe_terms_abs_sum(rows[q], None, weights, shareds[q], zeros) for q in range(world)]
            # each rank's partial: fp32 accumulation, then rounded once before the exchange
            round_err = sum(U[dtype] * e.abs() + (1 + U[dtype]) * (top_k + 3) * U32 * t for e, t in zip(exact, terms))
            abs_parts = [e.abs() * (1 + U[dtype]) for e in exact]
            ref = _reference(exact, abs_parts, residual, gamma, offset, round_err)
            partial = _unfused()[1](rows[r], None, weights, shared=shareds[r])
            vs = _vs_unfused(group, partial, residual, gamma, offset, normed, res, ref)
            name = f"moe k{top_k}{' shared' if shared else ''} h{hidden}{' gemma' if offset else ''} T={tokens}"
            out.append(_result(name, r, normed, res, ref, vs))
    return out


def check_graph(parallel, hidden=4096, tokens=16, replays=3, *, seed=2):
    """Two one-shot launches captured in one CUDA graph; each replay (new inputs copied into the
    static buffers) must equal the same two launches run eagerly, bit for bit, and the float64
    reference. Replays and eager launches alternate, so epochs of both parities are exercised."""
    device = use_rank_device(parallel)
    group, dtype = _group(parallel), torch.bfloat16
    world, r = group.size, group.rank
    static = [_plain_inputs(seed, world, tokens, hidden, dtype, 0.0, device) for _ in range(2)]
    x = [s[0][r].clone() for s in static]
    res_in = [s[1].clone() for s in static]
    gamma = static[0][2]
    outs = [(torch.empty_like(res_in[k]), torch.empty_like(res_in[k])) for k in range(2)]
    out = []
    with _held(_workspace(group, device, dtype, hidden, tokens, offsets=(0.0,))) as ws:

        def step():
            for k in range(2):
                ws.all_reduce_add_rmsnorm(x[k], res_in[k], gamma, EPS, out=outs[k][0], residual_out=outs[k][1])

        step()  # eager first (loads the kernel)
        _sync(device)
        replay = _capture(step)
        _sync(device)
        for i in range(replays):
            inputs = [_plain_inputs(seed * 1000 + 10 * i + k, world, tokens, hidden, dtype, 0.0, device) for k in range(2)]
            for k in range(2):
                x[k].copy_(inputs[k][0][r])
                res_in[k].copy_(inputs[k][1])
                outs[k][0].zero_()
            replay()
            _sync(device)
            replayed = [(a.clone(), b.clone()) for a, b in outs]
            step()  # the same inputs, eagerly
            _sync(device)
            for k in range(2):
                same = torch.equal(replayed[k][0], outs[k][0]) and torch.equal(replayed[k][1], outs[k][1])
                parts, residual, _ = inputs[k]
                ref = _plain_reference(parts, residual, gamma, 0.0)
                res = _result(f"graph replay {i} launch {k} T={tokens}", r, *replayed[k], ref)
                res["ok"] = res["ok"] and same
                res["detail"] = "replay == eager" if same else "replay differs from eager"
                out.append(res)
    return out


def check_delayed(parallel, delayed_rank, delay_s=1.0, hidden=4096, tokens=7, *, seed=3):
    """One rank sleeps before its launch; the others launch at once and wait on the GPU."""
    device = use_rank_device(parallel)
    group, dtype = _group(parallel), torch.bfloat16
    with _held(_workspace(group, device, dtype, hidden, tokens, offsets=(0.0,))) as ws:
        parts, residual, gamma = _plain_inputs(seed, group.size, tokens, hidden, dtype, 0.0, device)
        group.agree(True)  # start together, then delay one
        if group.rank == delayed_rank:
            time.sleep(delay_s)
        start = time.perf_counter()
        normed, res = ws.all_reduce_add_rmsnorm(parts[group.rank], residual, gamma, EPS)
        _sync(device)
        waited = time.perf_counter() - start
        ref = _plain_reference(parts, residual, gamma, 0.0)
    return [_result(f"rank {delayed_rank} delayed {delay_s:.1f}s T={tokens}", group.rank, normed, res, ref, detail=f"launch to result {waited:.2f}s")]


def check_release(parallel, hidden=8192, capacity=2048):
    """Device memory goes down by the ranks' buffers on this GPU at creation and comes back at
    release (measured between barriers, so no rank allocates meanwhile)."""
    device = use_rank_device(parallel)
    group = _group(parallel)
    memory = KERNELS.memory()
    torch.zeros(1, device=device)  # torch's own context and pool exist before the first reading
    KERNELS.prepare(torch.bfloat16, hidden, group.size, (0.0,), (), device)  # and the kernel is loaded
    sharing = sum(1 for r in group.ranks if rank_device(r) == device.index)
    group.agree(True)
    free0 = memory.free_bytes(device)
    group.agree(True)
    saved = os.environ.get(ENV_MAX_TOKENS)
    os.environ[ENV_MAX_TOKENS] = str(capacity)  # every rank alike: a buffer large enough to see
    try:
        ws = _workspace(group, device, torch.bfloat16, hidden, capacity, offsets=(0.0,))
    finally:
        if saved is None:
            os.environ.pop(ENV_MAX_TOKENS, None)
        else:
            os.environ[ENV_MAX_TOKENS] = saved
    nbytes = ws.nbytes
    group.agree(True)
    free1 = memory.free_bytes(device)
    group.agree(True)
    ws.release()
    group.agree(True)
    free2 = memory.free_bytes(device)
    slack = sharing * (8 << 20)  # allocation granularity, the state tensor's block
    taken, back = free0 - free1, free2 - free1
    ok = abs(taken - sharing * nbytes) <= slack and back >= taken - slack
    detail = f"{sharing} buffer(s) of {nbytes >> 20} MiB on this GPU: {taken >> 20} MiB taken, {back >> 20} MiB back"
    return [{"case": f"release h{hidden} cap{capacity}", "rank": group.rank, "ok": bool(ok), "err_normed": None, "err_residual": None,
             "vs_unfused": None, "digest": "", "detail": detail}]


def check_timeout_single_process(timeout_s=2.0, hidden=1024, tokens=3, device_index=0) -> dict:
    """A 2-rank launch whose peer never publishes (its "buffer" is a second local one): the kernel
    must report what it waited for and trap after `timeout_s`, not hang. Poisons this process's
    CUDA context: run it in a process of its own."""
    from layer_boundary_cutedsl.kernels.allreduce import allreduce_add_rmsnorm

    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    dtype = torch.bfloat16
    memory = CUDA_ONESHOT.memory()
    layout = buffer_layout(2, tokens, hidden, dtype)
    own, other = memory.allocate(layout.nbytes, device), memory.allocate(layout.nbytes, device)
    diag = memory.host_words(DIAG_WORDS, device)
    state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=device)
    state[2] = int(timeout_s * 1e9)
    peers = SimpleNamespace(world=2, rank=0, capacity=tokens, buffer=own, addresses=(own, other), state=state,
                            diag_address=diag.device_address, max_ctas=None)
    CUDA_ONESHOT.prepare(dtype, hidden, 2, (0.0,), (), device)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    gamma = torch.ones(hidden, device=device, dtype=dtype)
    _sync(device)
    start = time.perf_counter()
    error: Optional[str] = None
    try:
        allreduce_add_rmsnorm(peers, x, x.clone(), gamma, EPS)
        _sync(device)
    except Exception as exc:  # noqa: BLE001 - the expected outcome
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    elapsed = time.perf_counter() - start
    words = diag.read()
    reported = words[0] == 1 and words[2] == 1 and words[4] == 1
    ok = error is not None and reported and elapsed >= timeout_s * 0.9
    return {
        "case": f"timeout {timeout_s:.0f}s traps", "rank": 0, "ok": bool(ok), "err_normed": None, "err_residual": None,
        "vs_unfused": None, "digest": "",
        "detail": f"error after {elapsed:.1f}s: {error}; report words {words[:7]}",
    }


def check_timeout_in_subprocess(timeout_s: float = 2.0, limit: float = 120.0) -> tuple:
    """`check_timeout_single_process` in a fresh interpreter: (its row, "") or (None, what went
    wrong: no answer within `limit` s means the kernel hung instead of trapping)."""
    import json
    import subprocess
    import sys

    code = (
        f"import json, os; from {__name__} import check_timeout_single_process as f; "
        f"print('RESULT ' + json.dumps(f({float(timeout_s)!r})), flush=True); os._exit(0)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return None, f"no answer within {limit:.0f}s: the kernel hung instead of trapping"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), ""
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return None, f"exit {proc.returncode}: {' | '.join(tail)}"
