"""The one-shot all-reduce on a CPU: every kernel variant compiles and lints, the workspace life
cycle is rank-uniform (fake peer memory, threaded and gloo worlds), and the service takes the one
launch where it applies, with the same decision on every rank.

The protocol itself (staging by epoch parity, flags, rank-order sum) runs here in torch
(`testing.reference_oneshot`); the GPU tests (test_allreduce_gpu.py) run the CuTe DSL kernel.
"""

import ctypes
import importlib.util
import time
from dataclasses import replace

import pytest
import torch

from layer_boundary import Forward
from layer_boundary import MoeFinalizeHandoff
from layer_boundary import UnreducedOutput
from layer_boundary import Parallel, Topology
from layer_boundary.testing.grid import GridModel, grid_inputs
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_cutedsl import CuteDSLFusion, install_cutedsl_fusion, prepare_cutedsl_fusion, release_cutedsl_fusion
from layer_boundary_cutedsl import oneshot
from layer_boundary_cutedsl.kernels.allreduce_layout import (
    ENTRY_KINDS,
    N_ADDRESSES,
    AllReduceVariant,
    all_allreduce_variants,
    buffer_layout,
)
from layer_boundary_cutedsl.kernels.reference import add_rmsnorm_reference, moe_finalize_reference
from layer_boundary_cutedsl.testing import FakePeerMemory, reference_kernels, reference_oneshot

from .test_service_cpu import SPEC, TOKENS, _names, _run, _want

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

# ------------------------------------------------------------------------------ compile and lint

VARIANTS = all_allreduce_variants()


@needs_cutlass
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_allreduce_variant_compiles_and_lints(variant, tmp_path):
    """sm_90a PTX with no collective under divergent code, and the memory operations of the
    protocol: sys-scope release of flags (fence + relaxed store), acquire spin, L1-bypassing peer
    loads, a bounded spin that traps, the epoch handed on by the last CTA."""
    from layer_boundary_cutedsl.kernels.compiler import compile_variant
    from .ptx_lint import lint

    compiled = compile_variant(variant, "sm_90a", keep_ptx_dir=str(tmp_path))
    assert compiled.has_gpu_module and len(compiled.kernel_info) == 1
    ptx = compiled.__ptx__
    tiling = variant.tiling()
    assert lint(ptx, tiling.threads) == []
    assert ".local" not in ptx
    # each thread loads vpt vectors of each rank's staged row, bypassing L1
    assert ptx.count("ld.global.cg.v4.b32") == variant.world * tiling.vpt
    assert ptx.count("fence.acq_rel.sys") >= 1 and "st.relaxed.sys.global.b64" in ptx
    assert "ld.acquire.sys.global.b64" in ptx and "%globaltimer" in ptx and "trap;" in ptx
    assert "atom.global.acq_rel.add.u64" in ptx and "ld.relaxed.gpu.global.b64" in ptx
    # the staged row and the two outputs are 16-byte stores
    assert ptx.count("st.global.v4.b32") == 3 * tiling.vpt


def test_variant_matrix():
    assert {v.world for v in VARIANTS} == {2, 4, 8}
    assert {v.dtype for v in VARIANTS} == {torch.bfloat16, torch.float16}
    assert {v.weight_offset for v in VARIANTS} == {0.0, 1.0}
    assert {(v.top_k > 0, v.shared) for v in VARIANTS} == {(False, False), (True, False), (True, True)}
    with pytest.raises(ValueError, match="groups of"):
        AllReduceVariant(torch.bfloat16, 4096, 3)
    with pytest.raises(ValueError, match="needs the MoE finalize variant"):
        AllReduceVariant(torch.bfloat16, 4096, 2, shared=True)


@needs_cutlass
def test_fast_launch_packs_what_the_dsl_marshals():
    """The ctypes fast path's 18 addresses + rows, rank, capacity, eps, grid, stream are what the
    DSL's own marshalling passes."""
    from layer_boundary_cutedsl.kernels._launch import FastCall
    from layer_boundary_cutedsl.kernels.compiler import compile_variant

    variant = AllReduceVariant(torch.bfloat16, 4096, 4, top_k=8, shared=True)
    from .test_compile_cpu import recording_executor

    compiled = compile_variant(variant, "sm_90a")
    FakeExecutor, seen, result = recording_executor(len(ENTRY_KINDS) + 1)
    launcher = FastCall(FakeExecutor, ENTRY_KINDS)
    probe = (*range(0x7F0000001000, 0x7F0000001000 + 16 * N_ADDRESSES, 16), 4097, 3, 300, 1e-5, 132, 0xABC0)
    assert launcher.matches(compiled.execution_args, probe)
    launcher(*probe)
    packed = seen[-1]
    assert [ctypes.c_int64.from_address(p).value for p in packed[:N_ADDRESSES]] == list(probe[:N_ADDRESSES])
    ints = [ctypes.c_int32.from_address(packed[N_ADDRESSES + i]).value for i in (0, 1, 2, 4)]
    assert ints == [4097, 3, 300, 132]
    assert ctypes.c_float.from_address(packed[N_ADDRESSES + 3]).value == pytest.approx(1e-5)
    assert packed[-1] == ctypes.addressof(result)


def test_buffer_layout():
    layout = buffer_layout(4, 100, 2880, torch.bfloat16)
    assert layout.row_stride == 5760  # 45 lines of 128 bytes
    assert layout.flags_bytes == 4 * 100 * 8 and layout.staging_offset == 3328
    assert layout.staging_row_offset(1, 3) == 3328 + 103 * 5760
    assert layout.nbytes == 3328 + 2 * 100 * 5760
    assert buffer_layout(2, 1, 1000, torch.float16).row_stride == 2048  # rows never share a line


# ------------------------------------------------------------------------------ CUDA IPC marshalling


class _FakeDriver:
    """libcuda's functions as the ctypes layer calls them (records arguments, fills outputs)."""

    def __init__(self, fail=None):
        self.log, self.fail = [], fail

    def _done(self, name):
        self.log.append(name)
        return 700 if name == self.fail else 0

    def cuMemAlloc_v2(self, ptr, nbytes):
        ptr._obj.value = 0x7000_0000 + nbytes
        return self._done("cuMemAlloc_v2")

    def cuMemsetD8_v2(self, ptr, value, nbytes):
        self.log.append(("memset", ptr, value, nbytes))
        return self._done("cuMemsetD8_v2")

    def cuMemFree_v2(self, ptr):
        self.log.append(("free", ptr))
        return self._done("cuMemFree_v2")

    def cuIpcGetMemHandle(self, handle, ptr):
        ctypes.memmove(ctypes.addressof(handle._obj), (ptr & 0xFF).to_bytes(1, "little") * 64, 64)
        return self._done("cuIpcGetMemHandle")

    def cuIpcOpenMemHandle_v2(self, ptr, handle, flags):
        ptr._obj.value = 0x9000_0000 + bytes(handle)[0] + 1
        self.log.append(("open", flags))
        return self._done("cuIpcOpenMemHandle_v2")

    def cuIpcCloseMemHandle(self, ptr):
        self.log.append(("close", ptr))
        return self._done("cuIpcCloseMemHandle")

    def cuGetErrorName(self, code, out):
        out._obj.value = b"CUDA_ERROR_FAKE"
        return 0


def test_cuda_ipc_memory_calls_the_driver_as_documented(monkeypatch):
    import contextlib

    from layer_boundary_cutedsl.peer_memory import CudaError, CudaIpcMemory

    driver = _FakeDriver()
    mem = CudaIpcMemory(driver)
    monkeypatch.setattr(CudaIpcMemory, "_context", lambda self, device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    address = mem.allocate(4096, "cuda:0")
    assert address == 0x7000_0000 + 4096 and ("memset", address, 0, 4096) in driver.log
    handle = mem.export(address)
    assert len(handle) == 64 and handle == bytes([address & 0xFF]) * 64
    peer = mem.open(handle, "cuda:0")
    assert peer == 0x9000_0000 + (address & 0xFF) + 1 and ("open", 1) in driver.log  # lazy peer access
    mem.close(peer, "cuda:0")
    mem.free(address, "cuda:0")
    assert ("close", peer) in driver.log and ("free", address) in driver.log
    with pytest.raises(ValueError, match="64 bytes"):
        mem.open(b"short", "cuda:0")
    failing = CudaIpcMemory(_FakeDriver(fail="cuIpcOpenMemHandle_v2"))
    with pytest.raises(CudaError, match=r"cuIpcOpenMemHandle failed: CUDA_ERROR_FAKE \(700\)"):
        failing.open(handle, "cuda:0")


# ------------------------------------------------------------------------------ workspace life cycle


def _create(parallel, kernels, max_tokens=16, hidden=32, dtype=torch.float64):
    group = parallel.groups["tp"]
    return oneshot.create_workspace(group, kernels, dtype=dtype, hidden=hidden, max_tokens=max_tokens, device="cpu")


@pytest.mark.parametrize("tp", [2, 4])
def test_workspace_on_every_rank_and_released(tp):
    before = FakePeerMemory.live()

    def rank(parallel):
        ws, why = _create(parallel, reference_oneshot())
        assert ws is not None and why == "", why
        assert ws.world == tp and len(ws.addresses) == tp and ws.addresses[parallel.rank] == ws.buffer
        assert ws.capacity == 16 and ws.nbytes == buffer_layout(tp, 16, 32, torch.float64).nbytes
        live = FakePeerMemory.live()
        ws.release()
        ws.release()  # twice is harmless
        return live, ws.released

    results = run_threaded(rank, Topology(tp=tp))
    assert all(live == before + tp for live, _ in results) and all(r for _, r in results)
    assert FakePeerMemory.live() == before  # every buffer freed


@pytest.mark.parametrize("step", ["allocate", "export", "open"])
def test_one_rank_failing_makes_every_rank_fall_back(step):
    """A rank whose allocation, export or mapping fails: no rank gets a workspace, every rank
    says why, the collectives matched (the threaded world raises on a mismatch) and nothing is
    left allocated."""
    before = FakePeerMemory.live()

    def rank(parallel):
        memory = (lambda: FakePeerMemory(fail=step)) if parallel.rank == 1 else FakePeerMemory
        ws, why = _create(parallel, reference_oneshot(memory=memory))
        # the group still works afterwards: one more collective, the same on every rank
        parallel.groups["tp"].agree(True)
        return ws, why

    results = run_threaded(rank, Topology(tp=4))
    assert all(ws is None for ws, _ in results)
    whys = [why for _, why in results]
    if step == "open":
        assert "mapping a peer's buffer failed: OSError: fake peer memory: open failed on purpose" in whys[1]
        assert all(w == "another rank of the group could not map a peer's buffer" for r, w in enumerate(whys) if r != 1)
    else:
        assert whys[1] == f"allocating the peer buffer failed: OSError: fake peer memory: {step} failed on purpose"
        assert all(w == "rank(s) [1] of the group could not prepare the one-shot workspace" for r, w in enumerate(whys) if r != 1)
    assert FakePeerMemory.live() == before


def test_settings_must_agree_and_can_turn_it_off(monkeypatch):
    def rank(parallel):
        return _create(parallel, reference_oneshot(), max_tokens=16 if parallel.rank == 0 else 8)

    results = run_threaded(rank, Topology(tp=2))
    assert [ws for ws, _ in results] == [None, None]
    assert all("disagree on the workspace" in why for _, why in results)
    monkeypatch.setenv(oneshot.ENV_ENABLE, "0")
    results = run_threaded(lambda p: _create(p, reference_oneshot()), Topology(tp=2))
    assert [ws for ws, _ in results] == [None, None] and results[0][1] == "LAYER_BOUNDARY_CUTEDSL_ONESHOT=0"
    monkeypatch.setenv(oneshot.ENV_ENABLE, "1")
    monkeypatch.setenv(oneshot.ENV_MAX_TOKENS, "4")
    results = run_threaded(lambda p: _create(p, reference_oneshot(), max_tokens=64), Topology(tp=2))
    assert [ws.capacity for ws, _ in results] == [4, 4]
    for ws, _ in results:
        ws.release(barrier=False)


def test_ranks_in_one_process_are_refused_for_cuda_ipc():
    """CUDA IPC maps between processes: a threaded world with the CUDA backend's process ids
    (all the same) gets no workspace, on every rank."""
    kernels = replace(reference_oneshot(), process_id=lambda: 4242)
    results = run_threaded(lambda p: _create(p, kernels), Topology(tp=2))
    assert all(ws is None and "share a process" in why for ws, why in results)


# ------------------------------------------------------------------------------ the protocol


def _launches(parallel, counts, *, delay_rank=None, max_ctas=None):
    """Several one-shot calls with changing token counts on one workspace: each against float64."""
    ws, why = _create(parallel, reference_oneshot(), max_tokens=max(counts), hidden=32)
    assert ws is not None, why
    gen = torch.Generator().manual_seed(1)
    errors = []
    for i, tokens in enumerate(counts):
        parts = [torch.randn(tokens, 32, generator=gen, dtype=torch.float64) for _ in range(ws.world)]
        residual = torch.randn(tokens, 32, generator=gen, dtype=torch.float64)
        gamma = torch.rand(32, generator=gen, dtype=torch.float64) + 0.5
        if delay_rank == parallel.rank and i % 2 == 0:
            time.sleep(0.05)
        normed, res = ws.all_reduce_add_rmsnorm(parts[parallel.rank], residual, gamma, 1e-6)
        want_normed, want_res = add_rmsnorm_reference(sum(parts), residual, gamma, 1e-6)
        errors.append(max((normed - want_normed).abs().max().item(), (res - want_res).abs().max().item()))
    epoch = int(ws.state[0])
    ws.release()
    return errors, epoch


@pytest.mark.parametrize("tp", [2, 4])
def test_protocol_over_many_calls_and_a_late_rank(tp):
    counts = [1, 7, 16, 3, 16, 1, 9]
    results = run_threaded(_launches, Topology(tp=tp), counts, delay_rank=tp - 1)
    for errors, epoch in results:
        assert max(errors) < 1e-12 and epoch == len(counts)


def test_a_rank_that_never_launches_times_out(monkeypatch):
    monkeypatch.setenv(oneshot.ENV_TIMEOUT, "0.5")

    def rank(parallel):
        ws, _ = _create(parallel, reference_oneshot())
        try:
            if parallel.rank == 0:
                with pytest.raises(oneshot.OneShotTimeout, match="did not publish call 1 within 0.5 s"):
                    ws.all_reduce_add_rmsnorm(torch.ones(2, 32, dtype=torch.float64), torch.ones(2, 32, dtype=torch.float64), torch.ones(32, dtype=torch.float64), 1e-6)
        finally:
            ws.release()

    run_threaded(rank, Topology(tp=2))


def test_timeout_report_reads_the_kernels_words():
    ws = oneshot.OneShotWorkspace.__new__(oneshot.OneShotWorkspace)
    ws.ranks = (0, 1)
    words = [1, 1, 0, 5, 17, 16, 30_500_000_000, 0]
    ws.diag = type("W", (), {"read": lambda self: words})()
    assert ws.report().startswith("one-shot all-reduce on rank 1 of (0, 1): waited 30.5 s for rank 0's row 5 of call 17 (its flag says 16)")
    with pytest.raises(oneshot.OneShotTimeout):
        ws.check()
    words[0] = 0
    assert ws.report() is None


# ------------------------------------------------------------------------------ the service


def _service_rank(parallel, x, max_tokens=8, memory=None):
    calls = []
    kernels = reference_kernels(calls, oneshot=reference_oneshot(calls, memory=memory))
    model = GridModel(SPEC, parallel, fusions=CuteDSLFusion(kernels=kernels))
    service = install_cutedsl_fusion(model, terminal_finalize=True, final_norm=model.final_norm)
    prepare_cutedsl_fusion(model, max_tokens=max_tokens)
    with torch.inference_mode():
        out = _run(model, Forward(parallel, x.shape[0]), x, handoff_norm=service)
    held = service.oneshot
    release_cutedsl_fusion(model)
    return out, _names(calls), held is not None, service.oneshot_reason, held.launches if held else 0


@pytest.mark.parametrize("tp", [2, 4])
def test_the_service_runs_every_tp_boundary_as_one_launch(tp):
    """Both MoE finalizes (the next input's and the terminal one) and every attention partial
    sum: one one-shot launch each, nothing of the three-launch path, output = float64 reference."""
    x = grid_inputs(SPEC, [TOKENS])[0]
    results = run_threaded(_service_rank, Topology(tp=tp), x)
    for out, names, held, why, launches in results:
        assert held, why
        assert torch.allclose(out, _want(), rtol=1e-12, atol=1e-12)
        assert "moe_finalize" not in names and "fused_add_rmsnorm" not in names
        assert names.count("oneshot_moe_finalize_all_reduce_add_rmsnorm") == 2
        assert names.count("oneshot_all_reduce_add_rmsnorm") == 4  # after each attention and the dense FFN
        assert launches == 6
    assert all(r[1] == results[0][1] for r in results)


def test_beyond_the_workspace_every_rank_takes_the_old_path():
    """A batch larger than the one-shot capacity (and than the service's max_tokens) is the same
    fact on every rank: no one-shot launch anywhere, and the output is still right."""
    x = grid_inputs(SPEC, [TOKENS])[0]
    for out, names, held, _, launches in run_threaded(_service_rank, Topology(tp=2), x, 4):
        assert held and launches == 0 and "oneshot_all_reduce_add_rmsnorm" not in names
        assert torch.allclose(out, _want(), rtol=1e-12, atol=1e-12)


def test_one_rank_that_cannot_map_turns_the_one_shot_off_everywhere():
    x = grid_inputs(SPEC, [TOKENS])[0]

    def rank(parallel):
        memory = (lambda: FakePeerMemory(fail="open")) if parallel.rank == 1 else FakePeerMemory
        return _service_rank(parallel, x, memory=memory)

    results = run_threaded(rank, Topology(tp=2))
    for out, names, held, why, launches in results:
        assert not held and why and launches == 0
        assert names.count("moe_finalize") == 2  # the three-launch path, on both ranks
        assert torch.allclose(out, _want(), rtol=1e-12, atol=1e-12)


def test_local_tensor_layout_never_makes_a_rank_decline():
    """Rank 1's partial and residual are strided views, rank 0's are not: both still launch (the
    strided rank copies), so neither is left waiting."""
    def rank(parallel):
        calls = []
        kernels = reference_kernels(calls, oneshot=reference_oneshot(calls))
        ws, _ = _create(parallel, kernels.oneshot, max_tokens=8, hidden=16)
        group = parallel.groups["tp"]
        gen = torch.Generator().manual_seed(3)
        parts = [torch.randn(5, 16, generator=gen, dtype=torch.float64) for _ in range(2)]
        residual = torch.randn(5, 16, generator=gen, dtype=torch.float64)
        mine, res = parts[parallel.rank], residual
        if parallel.rank == 1:
            mine = torch.stack([mine, mine], -1)[..., 0]  # same values, stride 2
            res = torch.stack([residual, residual], -1)[..., 0]
            assert not mine.is_contiguous()
        gamma = torch.ones(16, dtype=torch.float64)
        got = oneshot.all_reduce_add_norm(ws, UnreducedOutput(mine, group, group, declared=True), res, gamma, 0.0, 1e-6)
        ws.release()
        assert got is not None
        want = add_rmsnorm_reference(sum(parts), residual, gamma, 1e-6)
        return all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(got, want))

    assert run_threaded(rank, Topology(tp=2)) == [True, True]


def test_handoff_layouts():
    """A dense handoff is one MoE launch (expanded weights are copied); another group, a wrong
    width or too many tokens decline on every rank alike."""
    def rank(parallel):
        calls = []
        kernels = reference_oneshot(calls)
        ws, _ = _create(parallel, kernels, max_tokens=8, hidden=16)
        group = parallel.groups["tp"]
        gen = torch.Generator().manual_seed(4)
        rows = [torch.randn(3, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2)]
        weights = torch.rand(1, 2, generator=gen, dtype=torch.float64).expand(3, 2)
        residual = torch.randn(3, 16, generator=gen, dtype=torch.float64)
        gamma = torch.ones(16, dtype=torch.float64)
        handoff = MoeFinalizeHandoff(rows[parallel.rank], weights, None, None, group, None)
        got = oneshot.finalize_add_norm(ws, handoff, residual, gamma, 0.0, 1e-6)
        total = sum(moe_finalize_reference(r, None, weights, None) for r in rows)
        ok = torch.allclose(got[1], total + residual, rtol=1e-12, atol=1e-12)
        other = type("G", (), {"ranks": (5, 6), "size": 2})()
        declined = [
            oneshot.finalize_add_norm(ws, MoeFinalizeHandoff(rows[0], weights, None, None, other, None), residual, gamma, 0.0, 1e-6),
            oneshot.finalize_add_norm(ws, handoff, torch.randn(3, 8, dtype=torch.float64), gamma, 0.0, 1e-6),
            oneshot.finalize_add_norm(ws, handoff, torch.randn(9, 16, dtype=torch.float64), gamma, 0.0, 1e-6),
            oneshot.finalize_add_norm(None, handoff, residual, gamma, 0.0, 1e-6),
        ]
        ws.release()
        return ok, declined, [c[0] for c in calls if c[0] != "oneshot_prepare"]

    for ok, declined, names in run_threaded(rank, Topology(tp=2)):
        assert ok and declined == [None] * 4 and names == ["oneshot_moe_finalize_all_reduce_add_rmsnorm"]


# ------------------------------------------------------------------------------ gloo processes


def _gloo_rank(parallel):
    """In separate processes a fake handle cannot be opened (the registry is per process): every
    rank falls back together, over real gloo process groups, and the output is right."""
    x = grid_inputs(SPEC, [TOKENS])[0]
    out, names, held, why, _ = _service_rank(parallel, x)
    return out, names, held, why


def test_gloo_world_falls_back_together_when_mapping_fails(gloo_world):
    results = gloo_world(2).run(_gloo_rank, Topology(tp=2))
    for out, names, held, why in results:
        assert not held and why
        assert names.count("moe_finalize") == 2 and torch.allclose(out, _want(), rtol=1e-12, atol=1e-12)
    assert "mapping a peer's buffer failed: KeyError" in results[0][3] or "mapping a peer's buffer failed: KeyError" in results[1][3]


# ------------------------------------------------------------------------------ the GPU checks, dry


@pytest.fixture
def dry_checks(monkeypatch):
    """allreduce_checks on CPU ranks: the reference protocol over fake peer memory, the float64
    references as the unfused kernels, an eager "graph". Catches mistakes in the checks (and their
    bounds) before they cost GPU time."""
    from . import allreduce_checks as checks

    ref = reference_kernels()
    monkeypatch.setattr(checks, "KERNELS", reference_oneshot())
    monkeypatch.setattr(checks, "use_rank_device", lambda parallel: torch.device("cpu"))
    monkeypatch.setattr(checks, "rank_device", lambda rank: None)
    monkeypatch.setattr(checks, "_capture", lambda step: step)
    monkeypatch.setattr(checks, "_unfused", lambda: (ref.fused_add_rmsnorm, ref.moe_finalize))
    return checks


def _dry(checks, fn, tp, *args, **kwargs):
    rows = [row for rank_rows in run_threaded(getattr(checks, fn), Topology(tp=tp), *args, **kwargs) for row in rank_rows]
    assert rows and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    for case in {r["case"] for r in rows}:
        assert len({r["digest"] for r in rows if r["case"] == case}) == 1, case
    return rows


@pytest.mark.parametrize("tp", [2, 4])
def test_gpu_checks_pass_dry(dry_checks, tp):
    rows = _dry(dry_checks, "check_boundary", tp, "bf16", 256, 0.0, (1, 7, 40))
    assert len(rows) == 3 * tp and max(r["vs_unfused"] for r in rows) < 1
    _dry(dry_checks, "check_boundary", tp, "fp16", 128, 1.0, (5,), max_ctas=[3] * tp)
    _dry(dry_checks, "check_moe", tp, 128, 4, True, (3, 9))
    _dry(dry_checks, "check_moe", tp, 128, 2, False, (3,), 1.0)
    rows = _dry(dry_checks, "check_graph", tp, 128, 4, 2)
    assert len(rows) == 2 * 2 * tp and all(r["detail"] == "replay == eager" for r in rows)
    _dry(dry_checks, "check_delayed", tp, tp - 1, 0.05, 128, 3)
    rows = _dry(dry_checks, "check_release", tp, 128, 64)
    assert all(f"{tp} buffer(s)" in r["detail"] for r in rows)


def test_the_checks_see_a_wrong_result(dry_checks, monkeypatch):
    """A kernel that forgets one rank's partial fails the bound (the checks can fail)."""
    ref = reference_oneshot()

    def wrong(ws, partial, residual, gamma, eps, *, weight_offset=0.0, out=None, residual_out=None):
        normed, res = ref.all_reduce_add_rmsnorm(ws, partial, residual, gamma, eps, weight_offset=weight_offset)
        return normed, (res.double() - partial.double() * (ws.rank == 0)).to(res.dtype)

    monkeypatch.setattr(dry_checks, "KERNELS", replace(ref, all_reduce_add_rmsnorm=wrong))
    rows = [r for rank_rows in run_threaded(dry_checks.check_boundary, Topology(tp=2), "bf16", 128, 0.0, (4,)) for r in rank_rows]
    assert [r["ok"] for r in rows] == [False, True] and rows[0]["err_residual"] > 1


def test_libcuda_symbols_are_bound_with_their_signatures(monkeypatch):
    """Every driver function gets its C signature; a missing cuIpcOpenMemHandle_v2 falls back
    to the older name, any other missing symbol is an error (then the group falls back)."""
    from layer_boundary_cutedsl import peer_memory

    class Fn:
        argtypes = restype = None

    class Lib:
        def __init__(self, missing):
            for name in peer_memory._SIGNATURES:
                if name not in missing:
                    setattr(self, name, Fn())
            self.cuIpcOpenMemHandle = Fn()

    monkeypatch.setattr(peer_memory, "_driver", None)
    monkeypatch.setattr(peer_memory.ctypes, "CDLL", lambda name: Lib({"cuIpcOpenMemHandle_v2"}))
    lib = peer_memory._load_driver()
    assert lib.cuIpcOpenMemHandle_v2 is lib.cuIpcOpenMemHandle
    assert lib.cuIpcOpenMemHandle_v2.argtypes == peer_memory._SIGNATURES["cuIpcOpenMemHandle_v2"]
    assert all(getattr(lib, n).restype is ctypes.c_int for n in peer_memory._SIGNATURES)
    monkeypatch.setattr(peer_memory, "_driver", None)
    monkeypatch.setattr(peer_memory.ctypes, "CDLL", lambda name: Lib({"cuMemAlloc_v2"}))
    with pytest.raises(peer_memory.CudaError, match="exports no cuMemAlloc_v2"):
        peer_memory._load_driver()


# ------------------------------------------------------------------------------ the model, TP=2


def test_the_model_runs_every_tp_boundary_one_shot():
    """qwen3_moe (a dense layer, a shared expert, a Gemma final norm) at TP=2 on CPU ranks with
    the reference one-shot: what test_model_gpu.py's TP=2 test expects of the real kernels."""
    from layer_boundary_models import family, model_config

    from .decoder_driver import MOE_CONFIG, max_rel_diff, requests, run_decoder

    config = model_config("qwen3_moe", MOE_CONFIG)
    state = family("qwen3_moe").random_weights(config, torch.float64, seed=5)
    prompts, decode = requests(config)
    off, _, _ = run_decoder(Parallel.single(), MOE_CONFIG, state, prompts, decode, dtype=torch.float64)
    calls = {}

    def rank(parallel):
        mine = calls.setdefault(parallel.rank, [])
        kernels = reference_kernels(mine, oneshot=reference_oneshot(mine))
        logits, service, _ = run_decoder(parallel, MOE_CONFIG, state, prompts, decode, dtype=torch.float64, cutedsl={"kernels": kernels})
        held = service.oneshot is not None
        service.release()
        return logits, held

    for logits, held in run_threaded(rank, Topology(tp=2)):
        assert held and max_rel_diff(logits, off) < 1e-5
    names = [[c[0] for c in calls[r] if not c[0].endswith("prepare")] for r in sorted(calls)]
    assert names[0] == names[1]
    steps, sparse = 1 + len(decode), len(config.sparse_layers)
    assert names[0].count("oneshot_moe_finalize_all_reduce_add_rmsnorm") == sparse * steps  # the terminal one included
    assert names[0].count("oneshot_all_reduce_add_rmsnorm") == (config.num_layers + config.num_layers - sparse) * steps
    assert "moe_finalize" not in names[0] and "fused_add_rmsnorm" not in names[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer of the subprocess plumbing")
def test_timeout_check_subprocess_plumbing():
    """The trap check's subprocess imports the plugin and runs the check; without a GPU it fails
    at the first CUDA call, and that comes back as a message (not a hang, not a parse error)."""
    from .allreduce_checks import check_timeout_in_subprocess

    row, problem = check_timeout_in_subprocess(2.0, limit=120.0)
    assert row is None and problem.startswith("exit 1:") and "SyntaxError" not in problem and "ModuleNotFoundError" not in problem, problem


def test_a_trapped_check_says_what_the_kernel_waited_for():
    from .allreduce_checks import _with_report

    class Ws:
        def __init__(self, report):
            self.report = lambda: report

    plain = RuntimeError("CUDA error: unspecified launch failure")
    assert _with_report(Ws(None), plain) is plain
    wrapped = _with_report(Ws("one-shot all-reduce on rank 1 of (0, 1): waited 30.0 s for rank 0's row 3"), plain)
    assert "unspecified launch failure" in str(wrapped) and "waited 30.0 s for rank 0's row 3" in str(wrapped)
    assert wrapped.__cause__ is plain


def test_the_one_shot_launch_reads_the_bound_kernel_it_is_given(monkeypatch):
    """The one-shot launch takes the launcher and SM count off the shared `BoundKernel` by name
    (a positional unpacking would break whenever the record gains a field, on the GPU only):
    a persistent grid of min(rows, SMs, max_ctas) CTAs, the peers' addresses, then the stream."""
    from types import SimpleNamespace

    from layer_boundary_cutedsl.kernels import _launch, allreduce

    calls = []
    bound = _launch.BoundKernel(lambda *args: calls.append(args), rows_per_cta=1, sms=132, loops=True)
    monkeypatch.setattr(allreduce, "_entry", lambda variant, device: bound)
    monkeypatch.setattr(allreduce, "_raw_stream", lambda index: 0x5150)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    peers = SimpleNamespace(capacity=512, addresses=[0x100, 0x200], state=torch.zeros(4), diag_address=0x300, buffer=0x400,
                            max_ctas=None, rank=1)
    device = torch.device("cuda", 0)
    allreduce._launch("variant", peers, 300, [1, 2, 3], 1e-6, device)
    peers.max_ctas = 3
    allreduce._launch("variant", peers, 7, [1, 2, 3], 1e-6, device)
    assert [c[-2:] for c in calls] == [(132, 0x5150), (3, 0x5150)]
    assert calls[0][:3] == (1, 2, 3) and calls[0][-6:-2] == (300, 1, 512, 1e-6)
    with pytest.raises(ValueError, match="do not fit the one-shot workspace"):
        allreduce._launch("variant", peers, 513, [1, 2, 3], 1e-6, device)
