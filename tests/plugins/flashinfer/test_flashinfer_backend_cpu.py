"""The FlashInfer backend against the installed flashinfer-python's sources (no GPU): the compiled
ops' argument lists the eager fast path passes positionally, the public API it relies on, and
what the bound launchers pass (with the compiled op replaced by a recorder)."""

import ast
import inspect
import textwrap
import types
from pathlib import Path

import pytest
import torch

from layer_boundary_flashinfer import backend as backend_module
from layer_boundary_flashinfer.backend import ALL_REDUCE_OP_PARAMS, FINALIZE_OP_PARAMS, FlashInferBackend, oneshot_table

flashinfer = pytest.importorskip("flashinfer")
comm = pytest.importorskip("flashinfer.comm")
trtllm_ar = pytest.importorskip("flashinfer.comm.trtllm_ar")


def test_the_pinned_flashinfer_is_installed():
    assert flashinfer.__version__ == "0.7.2.post1"


def _nested(name):
    """(parameters, names passed on to the compiled module) of the op `get_trtllm_comm_module` wraps."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(trtllm_ar.get_trtllm_comm_module)))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    call = next(n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == name)
    return tuple(a.arg for a in fn.args.args), tuple(a.id for a in call.args)


def _cpp_params(path: Path, name: str) -> list:
    """Parameter names of the C++ function `name` (template arguments may contain commas)."""
    text = path.read_text()
    start = text.index(f"void {name}(")
    signature = text[start : text.index("{", start)]
    inner = signature[signature.index("(") + 1 : signature.rindex(")")]
    depth, parts, current = 0, [], ""
    for ch in inner:
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p.split()[-1] for p in parts if p.strip()]


@pytest.mark.parametrize("name,expected", [("trtllm_allreduce_fusion", ALL_REDUCE_OP_PARAMS),
                                           ("trtllm_moe_finalize_allreduce_fusion", FINALIZE_OP_PARAMS)])
def test_the_compiled_ops_take_the_arguments_the_fast_path_passes(name, expected):
    params, passed = _nested(name)
    assert params == expected and passed == params  # the wrapper forwards them in order
    csrc = Path(flashinfer.__file__).parent / "data" / "csrc"
    source = csrc / ("trtllm_allreduce_fusion.cu" if name == "trtllm_allreduce_fusion" else "trtllm_moe_allreduce_fusion.cu")
    cpp = _cpp_params(source, name)  # the TVM-FFI function the wrapper calls
    assert [{"hidden_size": "hidden_dim"}.get(p, p) for p in cpp] == list(expected)


def test_the_public_api_the_plugin_relies_on():
    create = inspect.signature(comm.create_allreduce_fusion_workspace).parameters
    for p in ("backend", "world_size", "rank", "max_token_num", "hidden_dim", "dtype", "group"):
        assert p in create
    sufficient = list(inspect.signature(comm.allreduce.TRTLLMAllReduceFusionWorkspace.is_buffer_size_sufficient).parameters)
    assert sufficient[:5] == ["self", "tp_size", "num_tokens", "hidden_dim", "dtype"]
    assert callable(comm.allreduce.TRTLLMAllReduceFusionWorkspace.destroy)
    assert comm.AllReduceFusionPattern.kARResidualRMSNorm == 1 and comm.AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm == 7
    fusion = inspect.signature(comm.allreduce_fusion).parameters
    for p in ("weight_bias", "use_oneshot", "fp32_acc", "expanded_idx_to_permuted_idx", "expert_scale_factor", "shared_expert_output"):
        assert p in fusion
    assert callable(trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion)
    assert backend_module.MAX_COMM_SIZE == trtllm_ar.MAX_COMM_SIZE


def _slot(dtype=torch.bfloat16):
    ws = types.SimpleNamespace(world_size=2, rank=1, workspace_tensor=torch.arange(7, dtype=torch.int64))
    ordered = []
    return types.SimpleNamespace(workspace=ws, dtype=dtype, order=lambda: ordered.append(1), ordered=ordered)


def _recorder(params, calls):
    """A function with exactly `params` that records its arguments by name."""
    namespace = {"calls": calls}
    exec(f"def op({', '.join(params)}):\n    calls.append(dict(zip({params!r}, ({', '.join(params)},))))", namespace)
    return namespace["op"]


def _recording(monkeypatch, name, params):
    """(calls, backend, slot): the trtllm_comm module's op `name` replaced by a recorder of `params`."""
    calls = []
    module = types.SimpleNamespace(**{name: _recorder(params, calls)})
    monkeypatch.setattr(trtllm_ar, "get_trtllm_comm_module", lambda: module)
    return calls, FlashInferBackend(), _slot()


def test_the_bound_launcher_calls_the_compiled_op_with_everything_resolved(monkeypatch):
    calls, backend, slot = _recording(monkeypatch, "trtllm_allreduce_fusion", ALL_REDUCE_OP_PARAMS)
    gamma = torch.randn(64)
    launch = backend.bind_all_reduce(slot, gamma, 1e-5, 1.0, 64, 300)
    assert backend.fast_path == {"all_reduce": True}
    table = oneshot_table(300, 64, torch.bfloat16, 2)
    for tokens in (1, 2, 3, 300):
        x, residual = torch.randn(tokens, 64), torch.randn(tokens, 64)
        normed, new_residual = launch(x, residual, tokens)
        got = calls[-1]
        assert got["allreduce_in"] is x and got["residual_in"] is residual
        assert got["norm_out"] is normed and got["residual_out"] is new_residual and normed is not new_residual
        assert (got["world_size"], got["world_rank"], got["token_num"], got["hidden_dim"]) == (2, 1, tokens, 64)
        assert got["workspace_ptrs"] is slot.workspace.workspace_tensor and got["rms_gamma"] is gamma
        assert got["use_oneshot"] is table[tokens] and got["pattern_code"] == 1
        assert got["launch_with_pdl"] is True and got["trigger_completion_at_end"] is True and got["fp32_acc"] is True
        assert got["rms_eps"] == 1e-5 and got["weight_bias"] == 1.0
        for unused in ("allreduce_out", "quant_out", "scale_out", "scale_factor", "layout_code", "block_quant_group_size"):
            assert got[unused] is None
    assert len(slot.ordered) == 4  # every launch is ordered against launches from other streams first


def test_another_compiled_signature_falls_back_to_the_public_api(monkeypatch):
    module = types.SimpleNamespace(trtllm_allreduce_fusion=lambda *args: pytest.fail("positional call on an unknown signature"))
    monkeypatch.setattr(trtllm_ar, "get_trtllm_comm_module", lambda: module)
    calls = []
    monkeypatch.setattr(comm, "allreduce_fusion", lambda **kw: calls.append(kw))
    monkeypatch.setenv("LAYER_BOUNDARY_FLASHINFER_PDL", "0")
    backend, slot = FlashInferBackend(), _slot()
    launch = backend.bind_all_reduce(slot, torch.ones(64), 1e-6, 0.0, 64, 8)
    assert backend.fast_path == {"all_reduce": False}
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    normed, new_residual = launch(x, residual, 5)
    (kw,) = calls
    assert kw["input"] is x and kw["workspace"] is slot.workspace and kw["pattern"] == 1 and kw["launch_with_pdl"] is False
    assert kw["norm_out"] is normed and kw["residual_out"] is new_residual and kw["residual_in"] is residual
    assert kw["use_oneshot"] is True and kw["trigger_completion_at_end"] is True and kw["weight_bias"] == 0.0


def test_the_bound_finalize_launcher_passes_an_identity_expert_map(monkeypatch):
    calls, backend, slot = _recording(monkeypatch, "trtllm_moe_finalize_allreduce_fusion", FINALIZE_OP_PARAMS)
    gamma = torch.randn(32)
    launch = backend.bind_finalize(slot, gamma, 1e-6, 0.0, 32, 2048)
    assert launch.max_tokens == 128 and backend.fast_path == {"finalize": True}
    for tokens, k in ((3, 2), (5, 8), (3, 2)):
        rows, scales = torch.randn(tokens, k, 32), torch.rand(tokens, k)
        shared, residual = torch.randn(tokens, 32), torch.randn(tokens, 32)
        normed, new_residual = launch(rows, scales, shared, residual)
        got = calls[-1]
        index = got["expanded_idx_to_permuted_idx"]
        assert index.dtype == torch.int32 and index.shape == (tokens, k)
        assert torch.equal(index.long(), torch.arange(tokens * k).view(tokens, k))
        assert got["allreduce_in"].shape == (tokens * k, 32) and got["allreduce_in"].data_ptr() == rows.data_ptr()
        assert got["expert_scale_factor"] is scales and got["shared_expert_output"] is shared and got["residual_in"] is residual
        assert got["norm_out"] is normed and got["residual_out"] is new_residual and got["norm_weight"] is gamma
        assert (got["world_rank"], got["world_size"], got["eps"], got["weight_bias"]) == (1, 2, 1e-6, 0.0)
        assert got["workspace"] is slot.workspace.workspace_tensor and got["routed_scaling_factor"] is None
        assert got["quant_out"] is None and got["scale_out"] is None
    assert calls[0]["expanded_idx_to_permuted_idx"] is calls[2]["expanded_idx_to_permuted_idx"]  # resolved once per shape


class _Mapping:
    """Stands in for a SymmDeviceMemory: alive while anything references it."""


def _released(monkeypatch):
    """A TRTLLMAllReduceFusionWorkspace laid out as flashinfer 0.7.2 builds it, with weak
    references to its mappings, and the frees `destroy` issues."""
    import weakref

    from flashinfer.comm import cuda_ipc

    freed = []
    monkeypatch.setattr(cuda_ipc, "cudart", types.SimpleNamespace(cudaFree=lambda ptr: freed.append(ptr.value)))
    mappings = [_Mapping(), _Mapping(), _Mapping()]
    handles = [[11, 12], [21, 22], [31, 32]]
    flag_ptr = 0xABC000
    table = torch.tensor([p for h in handles for p in h] + [flag_ptr], dtype=torch.int64)
    ws = comm.allreduce.TRTLLMAllReduceFusionWorkspace.__new__(comm.allreduce.TRTLLMAllReduceFusionWorkspace)
    ws.world_size, ws.rank = 2, 0
    ws._internal_workspace = (handles, table, mappings, {"control_flag_ptr": flag_ptr})
    ws.ipc_handles, ws.workspace_tensor, ws.mem_handles, ws.metadata = handles, table, mappings, {}
    trtllm_ar._symm_workspace_refs[id(handles)] = list(mappings)
    refs = [weakref.ref(m) for m in mappings]
    del mappings, handles, table
    return ws, refs, freed, flag_ptr


def test_destroy_drops_every_mapping_and_frees_the_flag_buffer(monkeypatch):
    ws, refs, freed, flag_ptr = _released(monkeypatch)
    FlashInferBackend().destroy(ws)
    del ws
    assert all(r() is None for r in refs), "a mapping outlived release"
    assert freed == [flag_ptr]


def test_flashinfers_own_destroy_keeps_the_mappings_alive(monkeypatch):
    """What `destroy` works around (if flashinfer fixes it, this test says so)."""
    ws, refs, _, _ = _released(monkeypatch)
    handles = ws.ipc_handles
    ws.destroy()
    trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(handles)
    assert all(r() is not None for r in refs)


def test_launches_from_another_stream_wait_for_the_previous_one(monkeypatch):
    """Two-batch overlap launches from two streams: the second waits for what the first queued."""
    from layer_boundary_flashinfer import ordering

    class Stream:
        def __init__(self, name):
            self.name, self.waited = name, []

        def wait_event(self, event):
            self.waited.append(event.recorded_on)

    class Event:
        def record(self, stream):
            self.recorded_on = stream.name

    streams = {"s0": Stream("s0"), "s1": Stream("s1")}
    current = ["s0"]
    capturing = [False]
    monkeypatch.setattr(ordering.torch.cuda, "current_stream", lambda: streams[current[0]])
    monkeypatch.setattr(ordering.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(ordering.torch.cuda, "Event", Event)
    order = ordering.LaunchOrder()
    order()
    order()  # the same stream: nothing to wait for
    current[0] = "s1"
    order()
    current[0] = "s0"
    order()
    assert streams["s1"].waited == ["s0"] and streams["s0"].waited == ["s1"] and order.waits == 2
    capturing[0] = True
    current[0] = "s1"
    order()  # the first launch in a capture does not wait for work outside it
    assert streams["s1"].waited == ["s0"] and order.waits == 2
    order.reset()
    assert order.stream is None
