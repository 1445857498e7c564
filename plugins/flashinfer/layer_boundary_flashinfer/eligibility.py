"""Where the FlashInfer fusion applies: rules every rank evaluates to the same answer.

Three levels, each decided from facts all ranks of a group share:

- the stage (`stage_reason`): from its frozen `StageDescription` only: a plain add arriving, a
  plain RMSNorm (or Gemma's `(1 + w)` RMSNorm) read, a sum owed over more than one rank, no
  attention DP, no expert parallelism (whose engines exchange tokens all-to-all), a width the
  kernels take;
- the device (`device_reason`): Hopper or Blackwell, FlashInfer importable. A device fact can
  differ between ranks, so the workspace manager agrees on it across the group;
- the batch (the candidates): 0 < tokens <= the workspace limit, the workspace's dtype.

Every `*_reason` returns None when the rule holds, else a short reason for reports.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import attrs
import torch

from layer_boundary import StageKind
from layer_boundary.plugin import env_flag

__all__ = [
    "ENABLE_ENV",
    "MAX_TOKENS_ENV",
    "PDL_ENV",
    "FINALIZE_ENV",
    "DEFAULT_MAX_TOKENS",
    "SUPPORTED_WORLD_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_CAPABILITY_MAJORS",
    "MAX_HIDDEN",
    "FusionSettings",
    "settings",
    "stage_reason",
    "finalize_stage_reason",
    "device_reason",
    "width_reason",
]

#: "0" switches the plugin's candidates off on every rank (set it identically everywhere)
ENABLE_ENV = "LAYER_BOUNDARY_FLASHINFER"
#: the default token limit of the workspaces (prepare_flashinfer_fusion's max_tokens wins)
MAX_TOKENS_ENV = "LAYER_BOUNDARY_FLASHINFER_MAX_TOKENS"
#: "0" launches without Programmatic Dependent Launch
PDL_ENV = "LAYER_BOUNDARY_FLASHINFER_PDL"
#: "0" keeps MoE finalize inside the MoE (no HandoffOutput for the fused finalize)
FINALIZE_ENV = "LAYER_BOUNDARY_FLASHINFER_FINALIZE"

#: the token limit SGLang and vLLM use for the fused all-reduce (oneshot covers it at TP=2)
DEFAULT_MAX_TOKENS = 2048
#: world sizes the trtllm fusion kernels are compiled for
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)
#: activation dtypes with a matching workspace (fp32 needs an fp32 Lamport workspace)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: SM90 (Hopper) and SM100-class (Blackwell data-centre) GPUs
SUPPORTED_CAPABILITY_MAJORS = (9, 10)
#: one-shot kernel: hidden / (16 bytes / 2 bytes) lanes over at most 1024 threads x 8 CTAs
MAX_HIDDEN = 65536


@attrs.frozen(kw_only=True)
class FusionSettings:
    """Process configuration. It must be identical on every rank, like every other setting that
    chooses a collective (set the variables for the whole job, not per rank)."""

    enabled: bool = True
    max_tokens: int = DEFAULT_MAX_TOKENS
    launch_with_pdl: bool = True
    #: accumulate the cross-rank sum in fp32 (one add at TP=2; exact-er at 4 and 8)
    fp32_acc: bool = True
    defer_finalize: bool = True


def settings() -> FusionSettings:
    raw = os.environ.get(MAX_TOKENS_ENV, "").strip()
    try:
        max_tokens = int(raw) if raw else DEFAULT_MAX_TOKENS
    except ValueError:
        raise ValueError(f"{MAX_TOKENS_ENV}={raw!r} is not an integer; set a token count such as 2048") from None
    if max_tokens < 1:
        raise ValueError(f"{MAX_TOKENS_ENV}={raw!r} must be at least 1")
    return FusionSettings(
        enabled=env_flag(ENABLE_ENV, True),
        max_tokens=max_tokens,
        launch_with_pdl=env_flag(PDL_ENV, True),
        defer_finalize=env_flag(FINALIZE_ENV, True),
    )


def width_reason(hidden: Optional[int]) -> Optional[str]:
    if hidden is None:
        return "the stage's norm has no hidden size"
    if hidden % 8:
        return f"hidden size {hidden} is not a multiple of 8 (16-byte vector lanes)"
    if hidden > MAX_HIDDEN:
        return f"hidden size {hidden} exceeds the one-shot kernel's {MAX_HIDDEN}"
    return None


def _topology_reason(topology) -> Optional[str]:
    if topology.attn_dp > 1:
        return f"attention DP (attn_dp={topology.attn_dp}): the boundary gathers rows, not one all-reduce"
    if topology.moe_ep > 1:
        return f"expert parallelism (moe_ep={topology.moe_ep}): engines exchange expert tokens all-to-all"
    return None


def _group_size(topology, sum_group) -> int:
    name = sum_group.group_name
    return topology.tp if name == "tp" else getattr(topology, name)


def stage_reason(description) -> Optional[str]:
    """Why the fused all-reduce + add + norm cannot complete this stage's input (None: it can)."""
    if description.incoming_sum is None:
        return "nothing is ever owed at this input"
    if not (description.plain_update and description.plain_read):
        return "the arriving update is not a plain add or the read is not a plain norm"
    if description.norm_kind not in ("rms", "gemma_rms"):
        return f"norm kind {description.norm_kind!r} is not an RMSNorm"
    size = _group_size(description.topology, description.incoming_sum)
    if size not in SUPPORTED_WORLD_SIZES:
        return f"the {description.incoming_sum.name} sum runs over {size} rank(s); the kernels need 2, 4, 8 or 16"
    return _topology_reason(description.topology) or width_reason(description.hidden_size)


def finalize_stage_reason(description) -> Optional[str]:
    """Why this FFN may not hand its MoE finalize to the next input (None: it may)."""
    if description.kind is not StageKind.FFN or not description.sparse:
        return "not a MoE FFN"
    if description.terminal:
        return "a terminal FFN's output goes to the final norm"
    if description.output_sum is None:
        return "the FFN's output owes no sum"
    size = _group_size(description.topology, description.output_sum)
    if size not in SUPPORTED_WORLD_SIZES:
        return f"the MoE output sums over {size} rank(s); the kernels need 2, 4, 8 or 16"
    return _topology_reason(description.topology) or width_reason(description.hidden_size)


def flashinfer_installed() -> bool:
    """Whether the flashinfer package can be found (without importing it)."""
    try:
        return importlib.util.find_spec("flashinfer") is not None
    except (ImportError, ValueError):
        return False


def device_reason(device) -> Optional[str]:
    """Why this rank's device cannot run the kernels (None: it can). Per rank: agree on it."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    index = torch.device(device).index if device is not None else None
    major, minor = torch.cuda.get_device_capability(index)
    if major not in SUPPORTED_CAPABILITY_MAJORS:
        return f"compute capability {major}.{minor} is neither Hopper (9.x) nor Blackwell (10.x)"
    if not flashinfer_installed():
        return "flashinfer-python is not installed"
    return None
