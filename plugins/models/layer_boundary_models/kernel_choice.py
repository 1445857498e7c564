"""Choosing the reference models' plugin kernels once per model, agreed across the TP group.

Every model-wide kernel kind (`RopeKernel`, `QKNormRopeKernel`, `DecodeAttentionKernel`,
`GatedActivationKernel`) is chosen the same way at `prepare_model`, through the plugin API's
selection rule: each rank asks the kind's records in the selection order with the kind's typed
request, and `select_agreed` keeps the first record that *every* rank of the group accepts (one
all_reduce for all the kinds asked together, none when no record is registered), so no two
ranks of a model run different kernels; a factory that raised on one rank makes every rank
raise. The torch path (`TORCH`) is always last and never declines.

A chosen kernel is installed checked: its return is held to the request (shape, dtype and
device, metadata only; `check_result`), so a wrong one fails at the kernel, naming the record,
its plugin and the switch that disables the plugin, instead of somewhere downstream.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import attrs

from layer_boundary import FusionError
from layer_boundary.plugin import Answer, Selection, check_result, disable_hint, select, select_agreed

__all__ = ["TORCH", "KernelChoice", "choose", "local_choice", "named", "chain", "group_of", "describe_model", "checked"]

TORCH = "core.torch"


@attrs.frozen
class KernelChoice:
    """One kind's kernel for a model: its record name, the kernel (None: torch; else the record's
    kernel with its returns checked), the records asked before it that some rank declined, and
    the chosen record's plugin."""

    name: str
    kernel: Optional[Callable] = None
    declined: tuple[str, ...] = ()
    plugin: Optional[str] = None


#: what each kind's records are called in messages
_NOUNS = {
    "rope_kernels": "rope kernel",
    "qk_norm_rope_kernels": "q/k norm + rope kernel",
    "decode_attention_kernels": "decode-attention kernel",
    "gated_activation_kernels": "gated-activation kernel",
}


def _pair(out: Any, who: str, plugin: Optional[str]):
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return out
    raise FusionError(f"{who} returned {type(out).__name__} where a pair (queries, keys) was asked; {disable_hint(plugin)}")


class _CheckedRope:
    """`kernel(q, k, *rest) -> (q, k)`: each output shaped, typed and placed like its input."""

    __slots__ = ("kernel", "who", "plugin")

    def __init__(self, kernel, who: str, plugin: Optional[str]):
        self.kernel, self.who, self.plugin = kernel, who, plugin

    def __call__(self, q, k, *rest):
        q_out, k_out = _pair(self.kernel(q, k, *rest), self.who, self.plugin)
        return (check_result(q_out, q.shape, q, self.who, self.plugin, "query output"),
                check_result(k_out, k.shape, k, self.who, self.plugin, "key output"))


class _CheckedActivation:
    """`kernel(gate_up) -> out`: [tokens, the request's width] in gate_up's dtype, on its device."""

    __slots__ = ("kernel", "width", "who", "plugin")

    def __init__(self, kernel, width: int, who: str, plugin: Optional[str]):
        self.kernel, self.width, self.who, self.plugin = kernel, width, who, plugin

    def __call__(self, gate_up):
        out = self.kernel(gate_up)
        return check_result(out, (gate_up.shape[0], self.width), gate_up, self.who, self.plugin, "activation")


class _CheckedDecode:
    """`kernel(q, k_cache, v_cache, slots, positions) -> out`: shaped, typed and placed like q."""

    __slots__ = ("kernel", "who", "plugin")

    def __init__(self, kernel, who: str, plugin: Optional[str]):
        self.kernel, self.who, self.plugin = kernel, who, plugin

    def __call__(self, q, k_cache, v_cache, slots, positions):
        out = self.kernel(q, k_cache, v_cache, slots, positions)
        return check_result(out, q.shape, q, self.who, self.plugin, "attention output")


class _CheckedStepBound(_CheckedDecode):
    """A step-bound decode kernel (`bind_step`, `write`, `attend`), its attention checked."""

    __slots__ = ()

    def bind_step(self, k_cache, slots, positions):
        return self.kernel.bind_step(k_cache, slots, positions)

    def write(self, state, k, v, k_cache, v_cache):
        return self.kernel.write(state, k, v, k_cache, v_cache)

    def attend(self, state, q, k_cache, v_cache):
        out = self.kernel.attend(state, q, k_cache, v_cache)
        return check_result(out, q.shape, q, self.who, self.plugin, "attention output")


def checked(point: str, request, answer: Answer) -> Callable:
    """`answer`'s kernel (of extension point `point`, chosen for `request`) with its returns held
    to the request."""
    kernel, who, plugin = answer.value, f"{_NOUNS.get(point, point)} {answer.source}", answer.plugin
    if point in ("rope_kernels", "qk_norm_rope_kernels"):
        return _CheckedRope(kernel, who, plugin)
    if point == "gated_activation_kernels":
        return _CheckedActivation(kernel, request.intermediate, who, plugin)
    if point == "decode_attention_kernels":
        return (_CheckedStepBound if getattr(kernel, "bind_step", None) is not None else _CheckedDecode)(kernel, who, plugin)
    return kernel


def _choice(selection: Selection, point: str, records, request) -> KernelChoice:
    chosen = selection.chosen
    if chosen is None:
        return KernelChoice(TORCH, None, tuple(r.name for r in records))
    return KernelChoice(chosen.candidate, checked(point, request, chosen), tuple(a.candidate for a in selection.declined),
                        chosen.plugin)


def choose(asks: Sequence[tuple[str, Sequence, object, str]], group, device) -> list[KernelChoice]:
    """The rank-agreed choice of each (point, records, request, subject) in `asks`, in order.
    Collective over `group` when any record is registered: every rank must pass asks of the same
    points, in the same order (their requests are built from weights every rank of the group
    shares)."""
    return [_choice(s, point, records, request)
            for s, (point, records, request, _) in zip(select_agreed(asks, group, device), asks)]


def local_choice(point: str, records, request, subject: str = "") -> KernelChoice:
    """This rank's own answer, no agreement (plans do not communicate); a failing record raises."""
    return _choice(select(point, (request,), records=records, subject=subject, check=callable), point, records, request)


def named(choice: KernelChoice) -> str:
    """The choice for a plan line: its name, and the records declined before it."""
    return f"{choice.name} ({', '.join(choice.declined)} declined)" if choice.declined else choice.name


def chain(records) -> str:
    """The order the records of a kind are asked in, torch last."""
    return " > ".join([r.name for r in records] + [TORCH])


def group_of(model, module):
    """The group a model-wide kernel is agreed over: the model's TP group, else the module's."""
    parallel = getattr(model, "parallel", None)
    groups = getattr(parallel, "groups", None)
    return groups["tp"] if groups is not None and "tp" in groups else module.group


def describe_model(model) -> dict:
    """The model-wide lines of `layer-boundary plan`: what the attentions and the gated MLPs run
    (or would run) for rope, decode attention and act(gate) * up, and a model's own notes
    (`plan_notes()`: collectives its compute issues, such as OLMo-2's q/k statistic)."""
    from .attention_kernels import describe as describe_attention
    from .mlp_kernels import describe as describe_mlp

    lines = {"attention_kernels": describe_attention(model), "mlp_kernels": describe_mlp(model)}
    notes = getattr(model, "plan_notes", None)  # a model's own lines: collectives its compute issues
    if callable(notes):
        lines.update(notes())
    return {k: v for k, v in lines.items() if v}
