"""The local completion of a stage's input: a complete output, maybe still owing its producer's
output norm (a post-norm or sandwich layer), joins the residual and is read.

`LocalRead(read, norm)` is the plain case: the read's own add + norm (`update_and_read` with the
plain add: the norm's chosen `AddNormKernel`). `PostNormRead(post_norm, read, norm)` adds the
output norm in front, `read(residual + post_norm(value))`, in one call: the first
`AddNormKernel.post_norm_factory` that accepts the pair (one fused launch), chosen once per
(device, residual dtype, contribution dtype) as the add + norm kernels are, else the torch path,
which runs exactly what the unfused completion ran before the post-norm stayed deferrable: the
post-norm module, then the read's `update_and_read`.

Both are what `Stage.read_complete(value, residual)` runs: at a TP=1 input whose producer left
its post-norm, after a candidate completed a sum its own way, and in the core's unfused
completion. They return `(compute_input, new_residual)`; new tensors out, inputs never written.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional

import torch

from .._plugins import manager as _manager
from .._plugins.requests import NormSpec, PostNormRequest
from .._plugins.selection import select
from .add_norm import PLAIN_ADD, NormRead, kernel_norm_kind
from .kernels import TORCH, Choice, checked_pair, compute_dtype_of, kernel_who

__all__ = ["LocalRead", "PostNormRead", "local_read", "post_norm_read", "post_norm_arguments", "norm_spec", "forget", "POST_NORM"]

#: post-norm reads holding cached choices, emptied when the registry is forgotten
_READS: "weakref.WeakSet" = weakref.WeakSet()
#: how messages name a post-norm completion's kernel (`kernel_who`)
POST_NORM = "post-norm + add + norm"
#: request -> (record name, kernel, declined names, source, plugin): pairs with equal facts share one answer
_BY_REQUEST: dict = {}


class LocalRead:
    """`(value, residual) -> read.update_and_read(PLAIN_ADD, value, residual, norm)`."""

    __slots__ = ("read", "norm")

    post_norm = None

    def __init__(self, read, norm):
        self.read = read
        self.norm = norm

    def __call__(self, value, residual):
        return self.read.update_and_read(PLAIN_ADD, value, residual, self.norm)

    def describe(self) -> str:
        return f"add, read with {type(self.norm).__name__}"


def norm_spec(norm, dtype: torch.dtype) -> NormSpec:
    """What a kernel is told of `norm` for rows of `dtype`."""
    kind = kernel_norm_kind(norm)
    if kind == "none":
        return NormSpec(norm_kind="none")
    return NormSpec(
        norm_kind=kind,
        weight_dtype=norm.weight.dtype,
        offset=float(getattr(type(norm), "offset", 0.0)),
        eps=float(norm.eps),
        compute_dtype=compute_dtype_of(norm, dtype),
        bias=getattr(norm, "bias", None) is not None,
    )


class PostNormRead:
    """`(value, residual) -> read(residual + post_norm(value))` through the chosen kernel."""

    __slots__ = ("post_norm", "read", "norm", "refusal", "_kernels", "_choices", "__weakref__")

    def __init__(self, post_norm, read, norm):
        self.post_norm = post_norm
        self.read = read
        self.norm = norm
        #: why no kernel is asked ("" when records are): a read other than the plain norm read, a
        #: norm whose math kernels do not reproduce
        self.refusal = _refusal(post_norm, read, norm)
        self._kernels: dict = {}
        self._choices: dict = {}

    def __call__(self, value, residual):
        run = self._kernels.get((residual.device, residual.dtype, value.dtype))
        if run is None:
            return self._first_call(value, residual)
        return run(value, residual)

    def torch_read(self, value, residual):
        """The unfused completion (`unfused_post_norm_read`)."""
        return unfused_post_norm_read(self.post_norm, self.read, self.norm, value, residual)

    def _first_call(self, value, residual):
        if torch.compiler.is_compiling() or (residual.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self.torch_read(value, residual)  # no registry walk inside a trace or a capture
        return self.choose(residual.device, residual.dtype, value.dtype).run(value, residual)

    def choose(self, device, dtype: torch.dtype, contribution_dtype: torch.dtype) -> Choice:
        """The kernel for this key (asking the records when none is cached)."""
        key = (torch.device(device), dtype, contribution_dtype)
        choice = self._choices.get(key)
        if choice is not None:
            return choice
        declined: tuple = ()
        choice = None
        if not self.refusal:
            request = self.request(*key)
            answer = _BY_REQUEST.get(request)
            if answer is None:
                answer = _BY_REQUEST[request] = _ask(request)
            name, kernel, declined, source, plugin = answer
            if kernel is not None:
                choice = Choice(name, _bound(kernel, self.post_norm, self.norm, kernel_who(source, POST_NORM), plugin), declined,
                                plugin=plugin)
        if choice is None:
            choice = Choice(TORCH, self.torch_read, declined, self.refusal)
        self._choices[key] = choice
        self._kernels[key] = choice.run
        _READS.add(self)
        return choice

    def request(self, device, dtype: torch.dtype, contribution_dtype: torch.dtype) -> PostNormRequest:
        return PostNormRequest(
            device=torch.device(device),
            dtype=dtype,
            contribution_dtype=contribution_dtype,
            hidden_size=int(self.post_norm.weight.shape[-1]),
            post=norm_spec(self.post_norm, dtype),
            norm=norm_spec(self.norm, dtype),
        )

    def forget(self) -> None:
        self._kernels.clear()
        self._choices.clear()

    def describe(self, device=None, dtype=None) -> str:
        """One line for plans: the post-norm and the read, and the kernel they run (for the post
        norm's weight's device and dtype, unless given)."""
        weight = self.post_norm.weight
        device = weight.device if device is None else torch.device(device)
        dtype = weight.dtype if dtype is None else dtype
        what = f"norm the output with {type(self.post_norm).__name__}, add, read with {type(self.norm).__name__}"
        if device.type == "meta":
            return f"{what} (one call, its kernel chosen per device and dtype at the first call)"
        choice = self.choose(device, dtype, dtype)
        why = f" ({choice.reason})" if choice.reason else (f" ({', '.join(choice.declined)} declined)" if choice.declined else "")
        return f"{what} in one call: {choice.name}{why}"


def local_read(read, norm, post_norm=None):
    """The local completion of a stage that reads with `read` and `norm`, owing `post_norm` (None: none)."""
    return LocalRead(read, norm) if post_norm is None else post_norm_read(post_norm, read, norm)


def post_norm_read(post_norm, read, norm) -> Callable:
    """The one `PostNormRead` of (post_norm, read, norm), kept on the read norm: every plan of a
    stage (and a final norm reading the same pair) shares its kernel choice, and `prepare_model`
    finds it there (`prepare_norms`). Inside a trace it is only looked up (Dynamo cannot follow a
    write into a module's `__dict__`); a pair no eager call has met yet runs unfused there."""
    key = (id(post_norm), id(read))
    reads = getattr(norm, "_post_norm_reads", None)
    found = None if reads is None else reads.get(key)
    if found is not None and found.post_norm is post_norm and found.read is read:
        return found
    if torch.compiler.is_compiling():
        return functools.partial(unfused_post_norm_read, post_norm, read, norm)
    found = PostNormRead(post_norm, read, norm)
    if hasattr(norm, "__dict__"):
        norm.__dict__.setdefault("_post_norm_reads", {})[key] = found
    return found


def unfused_post_norm_read(post_norm, read, norm, value, residual):
    """`read(residual + post_norm(value))` unfused: the post-norm module (its own chosen norm
    kernel), then the read's update and read (the read norm's chosen add + norm)."""
    return read.update_and_read(PLAIN_ADD, post_norm(value), residual, norm)


def _refusal(post_norm, read, norm) -> str:
    if type(read) is not NormRead:
        return f"the read {read!r} is not the plain norm read"
    if kernel_norm_kind(post_norm) not in ("rms", "gemma_rms", "layer"):
        return f"the post-norm {type(post_norm).__name__} is not a norm kernels reproduce"
    if kernel_norm_kind(norm) not in ("rms", "gemma_rms", "layer", "none"):
        return f"the read norm {type(norm).__name__} is not a norm kernels reproduce"
    return ""


def _ask(request: PostNormRequest) -> tuple:
    """(name, kernel, declined) of the first record accepting `request` ((TORCH, None, all) if none)."""
    every = _manager.get_registry().add_norm_kernels

    def implements(item) -> bool:
        kinds = item.record.norm_kinds
        return request.post.norm_kind in kinds and (request.norm.norm_kind == "none" or request.norm.norm_kind in kinds)

    records = tuple(item for item in every if implements(item))
    undeclared = tuple(item.name for item in every if not implements(item))
    subject = f"choosing the post-norm + add + norm of width {request.hidden_size} on {request.device}"
    chosen = select("add_norm_kernels", (request,), records=records, factory="post_norm_factory", subject=subject, check=callable,
                    error_type=TypeError)
    declined = undeclared + tuple(a.candidate for a in chosen.declined)
    if chosen.chosen is None:
        return TORCH, None, declined, "", None
    return chosen.chosen.candidate, chosen.value, declined, chosen.chosen.source, chosen.chosen.plugin


def post_norm_arguments(post_norm, norm) -> tuple:
    """What a `post_norm_factory` kernel takes after (value, residual): the post-norm's weight and
    bias, then the read norm's (None for a bias a norm lacks, both None before an identity read)."""
    identity = kernel_norm_kind(norm) == "none"
    return (post_norm.weight, getattr(post_norm, "bias", None), None if identity else norm.weight,
            None if identity else getattr(norm, "bias", None))


def _bound(kernel: Callable, post_norm, norm, who: str, plugin: Optional[str]) -> Callable:
    """The chosen post-norm completion with both norms' parameters bound in, its return checked
    as an add + norm's is."""
    return checked_pair(kernel, lambda: post_norm_arguments(post_norm, norm), who, plugin)


def forget(read: Optional[PostNormRead] = None) -> None:
    """Drop the cached choices of `read` (of every post-norm read and request when None)."""
    if read is None:
        _BY_REQUEST.clear()
    for r in [read] if read is not None else list(_READS):
        r.forget()


_manager.on_registry_reset(forget)
