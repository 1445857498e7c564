"""The fusion-provider chain of a stage: explicit `fusions=` first, then the registry, then the
core's unfused completion (registered by the built-in plugin, ranked last).

Providers are plain objects with any of the capabilities of `layer_boundary.plugin`:

- `AttentionInputFusion` / `FfnInputFusion`: `attention_input(stage)` / `ffn_input(stage)`,
  ordered consumer candidates (callables or `FusedMlpInput`), asked once when the stage is
  planned;
- `DefersFinalize`: `can_defer_finalize(plan, forward)`, may this FFN's MoE return a
  `HandoffOutput`;
- `DefersAllReduce`: `can_defer_all_reduce(plan, forward)`, may an FFN whose sum is not a
  single all-reduce leave it to the next input.

Every decision a provider makes per batch must be the same on all ranks. A candidate's result
is checked against the residual it completes (shape, dtype, device: metadata only) before
anything reads it; a wrong one is the plugin's `FusionError`. Inside `counting_candidates()`,
eager calls count each candidate's answers per stage (what `layer-boundary run` reports).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Any, Iterator, Optional, Sequence

import attrs
import torch

from . import _debug as debug
from ._contracts import FusedMlpInput, StageKind
from ._errors import FusionError
from ._layout import SumGroup
from ._plugins.requests import AttentionInputFusion, FfnInputFusion
from ._plugins.results import pair_matches, pair_problem
from ._plugins.selection import disable_hint, select

__all__ = [
    "Candidate",
    "FusionError",
    "build_providers",
    "consumer_candidates",
    "counting_candidates",
    "equivalent_groups",
    "run_candidates",
]


@attrs.frozen
class Candidate:
    """A consumer candidate bound to one plan, with where it came from."""

    fused: FusedMlpInput
    source: str  #: "record 'x.y' of plugin 'x' (distribution d)" or "the stage's fusions= provider P"
    accepts: Optional[frozenset]  #: sum groups it can complete (None: any)
    #: the plugin that contributed it (None: the stage's own `fusions=` provider)
    plugin: Optional[str] = None
    #: the label of the stage it is bound to
    stage: str = ""

    @property
    def name(self) -> str:
        return self.fused.name or getattr(self.fused.run, "__name__", "candidate")

    @property
    def who(self) -> str:
        """The candidate and where it came from, for messages."""
        return f"fusion candidate {self.name!r} from {self.source}"


def build_providers(explicit: Any, description, registry) -> list[tuple[Any, str, Optional[str]]]:
    """(provider, source, plugin) triples: the explicit provider, then every registry provider
    whose factory accepts this stage, in the selection order."""
    given = () if explicit is None else explicit if isinstance(explicit, (list, tuple)) else (explicit,)
    chosen = select(
        "fusion_providers",
        (description,),
        records=registry.fusion_providers,
        explicit=[(p, f"the stage's fusions= provider {type(p).__name__}") for p in given],
        first=False,
        subject=f"building stage {description.label}",
        error_type=FusionError,
        label=description.label,
    )
    return [(a.value, a.source, a.plugin) for a in chosen.accepted]


def equivalent_groups(topology) -> dict[SumGroup, frozenset]:
    """Sum groups that run over the same ranks under this topology."""
    same_tp = topology.attn_tp == topology.tp
    tp_like = {SumGroup.TP, SumGroup.MOE_OUTPUT} | ({SumGroup.ATTN_TP} if same_tp else set())
    out = {g: frozenset({g}) for g in SumGroup}
    for g in tp_like:
        out[g] = frozenset(tp_like)
    return out


def read_format(read) -> Optional[str]:
    """The compute-input format a read produces: "plain", a quantized format, or None (a read no
    fused candidate can stand in for)."""
    fmt = getattr(read, "quant_format", None)
    if fmt is not None:
        return fmt
    return "plain" if read.plain_norm else None


def offered_here(fused: FusedMlpInput, description) -> bool:
    """Whether a stage may run `fused`: it produces the read's format, computes the read's norm
    kind, and applies exactly the post-norm an arriving output owes here (none where none does)."""
    if fused.output_format != description.read_format or description.norm_kind not in fused.norm_kinds:
        return False
    post = description.post_norm_kind
    return not fused.post_norm_kinds if post is None else post in fused.post_norm_kinds


def consumer_candidates(stage, providers, plugins: Sequence[Optional[str]] = ()) -> tuple[Candidate, ...]:
    """The ordered consumer candidates of `stage`'s input; the last one never declines. Only
    candidates of the read's own format, norm kind and post-norm kind are kept (`offered_here`).
    `plugins` names each provider's plugin (None, or missing: the stage's own provider)."""
    ffn = stage.kind is StageKind.FFN
    capability = FfnInputFusion if ffn else AttentionInputFusion
    groups = equivalent_groups(stage.parallel.topology)
    description = stage.description
    out: list[Candidate] = []
    for index, (provider, source) in enumerate(providers):
        plugin = plugins[index] if index < len(plugins) else None
        if not isinstance(provider, capability):
            continue
        offered = provider.ffn_input(stage) if ffn else provider.attention_input(stage)
        for raw in offered or ():
            fused = raw if isinstance(raw, FusedMlpInput) else FusedMlpInput(run=raw)
            if not fused.always and not offered_here(fused, description):
                continue
            accepts = None if fused.completes is None else groups[fused.completes]
            out.append(Candidate(fused, source, accepts, plugin, stage.label))
            if fused.always:
                return tuple(out)
    raise FusionError("the candidate chain has no last-resort candidate; the built-in 'core' plugin must be registered")


#: per thread (a rank of a threaded world runs in one), the answers counted inside
#: `counting_candidates()`; empty when nothing counts, so the hot path reads one global
_COUNTING: dict[int, Counter] = {}


@contextlib.contextmanager
def counting_candidates() -> Iterator[Counter]:
    """Count, in this thread, each consumer candidate's answers at run time: keys
    `(stage label, candidate name, "accepted" | "declined")`. Eager calls only: a call inside
    torch.compile or a CUDA-graph capture is not counted (a graph replays what it captured)."""
    key = threading.get_ident()
    counts: Counter = Counter()
    previous = _COUNTING.get(key)
    _COUNTING[key] = counts
    try:
        yield counts
    finally:
        if previous is None:
            _COUNTING.pop(key, None)
        else:
            _COUNTING[key] = previous


def _count(cand: Candidate, accepted: bool, residual) -> None:
    if torch.compiler.is_compiling():
        return
    counts = _COUNTING.get(threading.get_ident())
    if counts is None or (getattr(residual, "is_cuda", False) and torch.cuda.is_current_stream_capturing()):
        return
    counts[(cand.stage, cand.name, "accepted" if accepted else "declined")] += 1


def run_candidates(candidates, owed, residual, fwd, is_handoff: bool):
    """Try candidates in order; the first non-None result wins. A plugin's result is checked
    (`pair_matches`, metadata only) before it is returned."""
    sum_group = owed.sum_group
    for cand in candidates:
        fused = cand.fused
        if fused.handoff != is_handoff and not fused.always:
            continue
        if cand.accepts is not None and not fused.always and sum_group not in cand.accepts:
            continue
        checking = debug.DEBUG and not fused.always
        if checking:
            before = _versions(owed, residual)
        try:
            out = fused.run(owed, residual, fwd)
        except Exception as exc:
            if fused.always:  # the core's own completion: its error is not a plugin's
                raise
            raise FusionError(f"{cand.who} raised {type(exc).__name__}: {exc}; {disable_hint(cand.plugin)}") from exc
        if _COUNTING:
            _count(cand, out is not None, residual)
        if out is not None:
            plain = fused.output_format == "plain"
            if not fused.always and type(residual) is torch.Tensor and not pair_matches(out, residual, plain):
                raise FusionError(pair_problem(out, residual, cand.who, cand.plugin, plain))
            return out
        if checking and _versions(owed, residual) != before:
            raise FusionError(
                f"{cand.who} declined after modifying its inputs; a candidate must return None before it touches an "
                f"input or starts a collective; {disable_hint(cand.plugin)}"
            )
    raise FusionError("every fusion candidate declined, including the last-resort one")  # pragma: no cover


def _versions(owed, residual) -> "_InputState":
    """What a declining candidate must leave as it was: each input's version counter, or a copy
    of its values where it has none (tensors made under `torch.inference_mode()`, as in model
    runs)."""
    tensors = []
    partial = getattr(owed, "partial", None)
    if partial is not None:
        tensors.append(partial)
    tensors.extend(residual if isinstance(residual, tuple) else (residual,))
    return _InputState(t.clone() if t.is_inference() else t._version for t in tensors if t is not None)


class _InputState(tuple):
    """Version counters and value copies; equal when every version and every value is unchanged."""

    def __eq__(self, other):
        return len(self) == len(other) and all(
            a == b if isinstance(a, int) else a.equal(b) for a, b in zip(self, other)
        )

    def __ne__(self, other):
        return not self == other

    __hash__ = tuple.__hash__
