#!/usr/bin/env python3
"""Where do the CuTe DSL kernels stand on this GPU machine? One command, one line per probe.

    python3 plugins/cutedsl/gpu_diagnose.py [--out DIR] [--budget 235] [--only NAME ...] [--no-pytest]

(from the repository root, with PYTHONPATH naming core/, plugins/cutedsl/ and the cutlass DSL
packages). A ladder of probes runs from the most basic up, each in its own child process with
its own deadline, so one hang cannot stop the rest:

  1. torch on the device;  2. the DSL imports (which CUDA flavour it loaded);
  3. a trivial DSL kernel through the DSL's own tensor path, then through our address + stream
     path (generic executor and the ctypes fast call, on a side stream);
  4. a CTA barrier over shared memory; the row kernels' block reduction;
  5. the real kernels at small sizes (fast and generic launch), then every width/dtype/mode;
  6. CUDA-graph replay, a quick timing; then the GPU test files (pytest) when all that passed;
  7. last, the pattern that hung the first H200 run (expected: hang), to confirm the diagnosis.

Each line reads `[status] name seconds detail`: ok, wrong (max error against the float64
reference above its bound), hang (the GPU work did not finish: the child reports the phase it
waited in, or the parent killed it), error (an exception; its last lines follow), skip.
A child waits for the GPU by polling a CUDA event, never `torch.cuda.synchronize()`, so a hung
kernel is reported by the child itself. `--out DIR` also writes DIR/gpu_diagnose.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULT = "@@result "
PHASE = "@@phase "
KERNEL_WAIT_S = 10.0  # the kernels here run in microseconds: 10 s without completion is a hang
EPS = 1e-6


# ------------------------------------------------------------------------------ child side


class Hang(Exception):
    pass


class Wrong(Exception):
    pass


def phase(text: str) -> None:
    print(PHASE + text, flush=True)


def wait_gpu(what: str, seconds: float = KERNEL_WAIT_S) -> None:
    """Wait for the current stream by polling an event; raise Hang after `seconds`."""
    import torch

    event = torch.cuda.Event()
    event.record()
    start = time.monotonic()
    phase(f"waiting for {what}")
    while not event.query():
        if time.monotonic() - start > seconds:
            raise Hang(f"{what} launched but did not complete within {seconds:.0f} s")
        time.sleep(0.001)


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def _arch():
    from layer_boundary_cutedsl.kernels.compiler import target_arch

    return target_arch(_device())


def probe_torch():
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    props = torch.cuda.get_device_properties(0)
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    y = x * 2 + 1
    wait_gpu("a torch elementwise kernel")
    if not bool((y == torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 2 + 1).all()):
        raise Wrong("torch arithmetic is wrong")
    return (
        f"{props.name} sm_{props.major}{props.minor} {props.multi_processor_count} SMs; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}); {torch.cuda.device_count()} visible"
    )


def probe_dsl_import():
    import importlib.metadata as md

    import cuda.bindings.driver as driver

    phase("import cutlass")
    import cutlass  # noqa: F401
    import cutlass.cute  # noqa: F401

    ir = sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir")
    flavour = os.path.basename(getattr(ir, "__file__", "?") or "?")
    try:
        _, version = driver.cuDriverGetVersion()
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        version = -1000
        phase(f"cuDriverGetVersion failed: {exc}")
    versions = []
    for dist in ("nvidia-cutlass-dsl", "cuda-bindings", "cuda-python"):
        try:
            versions.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            versions.append(f"{dist} (no dist-info)")
    return f"driver CUDA {int(version) // 1000}.{int(version) % 1000 // 10}; {'; '.join(versions)}; loaded {flavour}; target {_arch()}"


def _probe_buffer(name):
    import torch

    from layer_boundary_cutedsl.kernels.probe_dsl import PROBES

    _, threads, dtype, expected = PROBES[name]
    out = torch.full((threads,), -1, dtype=getattr(torch, dtype), device="cuda")
    return out, [v for v in expected(3, threads)]


def _check_probe(name, out, want):
    got = out.cpu().tolist()[: len(want)]
    if got != want:
        bad = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
        raise Wrong(f"element {bad}: got {got[bad]}, expected {want[bad]} (first of {sum(g != w for g, w in zip(got, want))} wrong)")


def probe_dsl_tensor_write():
    """The DSL alone: a cute.Tensor from dlpack, the arch detected by the DSL, its executor."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    from layer_boundary_cutedsl.kernels.probe_dsl import WriteOneTensor

    t = torch.full((4,), -1, dtype=torch.int32, device="cuda")
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    phase("compile (DSL defaults)")
    compiled = cute.compile(WriteOneTensor(), from_dlpack(t), Int32(3), stream)
    phase("launch")
    compiled(from_dlpack(t), Int32(3), stream)
    wait_gpu("the DSL's own one-value kernel")
    _check_probe("write_one", t, [3])
    return "the DSL's own path works"


def _compiled_probe(name):
    from layer_boundary_cutedsl.kernels.probe_dsl import compile_probe

    phase(f"compile {name} for {_arch()}")
    compiled = compile_probe(name, _arch())
    phase("load (compiled.to)")
    return compiled, compiled.to(_device().index)


def _run_probe(name, how: str):
    import cuda.bindings.driver as cuda
    import torch

    from layer_boundary_cutedsl.kernels._launch import FastCall

    out, want = _probe_buffer(name)
    compiled, executor = _compiled_probe(name)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stream = torch.cuda.current_stream().cuda_stream
        phase(f"launch ({how}) on a side stream {stream:#x}")
        if how == "generic":
            executor(out.data_ptr(), 3, cuda.CUstream(stream))
        else:
            call = FastCall(executor, ("i64", "i32", "stream"))
            if not call.matches(compiled.execution_args, (0x1000, 7, 0x2000)):
                raise Wrong("FastCall does not match the DSL's argument marshalling for the probe kernel")
            call(out.data_ptr(), 3, stream)
        wait_gpu(f"probe kernel {name}")
    _check_probe(name, out, want)
    return f"{len(want)} values right"


def probe_write_generic():
    return _run_probe("write_one", "generic")


def probe_write_fast():
    return _run_probe("write_one", "fast")


def probe_barrier():
    return _run_probe("barrier_exchange", "fast")


def probe_block_reduce():
    return _run_probe("block_reduce", "fast")


def probe_hang_pattern():
    """The block reduction as first written (warp_idx() inside `if lane == 0:`): expected to hang."""
    try:
        _run_probe("block_reduce_warp_idx_in_branch", "fast")
    except Hang as exc:
        raise Hang(f"{exc} -- EXPECTED: this confirms the cause of the H200 hang (fixed in dsl_rows.block_sum)") from None
    raise Wrong("did NOT hang: warp_idx() in a lane-0 branch is not what hung the kernels on this machine; look elsewhere")


# real kernels ------------------------------------------------------------------------------------

U = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
U32 = 2.0**-24


def _ratio(got, ref, bound) -> float:
    err = (got.double() - ref).abs()
    return float((err / bound).max()) if err.numel() else 0.0


def _gamma(hidden, offset, dtype, gen):
    import torch

    g = torch.randn(hidden, generator=gen, device="cuda") * 0.1
    return (g if offset else 1.0 + g).to(dtype)


def _add_norm_case(dtype, hidden, tokens, offset, *, tag=""):
    """Launch fused_add_rmsnorm once and return (worst error / bound, residual exact?)."""
    import torch

    from layer_boundary_cutedsl.kernels import add_rmsnorm_reference, fused_add_rmsnorm

    gen = torch.Generator(device="cuda").manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    r = (torch.randn(tokens, hidden, generator=gen, device="cuda") * 3).to(dtype)
    gamma = _gamma(hidden, offset, dtype, gen)
    phase(f"compile/load + launch fused_add_rmsnorm {tag}[{tokens},{hidden}] {dtype} offset={offset}")
    normed, res = fused_add_rmsnorm(x, r, gamma, EPS, weight_offset=offset)
    wait_gpu(f"fused_add_rmsnorm [{tokens},{hidden}]")
    ref, _ = add_rmsnorm_reference(x, r, gamma, EPS, weight_offset=offset, exact=True)
    u = U[str(dtype).split(".")[-1]]
    bound = (u + (hidden + 8) * U32) * ref.abs() + 1e-6
    exact = bool(torch.equal(res, (x.float() + r.float()).to(dtype)))
    return _ratio(normed, ref, bound), exact


def _report_add_norm(cases):
    worst, all_exact, lines = 0.0, True, []
    for case in cases:
        ratio, exact = _add_norm_case(*case)
        worst, all_exact = max(worst, ratio), all_exact and exact
        lines.append(f"{case[0]}".split(".")[-1] + f" [{case[2]},{case[1]}] off={case[3]}: err/bound {ratio:.3f}" + ("" if exact else " RESIDUAL WRONG"))
    detail = f"worst err/bound {worst:.3f}; " + "; ".join(lines[:4]) + (f"; ... {len(lines)} cases" if len(lines) > 4 else "")
    if worst > 1.0 or not all_exact:
        raise Wrong(detail)
    return detail


def probe_add_rmsnorm_1x1024():
    import torch

    return _report_add_norm([(torch.bfloat16, 1024, 1, 0.0)])


def probe_add_rmsnorm_1x1024_generic():
    import torch

    from layer_boundary_cutedsl.kernels import _launch

    _launch.FastCall.matches = lambda self, *a, **k: False  # force the DSL's generic launch path
    import warnings

    warnings.simplefilter("ignore")
    return "generic launch path: " + _report_add_norm([(torch.bfloat16, 1024, 1, 0.0)])


def probe_add_rmsnorm_8x4096():
    import torch

    return _report_add_norm([(torch.bfloat16, 4096, 8, 0.0), (torch.bfloat16, 4096, 8, 1.0)])


def _moe_case(dtype, hidden, top_k, tokens, indexed, shared, mode):
    import torch

    from layer_boundary_cutedsl.kernels import (
        moe_finalize,
        moe_finalize_add_rmsnorm,
        moe_finalize_add_rmsnorm_reference,
        moe_finalize_reference,
    )
    from layer_boundary_cutedsl.kernels.reference import moe_terms_abs_sum

    gen = torch.Generator(device="cuda").manual_seed(hidden * 3 + top_k + tokens)
    rows = tokens * top_k + 3
    routed = torch.randn(rows, hidden, generator=gen, device="cuda").to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen, device="cuda")
    indices = None
    if indexed:
        indices = torch.randperm(rows, generator=gen, device="cuda")[: tokens * top_k].view(tokens, top_k).to(torch.int32)
        skip = torch.rand(tokens, top_k, generator=gen, device="cuda") < 0.15
        indices = torch.where(skip, torch.full_like(indices, -1), indices)
        weights = torch.where(skip, torch.full_like(weights, float("inf")), weights)
    sh = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype) if shared else None
    u = U[str(dtype).split(".")[-1]]
    tag = f"moe {mode} [{tokens}x{top_k},{hidden}] {'perm' if indexed else 'dense'}{' shared' if shared else ''}"
    phase(f"compile/load + launch {tag}")
    if mode == "finalize_only":
        out = moe_finalize(routed, indices, weights, shared=sh)
        wait_gpu(tag)
        ref = moe_finalize_reference(routed, indices, weights, sh, exact=True)
        terms = moe_terms_abs_sum(routed, indices, weights, sh, torch.zeros_like(out))
        return tag, _ratio(out, ref, u * ref.abs() + (top_k + 3) * U32 * terms * (1 + u) + 1e-6)
    offset = 1.0 if mode == "gemma" else 0.0
    residual = (torch.randn(tokens, hidden, generator=gen, device="cuda") * 2).to(dtype)
    gamma = _gamma(hidden, offset, dtype, gen)
    normed, res = moe_finalize_add_rmsnorm(routed, indices, weights, residual, gamma, EPS, shared=sh, weight_offset=offset)
    wait_gpu(tag)
    ref_normed, ref_total = moe_finalize_add_rmsnorm_reference(routed, indices, weights, sh, residual, gamma, EPS, weight_offset=offset, exact=True)
    err_total = (top_k + 3) * U32 * moe_terms_abs_sum(routed, indices, weights, sh, residual)
    r1 = _ratio(res, ref_total, u * ref_total.abs() + err_total * (1 + u) + 1e-6)
    rstd = torch.rsqrt(ref_total.pow(2).mean(-1, keepdim=True) + EPS)
    g = (gamma.double() + offset).abs()
    r2 = _ratio(normed, ref_normed, (u + (hidden + 8) * U32) * ref_normed.abs() + 2 * rstd * g * err_total + 1e-6)
    return tag, max(r1, r2)


def _report_moe(cases):
    results = [_moe_case(*c) for c in cases]
    worst = max(r for _, r in results)
    detail = f"worst err/bound {worst:.3f}; " + "; ".join(f"{t}: {r:.3f}" for t, r in results[:3]) + (f"; ... {len(results)} cases" if len(results) > 3 else "")
    if worst > 1.0:
        bad = [f"{t}: {r:.2f}" for t, r in results if r > 1.0]
        raise Wrong(f"{len(bad)} of {len(results)} cases out of bound: " + "; ".join(bad[:6]))
    return detail


def probe_moe_small():
    import torch

    bf = torch.bfloat16
    return _report_moe(
        [
            (bf, 2048, 8, 5, True, True, "plain"),
            (bf, 2048, 8, 5, False, False, "gemma"),
            (bf, 2048, 8, 5, False, True, "finalize_only"),
        ]
    )


def probe_all_add_norm_shapes():
    import torch

    from layer_boundary_cutedsl.kernels.tiling import TESTED_HIDDEN_SIZES

    cases = [
        (dtype, hidden, tokens, offset)
        for dtype in (torch.bfloat16, torch.float16)
        for hidden in TESTED_HIDDEN_SIZES
        for offset in (0.0, 1.0)
        for tokens in (1, 300)
    ]
    return _report_add_norm(cases)


def probe_all_moe_shapes():
    import torch

    cases = [
        (torch.bfloat16, hidden, top_k, 37, indexed, True, mode)
        for hidden in (2880, 7168)
        for top_k in (2, 8)
        for indexed in (True, False)
        for mode in ("plain", "gemma", "finalize_only")
    ] + [(torch.float16, 4096, 6, 300, True, False, "plain")]
    return _report_moe(cases)


def probe_graph_replay():
    import torch

    from layer_boundary_cutedsl.kernels import add_rmsnorm_reference, fused_add_rmsnorm

    gen = torch.Generator(device="cuda").manual_seed(3)
    tokens, hidden, dtype = 64, 4096, torch.bfloat16
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    r = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    gamma = _gamma(hidden, 0.0, dtype, gen)
    normed, res = torch.empty_like(x), torch.empty_like(r)
    fused_add_rmsnorm(x, r, gamma, EPS, out=normed, residual_out=res)
    wait_gpu("eager launch before capture")
    phase("capture")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_add_rmsnorm(x, r, gamma, EPS, out=normed, residual_out=res)
    x.copy_(torch.randn(tokens, hidden, generator=gen, device="cuda"))
    normed.zero_()
    phase("replay")
    graph.replay()
    wait_gpu("graph replay")
    ref, _ = add_rmsnorm_reference(x, r, gamma, EPS, exact=True)
    ratio = _ratio(normed, ref, (U["bfloat16"] + (hidden + 8) * U32) * ref.abs() + 1e-6)
    if ratio > 1.0:
        raise Wrong(f"after replay with new inputs: err/bound {ratio:.3f}")
    return f"replay with new inputs: err/bound {ratio:.3f}"


def probe_timing():
    import torch

    from layer_boundary_cutedsl.bench import time_graph
    from layer_boundary_cutedsl.kernels import fused_add_rmsnorm

    parts = []
    for tokens, hidden in ((1, 4096), (8, 4096), (256, 7168)):
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        r = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        g = torch.ones(hidden, device="cuda").to(torch.bfloat16)
        normed, res = torch.empty_like(x), torch.empty_like(r)
        phase(f"time [{tokens},{hidden}]")
        ours = time_graph(lambda: fused_add_rmsnorm(x, r, g, EPS, out=normed, residual_out=res), 50, 5)

        def unfused():
            s = x.float() + r.float()
            res.copy_(s)
            normed.copy_(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * g.float())

        theirs = time_graph(unfused, 50, 5)
        parts.append(f"[{tokens},{hidden}] {ours:.1f} us vs torch unfused {theirs:.1f} us")
    return "; ".join(parts)


#: (name, parent deadline in seconds, what it tells)
LADDER = [
    ("torch", 60, probe_torch),
    ("dsl_import", 60, probe_dsl_import),
    ("dsl_tensor_write", 60, probe_dsl_tensor_write),
    ("probe_write_generic", 60, probe_write_generic),
    ("probe_write_fast", 60, probe_write_fast),
    ("probe_barrier", 60, probe_barrier),
    ("probe_block_reduce", 60, probe_block_reduce),
    ("add_rmsnorm_1x1024", 60, probe_add_rmsnorm_1x1024),
    ("add_rmsnorm_1x1024_generic", 60, probe_add_rmsnorm_1x1024_generic),
    ("add_rmsnorm_8x4096", 60, probe_add_rmsnorm_8x4096),
    ("moe_small", 60, probe_moe_small),
    ("all_add_norm_shapes", 120, probe_all_add_norm_shapes),
    ("all_moe_shapes", 120, probe_all_moe_shapes),
    ("graph_replay", 60, probe_graph_replay),
    ("timing", 60, probe_timing),
]
HANG_PATTERN = ("hang_pattern_confirm", 45, probe_hang_pattern)


def _selftest_stuck():
    phase("stuck on purpose")
    time.sleep(600)


def _selftest_raise():
    phase("about to raise")
    raise ValueError("raised on purpose")


#: the harness's own checks (tests/plugins/cutedsl/test_gpu_diagnose_cpu.py), never in the ladder
SELFTESTS = {"selftest_stuck": _selftest_stuck, "selftest_raise": _selftest_raise}
PROBE_FUNCS = {name: fn for name, _, fn in LADDER + [HANG_PATTERN]} | SELFTESTS


def child_main(name: str) -> int:
    import faulthandler

    faulthandler.enable()
    start = time.monotonic()
    status, detail = "ok", ""
    try:
        detail = PROBE_FUNCS[name]() or ""
    except Hang as exc:
        status, detail = "hang", str(exc)
    except Wrong as exc:
        status, detail = "wrong", str(exc)
    except BaseException as exc:  # noqa: BLE001 - report everything the parent cannot see
        status = "error"
        frames = traceback.extract_tb(exc.__traceback__)[-3:]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
        detail = f"{type(exc).__name__}: {str(exc).strip()[:400]} (at {where})"
    print(RESULT + json.dumps({"status": status, "detail": detail, "seconds": time.monotonic() - start}), flush=True)
    sys.stdout.flush()
    # a hung kernel would make interpreter teardown wait on the device: leave at once
    os._exit(0 if status == "ok" else 3)


# ------------------------------------------------------------------------------ parent side


def run_child(args: list, timeout: float, env) -> tuple:
    """(rc or None on timeout, stdout, stderr, seconds); the child gets its own process group."""
    start = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err, time.monotonic() - start
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGABRT)  # faulthandler prints where it was
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        return None, out, err, time.monotonic() - start


def _last_phase(out: str) -> str:
    phases = [line[len(PHASE) :] for line in out.splitlines() if line.startswith(PHASE)]
    return phases[-1] if phases else "(no phase reported)"


def run_probe(name: str, timeout: float, env) -> dict:
    rc, out, err, seconds = run_child([sys.executable, os.path.abspath(__file__), "--probe", name], timeout, env)
    results = [json.loads(line[len(RESULT) :]) for line in out.splitlines() if line.startswith(RESULT)]
    if results:
        res = results[-1]
    elif rc is None:
        stack = " | ".join(line.strip() for line in err.strip().splitlines()[-8:])
        res = {"status": "hang", "detail": f"killed after {timeout:.0f} s in phase '{_last_phase(out)}'; stack: {stack}"}
    else:
        tail = " | ".join(line.strip() for line in (err or out).strip().splitlines()[-6:])
        res = {"status": "error", "detail": f"exit {rc} in phase '{_last_phase(out)}' without a result: {tail}"}
    if res["status"] == "hang" and "phase" not in res["detail"]:
        res["detail"] += f" (last phase: {_last_phase(out)})"
    res["name"], res["seconds"] = name, seconds
    return res


def show(res: dict) -> None:
    print(f"[{res['status']:>5}] {res['name']:<28} {res['seconds']:6.1f}s  {res['detail']}", flush=True)


def run_pytest(paths: list, timeout: float, env) -> dict:
    args = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", *paths]
    rc, out, err, seconds = run_child(args, timeout, env)
    lines = [line for line in (out + err).strip().splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " passed" in line or " failed" in line or " error" in line), lines[-1] if lines else "")
    if rc is None:
        status, detail = "hang", f"pytest killed after {timeout:.0f} s; last lines: " + " | ".join(lines[-4:])
    elif rc == 0:
        status, detail = "ok", summary
    else:
        failures = [line for line in lines if line.startswith(("FAILED", "ERROR", "E "))][:6]
        status, detail = "wrong", summary + " | " + " | ".join(failures)
    return {"name": "pytest " + " ".join(os.path.basename(p) for p in paths), "status": status, "detail": detail, "seconds": seconds}


def parent_main(args) -> int:
    deadline = time.monotonic() + args.budget
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    names = [n for n, _, _ in LADDER]
    ladder = [(n, t) for n, t, _ in LADDER if not args.only or n in args.only]
    print(f"gpu_diagnose: {len(ladder)} probes, budget {args.budget:.0f} s, python {sys.version.split()[0]}, cwd {ROOT}", flush=True)
    results = []
    for name, limit in ladder:
        left = deadline - time.monotonic() - 50  # keep time for the hang confirmation
        if left < 15:
            results.append({"name": name, "status": "skip", "detail": "out of budget", "seconds": 0.0})
            show(results[-1])
            continue
        res = run_probe(name, min(limit, left), env)
        results.append(res)
        show(res)
    kernel_ok = all(r["status"] == "ok" for r in results if r["name"] in names)
    if not args.no_pytest and not args.only:
        left = deadline - time.monotonic() - 50
        tests = [os.path.join(ROOT, "tests", "plugins", "cutedsl", f) for f in ("test_kernels_gpu.py", "test_model_gpu.py")]
        tests = [t for t in tests if os.path.exists(t)]
        if not kernel_ok:
            results.append({"name": "pytest", "status": "skip", "detail": "a probe failed: fix that first", "seconds": 0.0})
        elif left < 30:
            results.append({"name": "pytest", "status": "skip", "detail": f"only {left:.0f} s left: run `python3 -m pytest -q {' '.join(tests)}`", "seconds": 0.0})
        else:
            results.append(run_pytest(tests, left, env))
        show(results[-1])
    if not args.only or HANG_PATTERN[0] in args.only:
        left = deadline - time.monotonic()
        if left > 20:
            res = run_probe(HANG_PATTERN[0], min(HANG_PATTERN[1], left - 2), env)
            if res["status"] == "hang":
                res["status"] = "ok"
                res["detail"] = "hung as expected: " + res["detail"]
            results.append(res)
        else:
            results.append({"name": HANG_PATTERN[0], "status": "skip", "detail": "out of budget", "seconds": 0.0})
        show(results[-1])
    bad = [r["name"] for r in results if r["status"] not in ("ok", "skip")]
    print(f"gpu_diagnose: {'all ok' if not bad else 'NOT ok: ' + ', '.join(bad)}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_diagnose.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0 if not bad else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write DIR/gpu_diagnose.json")
    parser.add_argument("--budget", type=float, default=235.0, help="seconds for the whole ladder (default 235)")
    parser.add_argument("--only", nargs="*", help="run only these probes (names as printed)")
    parser.add_argument("--no-pytest", action="store_true", help="skip the GPU test files")
    args = parser.parse_args(argv)
    if args.probe:
        return child_main(args.probe)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
