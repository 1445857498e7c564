"""The FlashInfer side: trtllm fusion workspaces and launchers bound once per stage.

Written against flashinfer-python 0.7.2.post1 (`flashinfer/comm/allreduce.py`, `trtllm_ar.py`,
`data/csrc/trtllm_allreduce_fusion.cu`, `trtllm_moe_allreduce_fusion.cu`). Importing this module
does not import flashinfer; every flashinfer import happens inside a method, on a GPU rank.

The eager fast path: FlashInfer's public `allreduce_fusion` spends tens of microseconds of
Python per call (type dispatch, flattening and contiguity checks, metadata validation, the
one-shot heuristic, a scratch allocation, a deprecation wrapper). A bound launcher resolves all
of that once: the workspace pointer table, world size and rank, the pattern, PDL and
accumulation flags, gamma, eps and the Gemma bias, and the one-shot choice for every token
count up to the limit; per call it allocates the two outputs and calls the compiled op with
positional arguments. If the installed FlashInfer's compiled op does not have the argument list
this was written for, the launcher uses the public API instead (slower, same kernels).
"""

from __future__ import annotations

import gc
import inspect
from typing import Callable, Optional

import torch

from .eligibility import device_reason, finalize_kernel_reason, finalize_kernel_version_reason, kernel_width_reason, settings
from .workspace import WorkspaceSpec

__all__ = [
    "FlashInferBackend",
    "ALL_REDUCE_OP_PARAMS",
    "FINALIZE_OP_PARAMS",
    "MAX_COMM_SIZE",
    "FINALIZE_MAX_TOKENS",
    "MAX_TOP_K",
    "oneshot_table",
    "workspace_bytes",
]

#: the compiled `trtllm_allreduce_fusion` op's parameters, in order (flashinfer 0.7.2.post1)
ALL_REDUCE_OP_PARAMS = (
    "allreduce_in", "world_size", "world_rank", "token_num", "hidden_dim", "workspace_ptrs",
    "launch_with_pdl", "use_oneshot", "trigger_completion_at_end", "fp32_acc", "pattern_code",
    "allreduce_out", "residual_in", "residual_out", "norm_out", "quant_out", "scale_out",
    "rms_gamma", "rms_eps", "scale_factor", "layout_code", "block_quant_group_size", "weight_bias",
)
#: the compiled `trtllm_moe_finalize_allreduce_fusion` op's parameters, in order
FINALIZE_OP_PARAMS = (
    "allreduce_in", "residual_in", "norm_weight", "expanded_idx_to_permuted_idx", "norm_out",
    "residual_out", "quant_out", "scale_out", "launch_with_pdl", "workspace", "world_rank",
    "world_size", "eps", "shared_expert_output", "expert_scale_factor", "routed_scaling_factor",
    "weight_bias",
)
#: one Lamport buffer's byte limit (INT32_MAX rounded down to 2 MiB), as in trtllm_ar.py
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)
#: the MoE finalize kernel is one-shot only and tuned up to this many tokens (kOneShotMaxToken)
FINALIZE_MAX_TOKENS = 128
#: experts per token the finalize index map covers (larger top-k finalizes in torch)
MAX_TOP_K = 64
#: per world size, the largest all-reduce (MiB, counted as flashinfer does) sent one-shot
_ONESHOT_MIB = {2: 512, 4: 64, 8: 42}
#: cuMemCreate's recommended granularity for device memory on Hopper (a GPU test measures the workspace)
ALLOCATION_GRANULARITY = 2 << 20
#: FlashInfer's symmetric device memory appends a signal pad to every buffer (kSIGNAL_PAD_SIZE)
SIGNAL_PAD_BYTES = 2048


def installed_version() -> Optional[str]:
    """flashinfer-python's version, from its metadata (no import)."""
    try:
        from importlib.metadata import version

        return version("flashinfer-python")
    except Exception:  # noqa: BLE001 - not installed, or installed without metadata
        return None


def _elem(dtype: torch.dtype) -> int:
    return 4 if dtype == torch.float32 else 2


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def workspace_bytes(spec: WorkspaceSpec, world: int, granularity: int = ALLOCATION_GRANULARITY) -> int:
    """This rank's physical allocation of a trtllm workspace (peers' buffers are only mapped):
    three allocations (a two-shot buffer, barrier flags, three Lamport buffers in one), each
    16-byte aligned, followed by a signal pad and rounded up to the allocation granularity, as
    FlashInfer 0.7.2's `SymmDeviceMemory` allocates them (TP=2, hidden 8192, 2048 tokens, bf16:
    262 MiB, of which 258 MiB are buffers)."""
    elem = _elem(spec.dtype)
    buffer = world * spec.max_tokens * spec.hidden * elem
    flags = world * 256 * 4
    lamport = 3 * min(world * spec.max_tokens * spec.hidden * elem, MAX_COMM_SIZE)
    return sum(_round_up(_round_up(n, 16) + SIGNAL_PAD_BYTES, granularity) for n in (buffer, flags, lamport))


def _oneshot(tokens: int, hidden: int, dtype: torch.dtype, world: int, algorithm: str = "auto") -> bool:
    if algorithm == "oneshot":
        return tokens * hidden * _elem(dtype) * world <= MAX_COMM_SIZE
    if algorithm == "twoshot":
        return tokens <= world  # two-shot splits tokens over ranks and needs more tokens than ranks
    elem = _elem(dtype)
    limit = _ONESHOT_MIB.get(world)
    # flashinfer's heuristic (B200-tuned, by message size); world sizes it has no entry for
    # follow the kernels' own 128-token one-shot guidance
    oneshot = tokens * hidden * 2 * world * elem / 2**20 <= limit if limit is not None else tokens <= FINALIZE_MAX_TOKENS
    if not oneshot and tokens <= world:
        oneshot = True  # two-shot splits tokens over ranks and needs more tokens than ranks
    if oneshot and tokens * hidden * elem * world > MAX_COMM_SIZE:
        oneshot = False  # a Lamport buffer cannot hold it
    return oneshot


def oneshot_table(limit: int, hidden: int, dtype: torch.dtype, world: int, algorithm: str = "auto") -> list:
    """`table[t]`: launch one-shot for `t` tokens (index 0 unused). The same on every rank."""
    return [True] + [_oneshot(t, hidden, dtype, world, algorithm) for t in range(1, limit + 1)]


def _workspace_of(slot) -> tuple:
    """(workspace, world size, this rank, its pointer table): what every launcher passes the op."""
    ws = slot.workspace
    return ws, int(ws.world_size), int(ws.rank), ws.workspace_tensor


def _params(fn) -> Optional[tuple]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


class FlashInferBackend:
    """trtllm workspaces (`backend="trtllm"`: IPC/NVLink peer mapping, no multicast)."""

    name = "flashinfer-trtllm"
    device_type = "cuda"

    def __init__(self):
        self.fast_path = {}  #: launcher kind -> True (compiled op) / False (public API), for reports

    # workspaces ------------------------------------------------------------------------------
    def probe(self, device, group=None) -> Optional[str]:
        reason = device_reason(device)
        if reason is not None:
            return reason
        if group is not None and getattr(group, "group", None) is None:
            return f"group {getattr(group, 'name', group)!r} is not a torch.distributed process group"
        try:
            from flashinfer.comm.trtllm_ar import get_trtllm_comm_module
        except Exception as exc:  # noqa: BLE001
            return f"import flashinfer.comm failed: {type(exc).__name__}: {exc}"
        try:
            # the first use JIT-compiles the trtllm_comm module (minutes): do it here, on each
            # rank, so that a failed build is agreed on before any rank enters a rendezvous
            with torch.cuda.device(torch.device(device)):
                get_trtllm_comm_module()
        except Exception as exc:  # noqa: BLE001
            return f"building FlashInfer's trtllm_comm module failed: {type(exc).__name__}: {exc}"
        return None

    def placement_reason(self, tensor) -> Optional[str]:
        return None if tensor.is_cuda else f"the norm weight is on {tensor.device}, not a CUDA device"

    def capability(self, device) -> Optional[tuple]:
        """This rank's (major, minor) compute capability; None without a CUDA device."""
        if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
            return None
        return tuple(torch.cuda.get_device_capability(torch.device(device)))

    def width_reason(self, hidden: int, dtype) -> Optional[str]:
        return kernel_width_reason(hidden, dtype)

    def finalize_reason(self, hidden: int, dtype) -> Optional[str]:
        return finalize_kernel_version_reason(installed_version()) or finalize_kernel_reason(hidden, dtype)

    def required_bytes(self, spec: WorkspaceSpec, world: int) -> int:
        return workspace_bytes(spec, world)

    def free_bytes(self, device) -> int:
        return torch.cuda.mem_get_info(torch.device(device))[0]

    def create(self, spec: WorkspaceSpec, group, device):
        import torch.distributed as dist
        from flashinfer.comm import create_allreduce_fusion_workspace

        pg = group.group
        with torch.cuda.device(torch.device(device)):
            return create_allreduce_fusion_workspace(
                backend="trtllm",  # never "auto"/"mnnvl": those want NVLink multicast
                world_size=dist.get_world_size(pg),
                rank=dist.get_rank(pg),
                max_token_num=spec.max_tokens,
                hidden_dim=spec.hidden,
                dtype=spec.dtype,
                group=pg,  # rendezvous over this group, not WORLD
            )

    def sufficient(self, workspace, spec: WorkspaceSpec, world: int) -> bool:
        return bool(workspace.is_buffer_size_sufficient(world, spec.max_tokens, spec.hidden, spec.dtype))

    def quiesce(self, device) -> None:
        torch.cuda.synchronize(torch.device(device))

    def destroy(self, workspace) -> None:
        """Free this rank's buffers and unmap its peers'. FlashInfer 0.7.2's `destroy()` deletes
        the wrapper's attributes but not the tuple it wraps, whose handles keep every mapping
        alive; its module keeps one more reference per workspace; and the 20-byte control flag
        buffer it `cudaMalloc`s is never freed. All three are dropped here."""
        from ctypes import c_void_p

        from flashinfer.comm.cuda_ipc import cudart
        from flashinfer.comm.trtllm_ar import trtllm_destroy_ipc_workspace_for_all_reduce_fusion

        handles = getattr(workspace, "ipc_handles", None)
        table = getattr(workspace, "workspace_tensor", None)
        # the pointer table ends with the control flags (see trtllm_create_ipc_workspace_for_all_reduce_fusion)
        flag_ptr = int(table[-1].item()) if table is not None and table.numel() else 0
        workspace.destroy()
        if handles is not None:
            trtllm_destroy_ipc_workspace_for_all_reduce_fusion(handles)
        if "_internal_workspace" in vars(workspace):
            vars(workspace)["_internal_workspace"] = None
        del workspace, handles, table
        gc.collect()  # unmap now, while the CUDA context and the process group are alive
        if flag_ptr:
            cudart.cudaFree(c_void_p(flag_ptr))

    # launchers -------------------------------------------------------------------------------
    def _compiled_op(self, kind: Optional[str], name: str, params: tuple) -> tuple:
        """(FlashInfer's compiled comm op `name`, whether it takes `params`: the fast path), the
        latter recorded as `fast_path[kind]` (where the launcher otherwise uses the public API)."""
        from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

        op = getattr(get_trtllm_comm_module(), name)
        fast = _params(op) == params
        if kind is not None:
            self.fast_path[kind] = fast
        return op, fast

    def bind_all_reduce(self, slot, gamma, eps: float, weight_bias: float, hidden: int, limit: int) -> Callable:
        """`launch(x, residual, tokens) -> (normed, new_residual)`: sum x over the group, add the
        residual, RMSNorm, in one kernel. x and residual: contiguous [tokens, hidden]."""
        from flashinfer.comm.trtllm_ar import AllReduceFusionPattern

        ws, world, rank, ptrs = _workspace_of(slot)
        opts = settings()
        pdl, acc = opts.launch_with_pdl, opts.fp32_acc
        pattern = int(AllReduceFusionPattern.kARResidualRMSNorm)
        table = oneshot_table(limit, hidden, slot.dtype, world, opts.algorithm)
        eps, bias = float(eps), float(weight_bias)
        empty_like = torch.empty_like
        op, fast = self._compiled_op("all_reduce", "trtllm_allreduce_fusion", ALL_REDUCE_OP_PARAMS)
        order = slot.order
        if fast:

            def launch(x, residual, tokens):
                order()
                norm_out = empty_like(residual)
                residual_out = empty_like(residual)
                op(x, world, rank, tokens, hidden, ptrs, pdl, table[tokens], True, acc, pattern,
                   None, residual, residual_out, norm_out, None, None, gamma, eps, None, None, None, bias)
                return norm_out, residual_out

            return launch

        from flashinfer.comm import allreduce_fusion

        def launch_public(x, residual, tokens):
            order()
            norm_out = empty_like(residual)
            residual_out = empty_like(residual)
            allreduce_fusion(
                input=x, workspace=ws, pattern=pattern, launch_with_pdl=pdl, trigger_completion_at_end=True,
                residual_out=residual_out, norm_out=norm_out, residual_in=residual, rms_gamma=gamma, rms_eps=eps,
                use_oneshot=table[tokens], fp32_acc=acc, weight_bias=bias,
            )
            return norm_out, residual_out

        return launch_public

    def bind_all_reduce_fp8(self, slot, gamma, eps: float, weight_bias: float, hidden: int, limit: int,
                            fmt: str, static_scale=None) -> Callable:
        """`launch(x, residual, tokens) -> (Fp8Input, new_residual)`: sum x over the group, add the
        residual, RMSNorm, then E4M3 (a fixed scale for "fp8_static": the kernel multiplies by
        1 / scale; per token for "fp8_dynamic": amax / 448, floored at the smallest subnormal's),
        in one kernel. FlashInfer quantizes the norm rounded to the activation dtype; the core's
        unfused read quantizes it in fp32, so a value on a rounding edge may land one E4M3 step apart."""
        from layer_boundary.plugin import FP8_DTYPE, Fp8Input

        ws, world, rank, ptrs = _workspace_of(slot)
        opts = settings()
        pdl, acc = opts.launch_with_pdl, opts.fp32_acc
        table = oneshot_table(limit, hidden, slot.dtype, world, opts.algorithm)
        eps, bias = float(eps), float(weight_bias)
        dtype, device = slot.dtype, ptrs.device
        if fmt == "fp8_static":
            pattern = 2  # kARResidualRMSNormFP8Quant
            if static_scale is None:
                raise ValueError("fp8_static needs the read's fixed scale")
            scale = torch.as_tensor(static_scale, dtype=torch.float32).to(device).reshape(1)
            scale_out_of = None
        elif fmt == "fp8_dynamic":
            pattern = 10  # kARResidualRMSNormDynamicFP8Quant (flashinfer >= 0.7)
            scale = None
            scale_out_of = lambda tokens: torch.empty((tokens, 1), dtype=torch.float32, device=device)  # noqa: E731
        else:
            raise ValueError(f"not an FP8 format: {fmt!r}")
        op, fast = self._compiled_op(None, "trtllm_allreduce_fusion", ALL_REDUCE_OP_PARAMS)
        if not fast:
            raise RuntimeError("the installed flashinfer's trtllm_allreduce_fusion takes other arguments; FP8 reads stay unfused")
        self.fast_path["all_reduce_fp8"] = True
        static_view = scale.reshape(()) if scale is not None else None
        empty, empty_like = torch.empty, torch.empty_like

        order = slot.order

        def launch(x, residual, tokens):
            order()
            quant = empty((tokens, hidden), dtype=FP8_DTYPE, device=device)
            residual_out = empty_like(residual)
            scale_out = scale_out_of(tokens) if scale_out_of is not None else None
            op(x, world, rank, tokens, hidden, ptrs, pdl, table[tokens], True, acc, pattern,
               None, residual, residual_out, None, quant, scale_out, gamma, eps, scale, None, None, bias)
            return Fp8Input(quant, static_view if scale_out is None else scale_out, dtype), residual_out

        launch.per_token = scale_out_of is not None  # the scale's shape: [tokens, 1], else 0-d
        return launch

    def bind_plain_all_reduce(self, slot) -> Callable:
        """`launch(rows) -> summed`: FlashInfer's plain all-reduce (`kAllReduce`) of a contiguous
        [tokens, width] tensor over the slot's group (rows x width within the workspace)."""
        from flashinfer.comm.trtllm_ar import AllReduceFusionPattern

        ws, world, rank, ptrs = _workspace_of(slot)
        opts = settings()
        pdl, acc, algorithm = opts.launch_with_pdl, opts.fp32_acc, opts.algorithm
        pattern = int(AllReduceFusionPattern.kAllReduce)
        choices: dict = {}
        empty_like = torch.empty_like
        op, fast = self._compiled_op("plain_all_reduce", "trtllm_allreduce_fusion", ALL_REDUCE_OP_PARAMS)
        if not fast:
            from flashinfer.comm import allreduce_fusion

        order = slot.order

        def launch(rows):
            order()
            tokens, width = rows.shape
            oneshot = choices.get((tokens, width))
            if oneshot is None:
                oneshot = choices[(tokens, width)] = _oneshot(tokens, width, rows.dtype, world, algorithm)
            out = empty_like(rows)
            if fast:
                op(rows, world, rank, tokens, width, ptrs, pdl, oneshot, True, acc, pattern,
                   out, None, None, None, None, None, None, None, None, None, None, None)
            else:
                allreduce_fusion(input=rows, workspace=ws, pattern=pattern, launch_with_pdl=pdl, output=out,
                                 use_oneshot=oneshot, trigger_completion_at_end=True, fp32_acc=acc)
            return out

        return launch

    def bind_finalize(self, slot, gamma, eps: float, weight_bias: float, hidden: int, limit: int) -> Optional[Callable]:
        """`launch(rows, scales, shared, residual) -> (normed, new_residual)`: weight and sum each
        token's top-k expert rows (+ the shared expert), sum over the group, add, RMSNorm, in one
        kernel. rows: contiguous [tokens, k, hidden]; scales: [tokens, k] in the rows' dtype."""
        ws, world, rank, ptrs = _workspace_of(slot)
        pdl = settings().launch_with_pdl
        eps, bias = float(eps), float(weight_bias)
        tokens_max = min(limit, FINALIZE_MAX_TOKENS)
        # row (t, j) of the [tokens * k, hidden] view is token t's j-th expert: the identity map,
        # and every prefix of one arange is that map for any k
        identity = torch.arange(tokens_max * MAX_TOP_K, dtype=torch.int32, device=ptrs.device)
        maps: dict = {}
        empty_like = torch.empty_like
        op, fast = self._compiled_op("finalize", "trtllm_moe_finalize_allreduce_fusion", FINALIZE_OP_PARAMS)
        if not fast:
            from flashinfer.comm import AllReduceFusionPattern, allreduce_fusion

            pattern = int(AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm)

        order = slot.order

        def launch(rows, scales, shared, residual):
            order()
            tokens, k = rows.shape[0], rows.shape[1]
            index = maps.get((tokens, k))
            if index is None:
                index = maps[(tokens, k)] = identity[: tokens * k].view(tokens, k)
            norm_out = empty_like(residual)
            residual_out = empty_like(residual)
            flat = rows.view(tokens * k, hidden)
            if fast:
                op(flat, residual, gamma, index, norm_out, residual_out, None, None, pdl, ptrs, rank, world, eps,
                   shared, scales, None, bias)
            else:
                allreduce_fusion(
                    input=flat, workspace=ws, pattern=pattern, launch_with_pdl=pdl, residual_out=residual_out,
                    norm_out=norm_out, residual_in=residual, rms_gamma=gamma, rms_eps=eps,
                    expanded_idx_to_permuted_idx=index, expert_scale_factor=scales, shared_expert_output=shared,
                    weight_bias=bias,
                )
            return norm_out, residual_out

        launch.max_tokens = tokens_max
        launch.max_top_k = MAX_TOP_K
        return launch
