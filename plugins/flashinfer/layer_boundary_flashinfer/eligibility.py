"""Where the FlashInfer fusion applies: rules every rank evaluates to the same answer.

Three levels, each decided from facts all ranks of a group share:

- the engine's enablement (`FlashInferSettings`, passed to `prepare_flashinfer_fusion`): backend
  `auto` / `trtllm` / `off` and the token limit, `auto` applying the walkthrough's rules;
- the stage (`stage_reason`): from its frozen `StageDescription` only: a plain add arriving, a
  plain RMSNorm (or Gemma's `(1 + w)` RMSNorm) read, a sum owed over more than one rank, no
  attention DP, a width the kernels take (plain expert parallelism over the TP group sums with
  one all-reduce, so it is no reason; an all-to-all MoE backend is, see `FlashInferSettings`);
- the device (`device_reason`): Hopper or Blackwell, FlashInfer importable. A device fact can
  differ between ranks, so the workspace manager agrees on it across the group;
- the batch (the candidates): 0 < tokens <= the workspace limit, the workspace's dtype.

Every `*_reason` returns None when the rule holds, else a short reason for reports.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Callable, Optional

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
    "FlashInferSettings",
    "AUTO_ARCHITECTURES",
    "BACKENDS",
    "settings",
    "stage_reason",
    "finalize_stage_reason",
    "device_reason",
    "width_reason",
    "kernel_width_reason",
    "finalize_kernel_reason",
    "FINALIZE_DTYPES",
    "FINALIZE_KERNEL_SAFE_VERSIONS",
    "finalize_kernel_version_reason",
    "READ_FORMATS",
    "ONESHOT_ENV",
]

#: "0" switches the plugin's candidates off on every rank (set it identically everywhere)
ENABLE_ENV = "LAYER_BOUNDARY_FLASHINFER"
#: the default token limit of the workspaces (prepare_flashinfer_fusion's max_tokens wins)
MAX_TOKENS_ENV = "LAYER_BOUNDARY_FLASHINFER_MAX_TOKENS"
#: "0" launches without Programmatic Dependent Launch
PDL_ENV = "LAYER_BOUNDARY_FLASHINFER_PDL"
#: "0" keeps MoE finalize inside the MoE (no HandoffOutput for the fused finalize)
FINALIZE_ENV = "LAYER_BOUNDARY_FLASHINFER_FINALIZE"
#: "auto" (FlashInfer's message-size heuristic), "oneshot" or "twoshot" (where the kernels allow
#: it: two-shot needs more tokens than ranks, one-shot a batch that fits one Lamport buffer)
ONESHOT_ENV = "LAYER_BOUNDARY_FLASHINFER_ALGORITHM"
ALGORITHMS = ("auto", "oneshot", "twoshot")

#: the token limit SGLang and vLLM use for the fused all-reduce (oneshot covers it at TP=2)
DEFAULT_MAX_TOKENS = 2048
#: world sizes the trtllm fusion kernels are compiled for
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)
#: activation dtypes with a matching workspace (fp32 needs an fp32 Lamport workspace)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: what the fused kernels hand compute: the normed tensor, or it quantized to FP8 E4M3 with one
#: fixed scale (kARResidualRMSNormFP8Quant) or one scale per token (kARResidualRMSNormDynamicFP8Quant)
READ_FORMATS = ("plain", "fp8_static", "fp8_dynamic")
#: the fused MoE finalize kernel is compiled for 16-bit data only (no fp32 case in its dispatch)
FINALIZE_DTYPES = (torch.bfloat16, torch.float16)
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
    #: one-shot / two-shot choice ("auto": by message size, as FlashInfer does)
    algorithm: str = "auto"


def settings() -> FusionSettings:
    raw = os.environ.get(MAX_TOKENS_ENV, "").strip()
    try:
        max_tokens = int(raw) if raw else DEFAULT_MAX_TOKENS
    except ValueError:
        raise ValueError(f"{MAX_TOKENS_ENV}={raw!r} is not an integer; set a token count such as 2048") from None
    if max_tokens < 1:
        raise ValueError(f"{MAX_TOKENS_ENV}={raw!r} must be at least 1")
    algorithm = os.environ.get(ONESHOT_ENV, "").strip().lower() or "auto"
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{ONESHOT_ENV}={algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    return FusionSettings(
        enabled=env_flag(ENABLE_ENV, True),
        max_tokens=max_tokens,
        launch_with_pdl=env_flag(PDL_ENV, True),
        defer_finalize=env_flag(FINALIZE_ENV, True),
        algorithm=algorithm,
    )


#: the enablement backends: `auto` applies the walkthrough's rules, `trtllm` asks for the fusion
#: wherever the kernels take a stage, `off` never uses it
BACKENDS = ("auto", "trtllm", "off")

#: the architectures `auto` enables the fusion for (engine class names, as Hugging Face configs
#: give them); an engine extends the list with `FlashInferSettings.with_architectures(...)`
AUTO_ARCHITECTURES = frozenset({
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "Glm4MoeForCausalLM",
    "GptOssForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Llama4ForConditionalGeneration",
})


@attrs.frozen(kw_only=True)
class FlashInferSettings:
    """What an engine passes to `prepare_flashinfer_fusion(model, settings=...)`: the engine's
    own facts, identical on every rank (part of the settings fingerprint the ranks compare).

    `backend`: `auto` (the walkthrough's rules below), `trtllm` (the fusion wherever the kernels
    take a stage) or `off`. `max_tokens`: the workspace's token limit (None: the environment's
    or 2048). `auto` enables the fusion only on Hopper or Blackwell, with TP > 1 and no attention
    DP, on one node or on Blackwell (a multi-node job is refused on Hopper only), without an MoE
    all-to-all backend (`moe_a2a_backend`; plain expert parallelism over the TP group is not one),
    and for an `architecture` in `architectures`. Whatever the backend, the environment switch
    LAYER_BOUNDARY_FLASHINFER=0 enforces off, read when `prepare` runs (so it also works when set
    after the model was built).
    """

    backend: str = attrs.field(default="auto")
    max_tokens: Optional[int] = None
    architecture: Optional[str] = None
    architectures: frozenset = attrs.field(default=AUTO_ARCHITECTURES, converter=frozenset)
    nodes: int = 1
    moe_a2a_backend: Optional[str] = None

    @backend.validator
    def _check_backend(self, attribute, value):
        if value not in BACKENDS:
            raise ValueError(f"flashinfer backend {value!r}: choose one of {', '.join(BACKENDS)}")

    def __attrs_post_init__(self):
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"nodes must be a positive integer, got {self.nodes!r}")

    def fingerprint(self) -> str:
        """A text every rank with these settings computes alike (sets sorted: string hashes differ
        between processes)."""
        return repr((self.backend, self.max_tokens, self.architecture, tuple(sorted(self.architectures)), self.nodes,
                     self.moe_a2a_backend))

    def with_architectures(self, *names: str) -> "FlashInferSettings":
        """These settings with `names` added to the architectures `auto` enables."""
        return attrs.evolve(self, architectures=self.architectures | set(names))

    def job_reason(self, topology) -> Optional[str]:
        """Why these settings turn the fusion off for the whole job (None: they do not), from
        facts every rank shares. The device rule is `device_reason`."""
        if not env_flag(ENABLE_ENV, True):
            return f"{ENABLE_ENV}=0 (enforce-disable)"
        if self.backend == "off":
            return "the flashinfer backend is off"
        if self.backend == "trtllm":
            return None
        if topology.tp < 2:
            return "auto: TP is 1 (nothing to all-reduce)"
        if topology.attn_dp > 1:
            return f"auto: attention DP (attn_dp={topology.attn_dp})"
        if self.moe_a2a_backend not in (None, "none"):
            return f"auto: the MoE all-to-all backend {self.moe_a2a_backend!r} moves tokens, not one all-reduce"
        if self.architecture is None:
            return "auto: the engine named no architecture (FlashInferSettings(architecture=...))"
        if self.architecture not in self.architectures:
            return f"auto: {self.architecture} is not in the architectures it enables (extend them with with_architectures)"
        return None

    def device_reason(self, capability: Optional[tuple]) -> Optional[str]:
        """Why this rank's device turns `auto` off (None: it does not); per rank, so agreed."""
        if self.backend != "auto":
            return None
        if capability is None:
            return "auto: no CUDA device"
        major, minor = capability
        if major not in SUPPORTED_CAPABILITY_MAJORS:
            return f"auto: compute capability {major}.{minor} is neither Hopper nor Blackwell"
        if self.nodes > 1 and major != 10:
            return f"auto: a job over {self.nodes} nodes on Hopper (multi-node is enabled on Blackwell only)"
        return None


def width_reason(hidden: Optional[int]) -> Optional[str]:
    if hidden is None:
        return "the stage's norm has no hidden size"
    if hidden % 8:
        return f"hidden size {hidden} is not a multiple of 8 (16-byte vector lanes)"
    if hidden > MAX_HIDDEN:
        return f"hidden size {hidden} exceeds the one-shot kernel's {MAX_HIDDEN}"
    return None


def _vector(dtype) -> int:
    """Elements per 16-byte access (the kernels' VEC_SIZE)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def _cluster(units: int) -> int:
    """The cluster size the launchers pick: the largest power of two <= 8 dividing `units`."""
    size = 8
    while units % size:
        size //= 2
    return size


def kernel_width_reason(hidden: int, dtype) -> Optional[str]:
    """Why the trtllm all-reduce fusion kernel cannot take rows of `hidden` `dtype` values (None:
    it can). One token is one thread cluster of at most 8 blocks of at most 1024 threads, each
    thread one 16-byte vector, and the one-shot launch must cover the row exactly: so fp32 rows
    stop at 32768, 16-bit rows at 65536 (fewer when the row's vector count has no factor 8)."""
    vec = _vector(dtype)
    if hidden % vec:
        return f"hidden size {hidden} is not a multiple of {vec} ({dtype} in 16-byte vectors)"
    threads = hidden // vec
    if threads // _cluster(threads) > 1024:
        return f"hidden size {hidden} in {dtype} needs more than 8 blocks of 1024 threads per token"
    return None


#: flashinfer-python versions whose fused MoE finalize kernel reads only its own Lamport buffer
#: (verified on a GPU); none yet: 0.7.2.post1's reads its peers' buffers (see below)
FINALIZE_KERNEL_SAFE_VERSIONS: tuple = ()

#: why the fused finalize kernel is not used with the installed FlashInfer
FINALIZE_RACE = (
    "FlashInfer {version}'s fused MoE finalize kernel reads its peers' Lamport buffers, which a faster rank's next "
    "fused call already clears: a rank then waits forever (seen at TP=2: qwen3_moe hung at its second MoE layer) or "
    "reads stale values; the MoE finalizes in torch and its sum takes the fused all-reduce + add + RMSNorm"
)


def finalize_kernel_version_reason(version: Optional[str]) -> Optional[str]:
    """Why the installed FlashInfer's finalize kernel must not run at all (None: it may)."""
    if version is not None and version in FINALIZE_KERNEL_SAFE_VERSIONS:
        return None
    return FINALIZE_RACE.format(version=version or "(unknown version)")


def finalize_kernel_reason(hidden: int, dtype) -> Optional[str]:
    """Why FlashInfer 0.7.2's fused MoE finalize kernel must not run on rows of `hidden` `dtype`
    values (None: it may). It has no fp32 case, and it launches whole warps: when a row's vector
    count is not a multiple of 32, the spare threads of each warp load and store the next
    token's elements and add them to this token's norm statistic (wrong values), so such widths
    (hidden 64, 2880 in bf16) finalize in torch and use the fused all-reduce + add + norm."""
    if dtype not in FINALIZE_DTYPES:
        return f"the fused MoE finalize kernel has no {dtype} variant (bf16 and fp16 only)"
    reason = kernel_width_reason(hidden, dtype)
    if reason is not None:
        return reason
    threads = hidden // _vector(dtype)
    if threads % 32:
        return (f"hidden size {hidden} in {dtype} is {threads} vectors, not a multiple of 32: the finalize kernel's "
                "spare warp lanes would touch the next token")
    warps = threads // 32
    if warps // _cluster(warps) * 32 > 1024:
        return f"hidden size {hidden} in {dtype} needs a finalize block of more than 1024 threads"
    return None


def _topology_reason(topology) -> Optional[str]:
    if topology.attn_dp > 1:
        return f"attention DP (attn_dp={topology.attn_dp}): the boundary gathers rows, not one all-reduce"
    return None


def _group_size(topology, sum_group) -> int:
    name = sum_group.group_name
    return topology.tp if name == "tp" else getattr(topology, name)


def stage_reason(description) -> Optional[str]:
    """Why the fused all-reduce + add + norm cannot complete this stage's input (None: it can)."""
    if description.incoming_sum is None:
        return "nothing is ever owed at this input"
    if not description.plain_update:
        return "the arriving update is not a plain add"
    if description.read_format not in READ_FORMATS:
        return "the read is neither a plain norm nor an FP8-quantizing norm"
    if description.post_norm_kind is not None:
        return "the arriving output owes its output norm before the add, which the fused kernels do not apply"
    if description.norm_kind not in ("rms", "gemma_rms"):
        return f"norm kind {description.norm_kind!r} is not an RMSNorm"
    return _sum_reason(description)


#: the read norms after FlashInfer's plain all-reduce (the norms run as local kernels)
PLAIN_NORM_KINDS = ("rms", "gemma_rms", "layer", "none")
#: the output norms an arriving output may owe there (applied by the local completion)
PLAIN_POST_NORM_KINDS = ("rms", "gemma_rms", "layer", "other")


def plain_stage_reason(description) -> Optional[str]:
    """Why FlashInfer's plain all-reduce (followed by the stage's local norms: the post-norm, the
    add and the read, as local kernels) cannot complete this stage's input where the fused
    patterns do not apply, an output norm owed before the add or a LayerNorm or identity read
    (None: it can)."""
    if description.incoming_sum is None:
        return "nothing is ever owed at this input"
    if not description.plain_update:
        return "the arriving update is not a plain add"
    if description.read_format != "plain":
        return "the read is not a plain norm"
    if description.post_norm_kind is None and description.norm_kind in ("rms", "gemma_rms"):
        return "the fused all-reduce + add + RMSNorm takes this input"
    if description.norm_kind not in PLAIN_NORM_KINDS:
        return f"norm kind {description.norm_kind!r} is not one the local kernels compute"
    return _sum_reason(description)


def _sum_reason(description) -> Optional[str]:
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


def model_kernel_reason(request, dtypes, unsupported: Optional[str] = None) -> Optional[str]:
    """Why a model-wide kernel (rope, decode attention, gated activation) is not asked for
    `request`, in the order the reasons are reported: the device, the dtype, what the kernel
    itself cannot take (`unsupported`, the caller's), the switch, the library. None: tried."""
    if request.device.type != "cuda":
        return f"a {request.device.type} device"
    if request.dtype not in dtypes:
        return f"{request.dtype} rows"
    if unsupported is not None:
        return unsupported
    if not settings().enabled:
        return "LAYER_BOUNDARY_FLASHINFER=0"
    if not flashinfer_installed():
        return "flashinfer-python missing"
    return None


def first_launch(record: str, what: str, device, launch: Callable, declined: Optional[str] = None):
    """A kernel factory's answer: None at once where the kernel is `declined` (the reason it is not
    asked for), else `launch()`'s result once it ran and the device finished it (a JIT build or
    compile happens now, never inside a CUDA-graph capture); None, with a warning naming `record`
    and `what` it was asked for, when it fails: a kernel that cannot run here declines."""
    if declined is not None:
        return None
    try:
        result = launch()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        return result
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here declines
        logging.getLogger("layer_boundary.flashinfer").warning("%s declines %s on %s: %s: %s", record, what, device, type(exc).__name__, exc)
        return None
