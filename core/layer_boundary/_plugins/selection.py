"""The one selection rule: which candidate of an extension point serves a request.

Every extension point chooses the same way. The caller's explicit candidates come first (a
stage's `fusions=` providers), then the registry's records in (-priority, name) order, the
built-in plugin's last. Each candidate is asked in turn with the point's typed request: its
factory returns the runtime object, None to decline, or raises `NotImplementedError(reason)`
to decline with a reason. Any other exception, or an object without the point's capability,
is the plugin's error: it names the candidate, its plugin and the switch that disables it.

Every answer is kept in the returned `Selection` (who accepted, who declined and why), and,
inside `recording()`, in a list the caller reads: plans and run reports say from it which
candidate took each point. Callers ask once per stage or per model preparation, with requests
every rank builds alike, so every rank of a group gets the same answer; where a factory's
answer may differ between ranks (a kernel that compiled on one rank only), `select_agreed`
settles on the first candidate every rank accepted, with one all_reduce.

This module is the only one that calls a record's factory.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import attrs

from .manager import DISABLE_ENV, PluginError, current_registry

__all__ = ["Answer", "Selection", "select", "select_agreed", "call_record", "recording", "disable_hint"]

#: what each extension point's candidates are called in messages
_NOUNS = {
    "fusion_providers": "fusion provider",
    "residual_kinds": "residual kind",
    "cp_paths": "CP path provider",
    "token_mappings": "token mapping provider",
    "overlaps": "overlap provider",
    "branches": "branch provider",
    "row_publishers": "row publisher",
    "add_norm_kernels": "add + norm kernel",
    "rope_kernels": "rope kernel",
    "qk_norm_rope_kernels": "q/k norm + rope kernel",
    "decode_attention_kernels": "decode-attention kernel",
    "gated_activation_kernels": "gated-activation kernel",
    "benchmarks": "benchmark",
    "model_families": "model family",
}

#: the reason recorded for a factory that returned None
RETURNED_NONE = "returned None"


def disable_hint(plugin: Optional[str]) -> str:
    """The switch that runs without `plugin`."""
    return f"set {DISABLE_ENV}={plugin} to run without it" if plugin else "remove it from the stage's options"


@attrs.frozen
class Answer:
    """One candidate's answer: the object it built (`value`), or why it declined (`reason`)."""

    candidate: str
    plugin: Optional[str] = None
    distribution: Optional[str] = None
    value: Any = attrs.field(default=None, eq=False, repr=False)
    reason: str = ""

    @property
    def accepted(self) -> bool:
        return not self.reason

    @property
    def source(self) -> str:
        """Where the candidate came from, for messages."""
        if self.plugin is None:
            return self.candidate
        return f"record {self.candidate!r} of plugin {self.plugin!r} (distribution {self.distribution})"

    def summary(self) -> dict:
        out = {"candidate": self.candidate, "plugin": self.plugin}
        if self.reason:
            out["reason"] = self.reason
        return out


@attrs.frozen
class Selection:
    """What one extension point answered for one subject, in the order the candidates were asked."""

    point: str
    subject: str
    answers: tuple[Answer, ...] = ()
    #: a candidate's failure, kept instead of raised (`errors="collect"`)
    error: Optional[str] = None
    #: the stage (its label) the selection is made for, when it is made for one: run reports
    #: attribute the chain to that boundary
    label: Optional[str] = None

    @property
    def accepted(self) -> tuple[Answer, ...]:
        return tuple(a for a in self.answers if a.accepted)

    @property
    def declined(self) -> tuple[Answer, ...]:
        return tuple(a for a in self.answers if not a.accepted)

    @property
    def chosen(self) -> Optional[Answer]:
        return next((a for a in self.answers if a.accepted), None)

    @property
    def value(self) -> Any:
        chosen = self.chosen
        return None if chosen is None else chosen.value

    def summary(self) -> dict:
        """A JSON-ready account: the point, the subject, the chosen candidate, the declines."""
        chosen = self.chosen
        out = {
            "point": self.point,
            "subject": self.subject,
            "chosen": None if chosen is None else chosen.candidate,
            "plugin": None if chosen is None else chosen.plugin,
            "declined": [a.summary() for a in self.declined],
        }
        if self.label is not None:
            out["label"] = self.label
        return out


_RECORDING: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("layer_boundary_selections", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Collect every `Selection` made in this block (this thread's, or this task's) in a list."""
    found: list = []
    token = _RECORDING.set(found)
    try:
        yield found
    finally:
        _RECORDING.reset(token)


def _keep(selection: Selection) -> Selection:
    log = _RECORDING.get()
    if log is not None:
        log.append(selection)
    return selection


def _failure(point: str, item, subject: str, problem: str) -> str:
    noun = _NOUNS.get(point, point)
    where = f" while {subject}" if subject else ""
    return f"{noun} {item.name!r} of plugin {item.plugin!r} (distribution {item.distribution}) {problem}{where}; {disable_hint(item.plugin)}"


def _conforms(value: Any, check) -> bool:
    if check is None:
        return True
    if isinstance(check, type):
        return isinstance(value, check)
    return bool(check(value))


def _check_name(check) -> str:
    if isinstance(check, type) or check is callable:
        return getattr(check, "__name__", "callable")
    return (getattr(check, "__doc__", None) or "what the extension point takes").strip()


def call_record(item, *args, factory: str = "factory", **kwargs) -> Any:
    """Call `item`'s factory (`factory` names another callable field of the record, such as
    `norm_factory`) without interpretation: what `select` does for each candidate, exposed for
    callers that run a record rather than choose one (`layer-boundary bench`) and for the
    contract suite, which asks one record at a time. `item` is a `Registered` or a bare record."""
    return getattr(getattr(item, "record", item), factory)(*args, **kwargs)


def select(
    point: str,
    args: tuple = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    *,
    records: Optional[Sequence] = None,
    explicit: Sequence[tuple[Any, str]] = (),
    first: bool = True,
    subject: str = "",
    factory: str = "factory",
    check: Any = None,
    errors: str = "raise",
    error_type: Optional[Callable[[str], Exception]] = PluginError,
    label: Optional[str] = None,
) -> Selection:
    """Ask the candidates of extension point `point` (a registry field such as
    "fusion_providers") with `factory(*args, **kwargs)`, in the selection order.

    `records` replaces the registry's records of `point` (a filtered or pre-ordered subset);
    `explicit` are (object, description) candidates asked before them (they always accept);
    `first=False` asks every candidate (a chain, or answers to agree on), else asking stops at
    the first that accepts; `factory` names the record's callable to use; `check` is the
    capability an accepted object must have (a type, or a predicate). A candidate that raises
    (other than `NotImplementedError`) or returns an object without the capability raises
    `error_type` naming it, or with `errors="collect"` ends the asking with the failure kept in
    `Selection.error` (callers that must first agree with other ranks); `error_type=None` lets a
    candidate's own exception through (a residual kind refusing the caller's options). `label`
    names the stage the selection is made for (kept on the `Selection`)."""
    selection = _ask(point, args, kwargs or {}, records, explicit, first, subject, factory, check, errors, error_type)
    return _keep(selection if label is None else attrs.evolve(selection, label=label))


def _ask(point, args, kwargs, records, explicit, first, subject, factory, check, errors, error_type) -> Selection:
    answers: list[Answer] = []
    for value, description in explicit:
        if not _conforms(value, check):
            raise (error_type or TypeError)(f"{description} is {value!r}, which is not {_check_name(check)}")
        answers.append(Answer(description, value=value))
        if first:
            return Selection(point, subject, tuple(answers))
    items = current_registry().records(point) if records is None else records
    for item in items:
        if getattr(getattr(item, "record", item), factory, None) is None:  # an optional factory the record leaves out
            answers.append(Answer(item.name, item.plugin, item.distribution, reason=f"has no {factory}"))
            continue
        try:
            value = call_record(item, *args, factory=factory, **kwargs)
        except NotImplementedError as exc:
            answers.append(Answer(item.name, item.plugin, item.distribution, reason=str(exc) or "not implemented here"))
            continue
        except Exception as exc:  # noqa: BLE001 - any failure of a plugin's factory is reported as that plugin's
            message = _failure(point, item, subject, f"raised {type(exc).__name__}: {exc}")
            if errors == "collect":
                return Selection(point, subject, tuple(answers), error=message)
            if error_type is None:
                raise
            raise error_type(message) from exc
        if value is None:
            answers.append(Answer(item.name, item.plugin, item.distribution, reason=RETURNED_NONE))
            continue
        if not _conforms(value, check):
            message = _failure(point, item, subject, f"returned {value!r}, which is not {_check_name(check)}")
            if errors == "collect":
                return Selection(point, subject, tuple(answers), error=message)
            raise (error_type or TypeError)(message)
        answers.append(Answer(item.name, item.plugin, item.distribution, value=value))
        if first:
            break
    return Selection(point, subject, tuple(answers))


#: the reason a candidate this rank accepted is not chosen
DECLINED_ELSEWHERE = "declined on another rank of the group"


def select_agreed(asks: Sequence[tuple[str, Sequence, Any, str]], group, device, *, check: Any = callable) -> list[Selection]:
    """The rank-agreed selection of each (point, records, request, subject) in `asks`: every
    candidate is asked on every rank, then one all_reduce over `group` (a `Collectives`) finds,
    per ask, the first candidate every rank accepted. Collective whenever any record is asked:
    every rank must pass asks of the same points in the same order. A candidate that failed on
    any rank makes every rank raise (after the agreement, so no rank is left waiting in it)."""
    local = [_ask(point, (request,), {}, records, (), False, subject, "factory", check, "collect", PluginError)
             for point, records, request, subject in asks]
    flags = [a.accepted for s, (_, records, _, _) in zip(local, asks) for a in _padded(s, records)]
    error = next((s.error for s in local if s.error is not None), None)
    agreed, all_answered = flags, error is None
    if flags:  # no record asked (the same on every rank): nothing to agree on
        *agreed, all_answered = _agree(flags + [error is None], group, device)
    if not all_answered:
        raise PluginError(error or "a record failed at prepare_model on another rank of the group (its error is raised there)")
    out, start = [], 0
    for selection, (point, records, _, subject) in zip(local, asks):
        answers = _padded(selection, records)
        mine = agreed[start : start + len(answers)]
        start += len(answers)
        kept = []
        for answer, ok in zip(answers, mine):
            if ok:
                kept.append(answer)
                break
            kept.append(answer if not answer.accepted else attrs.evolve(answer, value=None, reason=DECLINED_ELSEWHERE))
        out.append(_keep(Selection(point, subject, tuple(kept))))
    return out


def _agree(flags: list[bool], group, device) -> list[bool]:
    """Per flag: whether every rank of `group` raised it (one all_reduce for all of them)."""
    if group is None or group.size == 1:
        return flags
    import torch

    votes = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32, device=device)
    return [int(round(v)) == group.size for v in group.all_reduce(votes).tolist()]


def _padded(selection: Selection, records: Sequence) -> tuple[Answer, ...]:
    """The answers of a `first=False` selection, one per record (a selection cut short by an
    error is padded with declines, so every rank votes on as many flags)."""
    answers = list(selection.answers)
    for item in records[len(answers):]:
        answers.append(Answer(item.name, item.plugin, item.distribution, reason="not asked (an earlier record failed)"))
    return tuple(answers)
