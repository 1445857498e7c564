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

from .eligibility import device_reason, settings
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
_ALLOCATION_GRANULARITY = 2 << 20


def _elem(dtype: torch.dtype) -> int:
    return 4 if dtype == torch.float32 else 2


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def workspace_bytes(spec: WorkspaceSpec, world: int) -> int:
    """This rank's physical allocation of a trtllm workspace: a two-shot buffer, barrier flags and
    three Lamport buffers (peers' buffers are only mapped)."""
    elem = _elem(spec.dtype)
    buffer = world * spec.max_tokens * spec.hidden * elem
    flags = world * 256 * 4
    lamport = 3 * min(world * spec.max_tokens * spec.hidden * elem, MAX_COMM_SIZE)
    return sum(_round_up(n, _ALLOCATION_GRANULARITY) for n in (buffer, flags, lamport))


def _oneshot(tokens: int, hidden: int, dtype: torch.dtype, world: int) -> bool:
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


def oneshot_table(limit: int, hidden: int, dtype: torch.dtype, world: int) -> list:
    """`table[t]`: launch one-shot for `t` tokens (index 0 unused). The same on every rank."""
    return [True] + [_oneshot(t, hidden, dtype, world) for t in range(1, limit + 1)]


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
        from flashinfer.comm.trtllm_ar import trtllm_destroy_ipc_workspace_for_all_reduce_fusion

        handles = getattr(workspace, "ipc_handles", None)
        workspace.destroy()
        if handles is not None:
            # destroy() drops the workspace's own references; the module keeps one more per
            # workspace until this call, which would keep the mappings alive until exit
            trtllm_destroy_ipc_workspace_for_all_reduce_fusion(handles)
        del workspace
        gc.collect()  # unmap now, while the CUDA context and the process group are alive

    # launchers -------------------------------------------------------------------------------
    def bind_all_reduce(self, slot, gamma, eps: float, weight_bias: float, hidden: int, limit: int) -> Callable:
        """`launch(x, residual, tokens) -> (normed, new_residual)`: sum x over the group, add the
        residual, RMSNorm, in one kernel. x and residual: contiguous [tokens, hidden]."""
        from flashinfer.comm.trtllm_ar import AllReduceFusionPattern, get_trtllm_comm_module

        ws = slot.workspace
        world, rank = int(ws.world_size), int(ws.rank)
        ptrs = ws.workspace_tensor
        opts = settings()
        pdl, acc = opts.launch_with_pdl, opts.fp32_acc
        pattern = int(AllReduceFusionPattern.kARResidualRMSNorm)
        table = oneshot_table(limit, hidden, slot.dtype, world)
        eps, bias = float(eps), float(weight_bias)
        empty_like = torch.empty_like
        op = get_trtllm_comm_module().trtllm_allreduce_fusion
        if _params(op) == ALL_REDUCE_OP_PARAMS:
            self.fast_path["all_reduce"] = True

            def launch(x, residual, tokens):
                norm_out = empty_like(residual)
                residual_out = empty_like(residual)
                op(x, world, rank, tokens, hidden, ptrs, pdl, table[tokens], True, acc, pattern,
                   None, residual, residual_out, norm_out, None, None, gamma, eps, None, None, None, bias)
                return norm_out, residual_out

            return launch

        from flashinfer.comm import allreduce_fusion

        self.fast_path["all_reduce"] = False

        def launch_public(x, residual, tokens):
            norm_out = empty_like(residual)
            residual_out = empty_like(residual)
            allreduce_fusion(
                input=x, workspace=ws, pattern=pattern, launch_with_pdl=pdl, trigger_completion_at_end=True,
                residual_out=residual_out, norm_out=norm_out, residual_in=residual, rms_gamma=gamma, rms_eps=eps,
                use_oneshot=table[tokens], fp32_acc=acc, weight_bias=bias,
            )
            return norm_out, residual_out

        return launch_public

    def bind_finalize(self, slot, gamma, eps: float, weight_bias: float, hidden: int, limit: int) -> Optional[Callable]:
        """`launch(rows, scales, shared, residual) -> (normed, new_residual)`: weight and sum each
        token's top-k expert rows (+ the shared expert), sum over the group, add, RMSNorm, in one
        kernel. rows: contiguous [tokens, k, hidden]; scales: [tokens, k] in the rows' dtype."""
        from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

        ws = slot.workspace
        world, rank = int(ws.world_size), int(ws.rank)
        ptrs = ws.workspace_tensor
        pdl = settings().launch_with_pdl
        eps, bias = float(eps), float(weight_bias)
        tokens_max = min(limit, FINALIZE_MAX_TOKENS)
        # row (t, j) of the [tokens * k, hidden] view is token t's j-th expert: the identity map,
        # and every prefix of one arange is that map for any k
        identity = torch.arange(tokens_max * MAX_TOP_K, dtype=torch.int32, device=ptrs.device)
        maps: dict = {}
        empty_like = torch.empty_like
        op = get_trtllm_comm_module().trtllm_moe_finalize_allreduce_fusion
        fast = _params(op) == FINALIZE_OP_PARAMS
        self.fast_path["finalize"] = fast
        if not fast:
            from flashinfer.comm import AllReduceFusionPattern, allreduce_fusion

            pattern = int(AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm)

        def launch(rows, scales, shared, residual):
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
