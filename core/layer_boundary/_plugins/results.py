"""A candidate's result checked against what it was asked, where the check costs nothing.

Every candidate a plugin contributes at run time (fusion candidates, add + norm kernels, the
model families' rope, decode-attention and activation kernels) returns tensors whose shape,
dtype and device its request fixes. A wrong one would otherwise run on: a one-row residual
broadcasts into every later sum, a hidden size one short fails inside the next GEMM, a row short
is blamed on the model; none of them names the plugin. The check reads metadata only (no sync,
no launch; under torch.compile it is decided at trace time), and its error is a `FusionError`
naming the candidate, its plugin and `LAYER_BOUNDARY_DISABLE_PLUGINS=<plugin>`. The contract
suite reports a vendor's wrong return with the same message.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._errors import FusionError
from .selection import disable_hint

__all__ = ["matches", "check_result", "result_problem", "pair_matches", "pair_problem", "raised"]


def matches(value: Any, shape, like: torch.Tensor) -> bool:
    """Whether `value` is a tensor of `shape` in `like`'s dtype on `like`'s device."""
    return (
        isinstance(value, torch.Tensor)
        and value.shape == shape
        and value.dtype is like.dtype
        # torch.device objects are built per access: compare them only off the CPU
        and ((value.is_cpu and like.is_cpu) or value.device == like.device)
    )


def _dtype(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _spec(shape, dtype, device) -> str:
    return f"{tuple(shape)} {_dtype(dtype)} on {device}"


def _got(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {_spec(value.shape, value.dtype, value.device)}"
    return f"a {type(value).__name__}"


def _difference(value, shape, like) -> str:
    """The first way `value` differs from the request, in words."""
    if not isinstance(value, torch.Tensor):
        return "not a tensor"
    shape = tuple(shape)
    if value.dim() != len(shape):
        return f"{value.dim()} dimensions where {len(shape)} were asked"
    if value.shape[0] != shape[0]:
        return f"{value.shape[0]} row{'s' if value.shape[0] != 1 else ''} where {shape[0]} were asked"
    for axis, (got, want) in enumerate(zip(value.shape, shape)):
        if got != want:
            return f"size {got} in dimension {axis} where {want} was asked"
    if value.dtype != like.dtype:
        return f"{_dtype(value.dtype)} where {_dtype(like.dtype)} was asked"
    return f"on {value.device} where {like.device} was asked"


def result_problem(who: str, plugin: Optional[str], what: str, value: Any, shape, like: torch.Tensor) -> str:
    """The message of a result that is not what was asked: `who` (the candidate and its plugin,
    in words) returned `what` as `value` where a tensor of `shape` like `like` was asked."""
    return (
        f"{who} returned a wrong {what}: {_difference(value, shape, like)} (got {_got(value)}, asked a tensor "
        f"{_spec(shape, like.dtype, like.device)}); {disable_hint(plugin)}"
    )


def check_result(value: Any, shape, like: torch.Tensor, who: str, plugin: Optional[str], what: str = "result"):
    """`value` when it is a tensor of `shape` in `like`'s dtype on its device, else `FusionError`
    (`result_problem`). Metadata only: call it on every return of a plugin's kernel."""
    if matches(value, shape, like):
        return value
    raise FusionError(result_problem(who, plugin, what, value, shape, like))


def pair_matches(out: Any, like: torch.Tensor, plain: bool = True) -> bool:
    """Whether `out` is (compute input, new residual), both shaped, typed and placed like the
    residual `like`; a compute input in a quantized format (`plain=False`, an `Fp8Input`) only
    has the residual's shape. (`matches` twice, inlined: it runs on every fused call.)"""
    if (type(out) is not tuple and type(out) is not list) or len(out) != 2:
        return False
    first, second = out
    shape, dtype, cpu = like.shape, like.dtype, like.is_cpu
    if not (isinstance(second, torch.Tensor) and second.shape == shape and second.dtype is dtype
            and ((cpu and second.is_cpu) or second.device == like.device)):
        return False
    if not plain:
        return getattr(first, "shape", None) == shape
    return (isinstance(first, torch.Tensor) and first.shape == shape and first.dtype is dtype
            and ((cpu and first.is_cpu) or first.device == like.device))


def pair_problem(out: Any, like: torch.Tensor, who: str, plugin: Optional[str], plain: bool = True,
                 names: tuple[str, str] = ("compute input", "new residual")) -> str:
    """The message of a pair `pair_matches` refuses."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        got = f"{len(out)} values" if isinstance(out, (tuple, list)) else _got(out)
        return f"{who} returned {got} where a pair ({names[0]}, {names[1]}) was asked; {disable_hint(plugin)}"
    first, second = out
    if not matches(second, like.shape, like):
        return result_problem(who, plugin, names[1], second, like.shape, like)
    if plain:
        return result_problem(who, plugin, names[0], first, like.shape, like)
    return (
        f"{who} returned a wrong {names[0]}: shape {tuple(getattr(first, 'shape', ()))} where {tuple(like.shape)} was asked; "
        f"{disable_hint(plugin)}"
    )


def raised(who: str, plugin: Optional[str], exc: BaseException) -> FusionError:
    """The error of a plugin's kernel that raised at run time."""
    return FusionError(f"{who} raised {type(exc).__name__}: {exc}; {disable_hint(plugin)}")
