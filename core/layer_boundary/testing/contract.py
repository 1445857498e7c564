"""The provider contract suite: the rules every fusion provider and residual kind must keep.

Point it at a record (the object, or its registered name) and it raises `ContractViolation`
listing every rule the record breaks::

    from layer_boundary.testing.contract import check_fusion_provider, check_residual_kind

    check_fusion_provider("acme.ar_add_rmsnorm")
    check_residual_kind("acme.mix", options=[{"n_streams": 4}])

or, one pytest test per rule and device (CUDA cases are marked `gpu` and skip without CUDA)::

    from layer_boundary.testing.contract import contract_params

    @pytest.mark.parametrize("case", contract_params("acme.ar_add_rmsnorm"))
    def test_acme_contract(case):
        case.run()

Rules of a fusion provider (`FUSION_CHECKS`):

- record: a dotted name prefixed by its plugin, a priority above the built-in band, a
  description, a factory taking one stage description;
- without_hardware: in a fresh interpreter with CUDA hidden, importing the plugin and calling
  its factory on every stage description never raises, and a factory that declines imports
  nothing beyond the standard library, torch, layer_boundary and the plugin's own package;
- construction: the factory and `attention_input` / `ffn_input` return valid values, the same
  ones when asked twice, and issue the same collectives on every rank;
- none_rule: a candidate that returns None issued no collective through the stage's groups,
  left every input tensor unchanged (values and version counters), and never raised;
- rank_uniform: every decision (accept or decline, `can_defer_*`) is identical on every rank
  for identical batch facts, and accepted results are bitwise identical across ranks;
- parity: accepted results match the unfused reference (`add_rms_norm` of the completed sum)
  within the dtype's tolerance, and a candidate claiming `preserves_residual` keeps it.

Rules of a residual kind (`RESIDUAL_CHECKS`): record, without_hardware, construction (the
factory returns `ResidualOps`, the same flags twice), parity (`update_and_read` equals `read`
after `apply`; a `plain_add` update adds, a `plain_norm` read norms) and row_local (rows are
independent, results repeat bitwise, zero rows work).

Runtime checks run the candidates on every rank of a threaded world (or any world with a
`run(fn, topology, *args)` method, e.g. an NCCL `ProcessWorld`; then pass the record by name).
Collectives a candidate issues outside the stage's `Collectives` (a private communicator) are
not counted; a rank-dependent one shows up as a hang that the world's timeout turns into a
violation.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import subprocess
import sys
from collections import Counter
from typing import Any, Callable, Iterable, Optional, Sequence

import attrs
import torch

from .._builtin.plugin import UnfusedCompletion
from ..collectives import CollectiveCounter, CountingCollectives
from ..construction import arriving_sum
from ..contracts import FusedMlpInput, StageKind
from ..factories import declare_attn, declare_ffn, make_stages
from ..forward import Forward, ForwardMode
from ..fusions import consumer_candidates
from ..layers import MoeFinalizeHandoff
from ..layout import SumGroup
from ..output import HandoffOutput, UnreducedOutput
from ..parallel import Parallel, Topology
from ..plugin.manager import DISABLE_ENV, ENTRY_POINT_GROUP, get_registry, reset_registry
from ..plugin.records import Adapter, FusionProvider, Priority, Registered, ResidualKind
from ..residual import ResidualOps
from ..residual.add_norm import PLAIN_ADD, GemmaRMSNorm, RMSNorm, add_rms_norm

__all__ = [
    "ContractViolation",
    "ContractSettings",
    "ContractReport",
    "ContractCase",
    "FUSION_CHECKS",
    "RESIDUAL_CHECKS",
    "check_fusion_provider",
    "check_residual_kind",
    "contract_cases",
    "contract_params",
]

FUSION_CHECKS = ("record", "without_hardware", "construction", "none_rule", "rank_uniform", "parity")
RESIDUAL_CHECKS = ("record", "without_hardware", "construction", "parity", "row_local")
#: adapters (row transports) get the record rules only
ADAPTER_CHECKS = ("record",)
#: checks that run once per record; the others run once per device
DEVICE_FREE_CHECKS = ("record", "without_hardware")
PROVIDER_HOOKS = ("attention_input", "ffn_input", "can_defer_finalize", "can_defer_all_reduce")
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: the largest relative error against the unfused reference, per dtype
TOLERANCES = (("float64", 1e-10), ("float32", 1e-5), ("bfloat16", 2e-2), ("float16", 4e-3))
#: messages kept per check in a report (the rest are counted)
MAX_MESSAGES = 12


class ContractViolation(AssertionError):
    """A record broke a rule of the provider contract."""


@attrs.frozen(kw_only=True)
class ContractSettings:
    """What the suite runs: topologies, shapes, dtypes, the device, tolerances."""

    #: worlds the runtime checks run in (attention DP and CP never take fused candidates)
    topologies: tuple = (Topology(tp=1), Topology(tp=2))
    #: extra topologies whose stage descriptions the factory must handle (construction only)
    described_topologies: tuple = (Topology(tp=2, attn_dp=2), Topology(tp=4, moe_ep=2))
    hidden_size: int = 64
    rows: tuple = (0, 1, 5, 33)
    dtypes: tuple = ("float32", "bfloat16", "float64", "float16")
    device: str = "cpu"
    tolerances: tuple = TOLERANCES
    #: top-level packages a declining factory may import besides the always-allowed ones
    allow_imports: tuple = ()
    seed: int = 0
    #: seconds a threaded-world collective waits before the run counts as a hang
    timeout: float = 20.0

    def tolerance(self, dtype: str) -> float:
        return dict(self.tolerances)[dtype]


@attrs.define
class ContractReport:
    """Violations per check, and counts of what was exercised (so a pass is never vacuous)."""

    record: str
    kind: str
    violations: dict = attrs.field(factory=dict)
    stats: Counter = attrs.field(factory=Counter)

    def add(self, check: str, message: str) -> None:
        self.violations.setdefault(check, Counter())[message] += 1

    def merge(self, other: "ContractReport") -> "ContractReport":
        for check, messages in other.violations.items():
            for message, n in messages.items():
                self.violations.setdefault(check, Counter())[message] += n
        self.stats.update(other.stats)
        return self

    def failures(self, checks: Optional[Iterable[str]] = None) -> list[str]:
        wanted = None if checks is None else set(checks)
        out = []
        for check, messages in self.violations.items():
            if wanted is not None and check not in wanted:
                continue
            for i, (message, n) in enumerate(messages.items()):
                if i == MAX_MESSAGES:
                    out.append(f"[{check}] ... and {len(messages) - MAX_MESSAGES} more kinds of violation")
                    break
                out.append(f"[{check}] {message}" + (f" (x{n})" if n > 1 else ""))
        return out

    def raise_if_violated(self, checks: Optional[Iterable[str]] = None) -> "ContractReport":
        failures = self.failures(checks)
        if failures:
            raise ContractViolation(
                f"{self.kind} {self.record!r} breaks the provider contract:\n  - " + "\n  - ".join(failures)
            )
        return self

    def to_json(self) -> dict:
        return {"record": self.record, "kind": self.kind, "violations": {k: dict(v) for k, v in self.violations.items()},
                "stats": dict(self.stats)}

    @classmethod
    def from_json(cls, data: dict) -> "ContractReport":
        report = cls(data["record"], data["kind"], stats=Counter(data["stats"]))
        for check, messages in data["violations"].items():
            report.violations[check] = Counter(messages)
        return report


# ---------------------------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------------------------


def _resolve(ref) -> tuple[Any, Optional[Registered]]:
    """(record, its registry entry or None) for a record, a `Registered` or a registered name."""
    if isinstance(ref, Registered):
        return ref.record, ref
    registry = get_registry()
    entries = registry.fusion_providers + registry.residual_kinds + registry.adapters
    if isinstance(ref, str):
        for item in entries:
            if item.name == ref:
                return item.record, item
        names = ", ".join(item.name for item in entries)
        raise LookupError(f"no record named {ref!r} is registered (registered: {names}); install the plugin or pass "
                          "the record itself")
    if not isinstance(ref, (FusionProvider, ResidualKind, Adapter)):
        raise TypeError(f"expected a FusionProvider, ResidualKind or Adapter record (or its name), got {type(ref).__name__}")
    return ref, next((item for item in entries if item.record is ref), None)


def _kind_of(record) -> str:
    return {FusionProvider: "fusion provider", ResidualKind: "residual kind", Adapter: "adapter"}[type(record)]


def _check_record(record, registered: Optional[Registered], report: ContractReport) -> None:
    builtin = registered is not None and registered.plugin == "core"
    if registered is not None and not record.name.startswith(registered.plugin + "."):
        report.add("record", f"name {record.name!r} must start with its plugin's entry-point name {registered.plugin!r}")
    if not isinstance(record.priority, int) or isinstance(record.priority, bool):
        report.add("record", f"priority must be an int, got {record.priority!r}")
    elif not builtin and record.priority <= Priority.BUILTIN:
        report.add("record", f"priority {record.priority} is in the built-in band (<= {Priority.BUILTIN}): the core's "
                             "never-declining candidate would always run first; use Priority.REFERENCE or above")
    if not record.description.strip():
        report.add("record", "description is empty; `layer-boundary plugins` shows it to users")
    if isinstance(record, FusionProvider):
        try:
            inspect.signature(record.factory).bind(None)
        except TypeError:
            report.add("record", "factory must take exactly one argument, the stage description")
        except ValueError:  # builtins without a signature
            pass
    elif not (isinstance(record.kind, str) and record.kind):
        report.add("record", f"kind must be a non-empty string, got {record.kind!r}")
    report.stats["records_checked"] += 1


# ---------------------------------------------------------------------------------------------
# stage situations: the stages a provider is asked about
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class Situation:
    """A consumer stage in context; `boundary(parallel, norm_of)` builds it."""

    name: str
    build: Callable
    #: owed values the consumer's input receives: "declared", "deferred", "handoff"
    owed: tuple

    def boundary(self, parallel, norm_of):
        return self.build(parallel, norm_of, self.name)


def _ffn_after_attention(parallel, norm_of, label, sparse=False):
    _, ffn = make_stages((declare_attn(), norm_of()), (declare_ffn(sparse=sparse), norm_of()), following=declare_attn(),
                         parallel=parallel, reduction="ar", label=label)
    return ffn


def _attention_after_ffn(parallel, norm_of, label, sparse=False, terminal=True):
    attn, _ = make_stages((declare_attn(), norm_of()), (declare_ffn(), norm_of()), previous=declare_ffn(sparse=sparse),
                          terminal=terminal, parallel=parallel, reduction="ar", label=label)
    return attn


def _attention_at_entry(parallel, norm_of, label):
    attn, _ = make_stages((declare_attn(), norm_of()), (declare_ffn(), norm_of()), terminal=True, parallel=parallel,
                          reduction="ar", label=label)
    return attn


def _attention_after_scaled_ffn(parallel, norm_of, label):
    class HalfUpdate:  # a non-plain update: the core never offers candidates here
        plain_add, at_producer, outlives_layer = False, False, True

        def apply(self, contribution, residual):
            return (contribution + residual) * 0.5

    attn, _ = make_stages((declare_attn(), norm_of()), (declare_ffn(), norm_of()),
                          previous=declare_ffn(update=HalfUpdate()), terminal=True, parallel=parallel, reduction="ar",
                          label=label)
    return attn


SITUATIONS = (
    Situation("ffn_after_attention", _ffn_after_attention, ("declared",)),
    Situation("moe_after_attention", functools.partial(_ffn_after_attention, sparse=True), ("declared",)),
    Situation("attention_after_ffn", _attention_after_ffn, ("deferred",)),
    Situation("attention_after_moe", functools.partial(_attention_after_ffn, sparse=True, terminal=False),
              ("deferred", "handoff")),
    Situation("attention_at_entry", _attention_at_entry, ()),
    Situation("attention_after_scaled_ffn", _attention_after_scaled_ffn, ()),
)
NORM_KINDS = ("rms", "gemma_rms", "other")


class _OtherNorm(torch.nn.Module):
    """A norm that is not an RMSNorm (LayerNorm without bias): no fused candidate applies."""

    def __init__(self, hidden, dtype, device):
        super().__init__()
        self.inner = torch.nn.LayerNorm(hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        return self.inner(x)


def _norm(kind: str, hidden: int, dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if kind == "other":
        return _OtherNorm(hidden, dtype, device)
    norm = (RMSNorm if kind == "rms" else GemmaRMSNorm)(hidden, 1e-6, dtype=dtype, device=device)
    with torch.no_grad():  # weights away from 1 (and 0 for Gemma) so a misread weight shows
        base = 1.0 if kind == "rms" else 0.0
        norm.weight.copy_(base + 0.25 * torch.randn(hidden, generator=gen, dtype=torch.float64).to(dtype))
    return norm


class _NoCollectives:
    """Groups of a world that does not exist: construction must not need one."""

    def __init__(self, name, ranks):
        self.name, self.ranks, self.size, self.rank = name, tuple(ranks), len(ranks), 0

    def __getattr__(self, op):
        if op not in ("all_reduce", "reduce_scatter", "reduce_scatterv", "all_gather", "all_gatherv"):
            raise AttributeError(op)
        raise RuntimeError(f"{op} over {self.name} during stage construction; construction must not run a collective")


def stage_descriptions(settings: ContractSettings) -> list:
    """Every (situation, norm kind, topology) description a factory is asked about, built with the
    core's own providers only (so no plugin factory runs while describing)."""
    out = []
    for topology in settings.topologies + settings.described_topologies:
        parallel = Parallel.create(topology, 0, _NoCollectives)
        for situation in SITUATIONS:
            for kind in NORM_KINDS:
                boundary = situation.boundary(parallel, lambda: _norm(kind, settings.hidden_size, torch.float32, "cpu", 0))
                out.append(boundary.plan.description)
    return out


# ---------------------------------------------------------------------------------------------
# fusion providers: construction and runtime on every rank
# ---------------------------------------------------------------------------------------------


def _device(name: str) -> torch.device:
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def _candidate_facts(candidates) -> list[tuple]:
    return [(c.name, c.fused.completes, c.fused.handoff, c.fused.preserves_residual) for c in candidates]


def _build_provider(record, plan, report: ContractReport, builtin: bool, where: str):
    """The factory's provider for `plan` and its candidates, checking both; (provider, candidates)."""
    try:
        provider = record.factory(plan.description)
        again = record.factory(plan.description)
    except Exception as exc:  # noqa: BLE001 - the contract reports it
        report.add("construction", f"factory raised on the {where} stage: {type(exc).__name__}: {exc}")
        return None, ()
    if (provider is None) != (again is None):
        report.add("construction", f"factory gave different answers when asked twice about the {where} stage")
    if provider is None:
        report.stats["stages_declined"] += 1
        return None, ()
    report.stats["stages_accepted"] += 1
    if not any(callable(getattr(provider, hook, None)) for hook in PROVIDER_HOOKS):
        report.add("construction", f"factory returned {type(provider).__name__}, which has none of {', '.join(PROVIDER_HOOKS)}")
        return None, ()
    method = "ffn_input" if plan.kind is StageKind.FFN else "attention_input"
    if getattr(provider, method, None) is None:
        return provider, ()
    try:
        raw = list(getattr(provider, method)(plan) or ())
        raw_again = list(getattr(provider, method)(plan) or ())
    except Exception as exc:  # noqa: BLE001
        report.add("construction", f"{method}(plan) raised on the {where} stage: {type(exc).__name__}: {exc}")
        return None, ()
    for item in raw:
        if not (isinstance(item, FusedMlpInput) or callable(item)):
            report.add("construction", f"{method}(plan) returned {type(item).__name__}; expected FusedMlpInput or a callable")
            return None, ()
        if isinstance(item, FusedMlpInput) and item.always and not builtin:
            report.add("construction", f"candidate {item.name!r} sets always=True, which only the core's unfused completion may")
        if isinstance(item, FusedMlpInput) and item.completes is not None and not isinstance(item.completes, SumGroup):
            report.add("construction", f"candidate {item.name!r}: completes must be a SumGroup or None, got {item.completes!r}")
            return None, ()
    source = f"record {record.name!r}"
    candidates = consumer_candidates(plan, [(_Listed(raw), source), (UnfusedCompletion(), "core")])[: len(raw)]
    again_c = consumer_candidates(plan, [(_Listed(raw_again), source), (UnfusedCompletion(), "core")])[: len(raw_again)]
    if _candidate_facts(candidates) != _candidate_facts(again_c):
        report.add("construction", f"{method}(plan) listed different candidates when asked twice on the {where} stage")
    report.stats["candidates_listed"] += len(candidates)
    return provider, candidates


class _Listed:
    """A provider that lists already-built candidates (to reuse the core's candidate binding)."""

    def __init__(self, items):
        self.items = items

    def attention_input(self, plan):
        return self.items

    ffn_input = attention_input


def _tensors_of(owed) -> list:
    if isinstance(owed, UnreducedOutput):
        return [owed.partial]
    return [owed.expert_rows, owed.weights, owed.indices]


def _make_owed(kind: str, plan, rows: int, dtype, device, gen: torch.Generator):
    """An owed value of `kind` for `plan`'s input on this rank, and a clone over the uncounted group."""
    _, sum_group = arriving_sum(plan.declaration)
    group = plan.group(sum_group)
    inner = getattr(group, "inner", group)
    H = plan.norm.hidden_size
    if kind == "handoff":
        k = 2
        expert_rows = torch.randn(rows, k, H, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
        weights = torch.rand(rows, k, generator=gen, dtype=torch.float64).to(dtype=torch.float32, device=device)
        indices = torch.randint(0, 4, (rows, k), generator=gen).to(device)
        owed = MoeFinalizeHandoff(expert_rows, weights, indices, None, group, sum_group)
        clone = MoeFinalizeHandoff(expert_rows.clone(), weights.clone(), indices.clone(), None, inner, sum_group)
        return owed, clone
    partial = torch.randn(rows, H, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
    declared = kind == "declared"
    return (UnreducedOutput(partial, group, sum_group, declared=declared),
            UnreducedOutput(partial.clone(), inner, sum_group, declared=declared))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    scale = want64.abs().max().item() if want64.numel() else 0.0
    err = (got64 - want64).abs().max().item() if want64.numel() else 0.0
    return err / scale if scale else err


class _RankRun:
    """One rank's pass over every situation, dtype and row count."""

    def __init__(self, parallel, record, builtin: bool, settings: ContractSettings):
        self.record, self.builtin, self.settings = record, builtin, settings
        self.counter = CollectiveCounter()
        self.parallel = parallel.with_groups(lambda g: CountingCollectives(g, self.counter))
        self.report = ContractReport(record.name, "fusion provider")
        self.decisions: list[tuple[str, Any]] = []
        self.outputs: dict[str, tuple] = {}
        self.device = _device(settings.device)
        self.case = 0
        self.plans = 0

    def run(self) -> dict:
        s = self.settings
        with torch.no_grad():
            for situation in SITUATIONS:
                for norm_kind in NORM_KINDS:
                    for dtype_name in s.dtypes:
                        self._situation(situation, norm_kind, dtype_name)
        return {"report": self.report.to_json(), "decisions": self.decisions, "outputs": self.outputs}

    def _situation(self, situation, norm_kind, dtype_name):
        s, dtype = self.settings, DTYPES[dtype_name]
        self.plans += 1
        seed = s.seed + self.plans
        boundary = situation.boundary(self.parallel, lambda: _norm(norm_kind, s.hidden_size, dtype, self.device, seed))
        plan = boundary.plan
        tag = f"{situation.name}/{norm_kind}/{dtype_name}/tp{plan.parallel.topology.tp}"
        self.counter.reset()
        where = f"{situation.name} (tp={plan.parallel.topology.tp}, norm {norm_kind})"
        provider, candidates = _build_provider(self.record, plan, self.report, self.builtin, where)
        self.decisions.append((f"{tag}: construction", (provider is not None, _candidate_facts(candidates),
                                                        self.counter.snapshot())))
        if provider is None:
            return
        self._defer_hooks(provider, plan, tag)
        entry = next(iter(plan.paths.values())).entry
        if not entry.candidates:  # the core offers no candidate at this stage (non-plain update, other norm)
            return
        for owed_kind in situation.owed:
            for cand in candidates:
                if cand.fused.handoff != (owed_kind == "handoff"):
                    continue
                _, sum_group = arriving_sum(plan.declaration)
                if cand.accepts is not None and sum_group not in cand.accepts:
                    continue
                for rows in s.rows:
                    self._case(plan, cand, owed_kind, rows, dtype_name, f"{tag}/{owed_kind}/{cand.name}/rows{rows}")

    def _defer_hooks(self, provider, plan, tag):
        if plan.kind is not StageKind.FFN:
            return
        for hook in ("can_defer_finalize", "can_defer_all_reduce"):
            fn = getattr(provider, hook, None)
            if fn is None:
                continue
            for rows in self.settings.rows:
                for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
                    fwd = Forward(self.parallel, rows, mode=mode)
                    try:
                        answer = fn(plan, fwd)
                    except Exception as exc:  # noqa: BLE001
                        self.report.add("construction", f"{hook} raised: {type(exc).__name__}: {exc}")
                        continue
                    if not isinstance(answer, bool):
                        self.report.add("construction", f"{hook} returned {type(answer).__name__}; it must return a bool")
                    self.decisions.append((f"{tag}: {hook}(rows={rows}, {mode.name})", answer))
                    self.report.stats[f"{hook}_asked"] += 1

    def _case(self, plan, cand, owed_kind, rows, dtype_name, case_id):
        s, dtype, report = self.settings, DTYPES[dtype_name], self.report
        self.case += 1
        shared = torch.Generator().manual_seed(s.seed * 1_000_003 + self.case)
        mine = torch.Generator().manual_seed(s.seed * 1_000_003 + self.case + 7919 * (self.parallel.rank + 1))
        residual = torch.randn(rows, plan.norm.hidden_size, generator=shared, dtype=torch.float64).to(dtype=dtype, device=self.device)
        owed, owed_ref = _make_owed(owed_kind, plan, rows, dtype, self.device, mine)
        want = add_rms_norm(plan.norm, owed_ref.complete(), residual.clone())
        inputs = _tensors_of(owed) + [residual]
        versions = [t._version for t in inputs]
        values = [t.clone() for t in inputs]
        fwd = Forward(self.parallel, rows, mode=ForwardMode.DECODE if rows == 1 else ForwardMode.EXTEND)
        self.counter.reset()
        try:
            out = cand.fused.run(owed, residual, fwd)
        except Exception as exc:  # noqa: BLE001
            report.add("none_rule", f"candidate {cand.name!r} raised on {owed_kind} {dtype_name} input: {type(exc).__name__}: "
                                    f"{exc}; decline with None instead")
            self.decisions.append((case_id, "raised"))
            return
        issued = self.counter.snapshot()
        accepted = out is not None
        self.decisions.append((case_id, accepted))
        report.stats["cases_accepted" if accepted else "cases_declined"] += 1
        if not accepted:
            self._check_decline(cand, owed, inputs, versions, values, issued, case_id)
            return
        if not self._valid_output(cand, out, residual, rows, case_id):
            return
        got_input, got_residual = out
        tol = s.tolerance(dtype_name)
        for what, got, ref in (("input", got_input, want[0]), ("residual", got_residual, want[1])):
            err = _relative_error(got, ref)
            if err > tol:
                report.add("parity", f"candidate {cand.name!r}: the {what} differs from the unfused reference by {err:.2e} "
                                     f"relative (tolerance {tol:.0e}, {dtype_name}) on {case_id}")
        if cand.fused.preserves_residual and not (residual._version == versions[-1] and torch.equal(residual, values[-1])):
            report.add("parity", f"candidate {cand.name!r} claims preserves_residual but wrote the old residual ({case_id})")
        self.outputs[case_id] = (got_input.detach().cpu(), got_residual.detach().cpu())

    def _check_decline(self, cand, owed, inputs, versions, values, issued, case_id):
        report = self.report
        if issued:
            report.add("none_rule", f"candidate {cand.name!r} declined after issuing {issued}: decide before any collective")
        touched = [i for i, t in enumerate(inputs) if t._version != versions[i] or not torch.equal(t, values[i])]
        if touched:
            report.add("none_rule", f"candidate {cand.name!r} declined after modifying its inputs; return None before "
                                    "touching an input")
        if [id(t) for t in _tensors_of(owed)] != [id(t) for t in inputs[:-1]]:
            report.add("none_rule", f"candidate {cand.name!r} declined after replacing the owed value's tensors")

    def _valid_output(self, cand, out, residual, rows, case_id) -> bool:
        ok = isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
        if ok:
            ok = all(t.shape == residual.shape and t.dtype == residual.dtype and t.device == residual.device for t in out)
        if not ok:
            shapes = [(tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
                      for t in (out if isinstance(out, (tuple, list)) else (out,))]
            self.report.add("parity", f"candidate {cand.name!r} must return (input, new_residual) shaped, typed and placed like "
                                      f"the residual {tuple(residual.shape)} {residual.dtype}; got {shapes} ({case_id})")
        return ok


def _fusion_rank(parallel, record_ref, settings: ContractSettings) -> dict:
    """One rank's runtime pass (module-level, so process worlds can run it by name)."""
    record, registered = _resolve(record_ref)
    builtin = registered is not None and registered.plugin == "core"
    return _RankRun(parallel, record, builtin, settings).run()


def _compare_ranks(results: list[dict], topology, report: ContractReport) -> None:
    first = results[0]
    for rank, res in enumerate(results[1:], start=1):
        for (case, a), (_, b) in zip(first["decisions"], res["decisions"]):
            if a != b:
                report.add("rank_uniform", f"rank 0 and rank {rank} of tp={topology.tp} decided differently on {case}: "
                                           f"{a!r} vs {b!r}; decisions must depend only on facts every rank shares")
                break
        if len(first["decisions"]) != len(res["decisions"]):
            report.add("rank_uniform", f"rank 0 and rank {rank} made a different number of decisions")
        for case, (inp, resid) in first["outputs"].items():
            other = res["outputs"].get(case)
            if other is not None and not (torch.equal(inp, other[0]) and torch.equal(resid, other[1])):
                report.add("rank_uniform", f"rank 0 and rank {rank} got different results on {case}; every rank of the sum "
                                           "group must hold the same residual")


def _runtime_report(record_ref, name: str, settings: ContractSettings, world=None) -> ContractReport:
    from ..launch import RankTimeout
    from .threaded import CollectiveAborted, ThreadWorld

    report = ContractReport(name, "fusion provider")
    for topology in settings.topologies:
        if world is not None and getattr(world, "size", topology.world_size) != topology.world_size:
            continue
        runner = world if world is not None else ThreadWorld(topology.world_size, timeout=settings.timeout)
        try:
            results = runner.run(_fusion_rank, topology, record_ref, settings)
        except (CollectiveAborted, RankTimeout) as exc:
            report.add("rank_uniform", f"ranks of tp={topology.tp} did not meet in a collective ({exc}); a candidate or "
                                       "hook decided differently on some rank, or issued a collective only on some ranks")
            continue
        for res in results:
            report.merge(ContractReport.from_json(res["report"]))
        _compare_ranks(results, topology, report)
        report.stats["worlds"] += 1
    return report


# ---------------------------------------------------------------------------------------------
# residual kinds
# ---------------------------------------------------------------------------------------------


def _rows(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _take(value, index):
    parts = [t[index] for t in _rows(value)]
    return tuple(parts) if isinstance(value, (tuple, list)) else parts[0]


def _clone(value):
    parts = [t.clone() for t in _rows(value)]
    return tuple(parts) if isinstance(value, (tuple, list)) else parts[0]


def _pairs_error(got, want) -> float:
    got_parts, want_parts = _rows(got), _rows(want)
    if len(got_parts) != len(want_parts) or any(a.shape != b.shape for a, b in zip(got_parts, want_parts)):
        return float("inf")
    return max((_relative_error(a, b) for a, b in zip(got_parts, want_parts)), default=0.0)


def _same_bits(a, b) -> bool:
    pa, pb = _rows(a), _rows(b)
    return len(pa) == len(pb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(pa, pb))


def _residual_laws(ops: ResidualOps, tag: str, settings: ContractSettings, report: ContractReport) -> None:
    device = _device(settings.device)
    H = settings.hidden_size
    for dtype_name in settings.dtypes:
        dtype, tol = DTYPES[dtype_name], settings.tolerance(dtype_name)
        for norm_kind in ("rms", "gemma_rms"):
            norm = _norm(norm_kind, H, dtype, device, settings.seed)
            for rows in settings.rows:
                gen = torch.Generator().manual_seed(settings.seed + rows)
                hidden = torch.randn(rows, H, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
                contribution = torch.randn(rows, H, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
                case = f"{tag} {dtype_name} {norm_kind} rows={rows}"
                for first, update, second in ((ops.attn_read, ops.attn_update, ops.ffn_read),
                                              (ops.ffn_read, ops.ffn_update, ops.attn_read)):
                    try:
                        _one_law(first, update, second, hidden, contribution, norm, rows, tol, case, report)
                    except Exception as exc:  # noqa: BLE001
                        report.add("parity", f"{case}: {type(exc).__name__}: {exc}")


def _one_law(first, update, second, hidden, contribution, norm, rows, tol, case, report) -> None:
    compute, residual = first.read(first.enter(hidden), norm)
    if not isinstance(compute, torch.Tensor) or compute.shape[0] != rows or any(t.shape[0] != rows for t in _rows(residual)):
        report.add("parity", f"{case}: read() must return (compute input, residual) with {rows} rows each")
        return
    fused = second.update_and_read(update, contribution.clone(), _clone(residual), norm)
    applied = update.apply(contribution.clone(), _clone(residual))
    unfused = second.read(applied, norm)
    err = max(_pairs_error(fused[0], unfused[0]), _pairs_error(fused[1], unfused[1]))
    report.stats["laws_checked"] += 1
    if err > tol:
        report.add("parity", f"{case}: update_and_read() differs from read(apply()) by {err:.2e} relative (tolerance {tol:.0e})")
    if update.plain_add:
        if isinstance(residual, (tuple, list)):
            report.add("parity", f"{case}: a plain_add update over a tuple residual; plain_add means residual + contribution")
        elif _pairs_error(applied, PLAIN_ADD.apply(contribution, residual)) > tol:
            report.add("parity", f"{case}: the update claims plain_add but apply() is not residual + contribution")
    if second.plain_norm:
        if isinstance(applied, (tuple, list)):
            report.add("parity", f"{case}: a plain_norm read over a tuple residual; plain_norm means norm(residual)")
        elif _pairs_error(unfused[0], norm(applied)) > tol or not _same_bits(unfused[1], applied):
            report.add("parity", f"{case}: the read claims plain_norm but read() is not (norm(residual), residual)")
    # rows are independent, results repeat bitwise
    again = update.apply(contribution.clone(), _clone(residual))
    if not _same_bits(applied, again):
        report.add("row_local", f"{case}: apply() gave different bits for the same inputs")
    if rows > 1:
        index = torch.arange(0, rows, 2, device=contribution.device)
        part = update.apply(contribution[index].clone(), _take(residual, index))
        if _pairs_error(part, _take(applied, index)) > tol:
            report.add("row_local", f"{case}: apply() on a subset of rows differs from the same rows of the full batch; "
                                    "the boundary splits rows over ranks")
        read_part = second.read(_take(applied, index), norm)
        if _pairs_error(read_part[0], unfused[0][index]) > tol:
            report.add("row_local", f"{case}: read() on a subset of rows differs from the same rows of the full batch")


def _residual_report(record, options: Sequence[dict], settings: ContractSettings) -> ContractReport:
    report = ContractReport(record.name, "residual kind")
    with torch.no_grad():
        for opts in options:
            tag = f"options {opts}" if opts else "no options"
            try:
                ops, again = record.factory(**opts), record.factory(**opts)
            except Exception as exc:  # noqa: BLE001
                report.add("construction", f"factory(**{opts}) raised {type(exc).__name__}: {exc}")
                continue
            if not isinstance(ops, ResidualOps):
                report.add("construction", f"factory(**{opts}) returned {type(ops).__name__}; expected ResidualOps")
                continue
            flags = lambda o: (o.name, o.supports_slices, repr(o.attn_update.plain_add), repr(o.ffn_read.plain_norm))  # noqa: E731
            if not isinstance(again, ResidualOps) or flags(ops) != flags(again):
                report.add("construction", f"factory(**{opts}) built different ops when called twice")
            report.stats["ops_built"] += 1
            _residual_laws(ops, tag, settings, report)
    return report


# ---------------------------------------------------------------------------------------------
# without hardware: a fresh interpreter with CUDA hidden
# ---------------------------------------------------------------------------------------------


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _foreign(new_modules: Iterable[str], baseline_tops: set, own: set) -> list[str]:
    allowed = baseline_tops | own | set(sys.stdlib_module_names) | {"torch", "layer_boundary"}
    return sorted({_top(m) for m in new_modules if _top(m) not in allowed and not _top(m).startswith("_")})


def _hardware_free_report(record, registered, descriptions, baseline_tops: set, plugin_imports: list, options,
                          allow: set) -> ContractReport:
    """What `record`'s factory does when no accelerator is present (CUDA hidden or absent)."""
    report = ContractReport(record.name, _kind_of(record))
    own = {_top(getattr(record.factory, "__module__", "") or "")} | allow
    if registered is not None:
        own.add(registered.plugin)
        if plugin_imports:
            report.add("without_hardware", f"importing plugin {registered.plugin!r} imported {', '.join(plugin_imports)}; "
                                           "keep heavy imports inside factories, after the applicability checks")
    provider = isinstance(record, FusionProvider)
    for item in descriptions if provider else [dict(o) for o in options or ({},)]:
        before = set(sys.modules)
        try:
            result = record.factory(item) if provider else record.factory(**item)
        except Exception as exc:  # noqa: BLE001
            where = f"the {item.label} stage (norm {item.norm_kind}, tp={item.topology.tp})" if provider else f"options {item}"
            report.add("without_hardware", f"factory raised without CUDA on {where}: {type(exc).__name__}: {exc}; "
                                           "return None when the hardware is missing")
            continue
        heavy = _foreign(set(sys.modules) - before, baseline_tops, own | {_top(m) for m in own})
        declined = result is None
        report.stats["factory_calls_without_hardware"] += 1
        report.stats["declined_without_hardware" if declined else "accepted_without_hardware"] += 1
        if heavy and (declined or not provider):
            report.add("without_hardware", f"factory imported {', '.join(heavy)} without CUDA"
                                           + (" and then declined" if declined else "")
                                           + "; decide from the description first, import after")
    return report


def without_hardware(names: Sequence[str], settings: ContractSettings, options: Optional[dict] = None) -> dict:
    """Run inside a fresh interpreter with CUDA hidden: per record name, a report of what its
    plugin's import and its factory do without an accelerator. Each plugin is checked in a
    forked child of this interpreter, so one plugin's imports never hide another's. `options`
    maps residual-kind names to option lists."""
    from importlib import metadata

    from ..plugin.manager import BUILTIN_PLUGINS

    entry_points = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    previous = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = ",".join(ep.name for ep in entry_points)  # describe stages with the core alone
    reset_registry()
    try:
        descriptions = stage_descriptions(settings)
    finally:
        if previous is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = previous
        reset_registry()
    baseline_tops = {_top(m) for m in sys.modules}
    disabled = {n.strip() for n in (previous or "").split(",")}
    sources = [(name, functools.partial(importlib.import_module, module)) for name, module in BUILTIN_PLUGINS]
    sources += [(ep.name, ep.load) for ep in entry_points if ep.name not in disabled]
    wanted = set(names)
    out: dict = {}
    for plugin, load in sources:
        check = functools.partial(_plugin_without_hardware, plugin, load, wanted, descriptions, baseline_tops, options or {},
                                  set(settings.allow_imports))
        out.update(_in_child(check, settings.timeout * 10))
    for name in wanted - set(out):
        report = ContractReport(name, "record")
        report.add("without_hardware", f"no plugin loaded in a fresh interpreter registers {name!r} (disabled, or failed to load?)")
        out[name] = report.to_json()
    return out


def _plugin_without_hardware(plugin, load, wanted, descriptions, baseline_tops, options, allow) -> dict:
    before = set(sys.modules)
    try:
        module = load()
    except Exception:  # noqa: BLE001 - the registry reports load failures itself
        return {}
    imports = _foreign(set(sys.modules) - before, baseline_tops, {_top(getattr(module, "__name__", ""))} | allow)
    out = {}
    for hook in ("layer_boundary_fusion_providers", "layer_boundary_residual_kinds"):
        for record in getattr(module, hook, lambda: ())() or ():
            if record.name in wanted:
                registered = Registered(record, plugin, None, None)
                report = _hardware_free_report(record, registered, descriptions, baseline_tops, imports, options.get(record.name), allow)
                out[record.name] = report.to_json()
    return out


def _in_child(fn: Callable[[], dict], timeout: float) -> dict:
    """`fn()` in a forked child (its imports stay there); in this process where fork is missing."""
    if not hasattr(os, "fork"):
        return fn()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, then leave without running the parent's exit handlers
        os.close(read_end)
        try:
            payload = json.dumps(fn()).encode()
        except BaseException as exc:  # noqa: BLE001
            payload = json.dumps({"__error__": f"{type(exc).__name__}: {exc}"}).encode()
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(payload)
        os._exit(0)
    os.close(write_end)
    chunks = []
    with os.fdopen(read_end, "rb") as pipe:
        import select

        while True:
            ready, _, _ = select.select([pipe], [], [], timeout)
            if not ready:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise RuntimeError(f"a plugin's without-hardware check did not finish within {timeout:.0f}s")
            chunk = pipe.read1(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)
    data = json.loads(b"".join(chunks) or b"{}")
    if "__error__" in data:
        raise RuntimeError(f"the without-hardware check failed: {data['__error__']}")
    return data


def _without_hardware_here(record, registered, settings: ContractSettings, options) -> ContractReport:
    """The in-process fallback for a record no entry point registers: sound only without CUDA,
    and blind to imports that earlier code of this process already made."""
    if torch.cuda.is_available():
        report = ContractReport(record.name, _kind_of(record))
        report.add("without_hardware", "a fresh interpreter with CUDA hidden cannot load a record that no entry point "
                                       "registers; install the plugin (pip install -e) to run this check here")
        return report
    descriptions = stage_descriptions(settings) if isinstance(record, FusionProvider) else ()
    baseline = {_top(m) for m in sys.modules}
    return _hardware_free_report(record, registered, descriptions, baseline, [], options, set(settings.allow_imports))


def _without_hardware_subprocess(names: Sequence[str], settings: ContractSettings, options: Optional[dict]) -> dict:
    payload = json.dumps({"names": list(names), "settings": _settings_json(settings), "options": options or {}})
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-m", "layer_boundary.testing.contract", "--without-hardware"], input=payload,
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"the without-hardware check failed to run:\n{proc.stderr}")
    return json.loads(proc.stdout)


def _settings_json(settings: ContractSettings) -> dict:
    data = attrs.asdict(settings, recurse=False)
    for key in ("topologies", "described_topologies"):
        data[key] = [attrs.asdict(t) for t in data[key]]
    return data


def _settings_from_json(data: dict) -> ContractSettings:
    data = dict(data)
    for key in ("topologies", "described_topologies"):
        data[key] = tuple(Topology(**t) for t in data[key])
    data["tolerances"] = tuple(tuple(t) for t in data["tolerances"])
    return ContractSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


# ---------------------------------------------------------------------------------------------
# the public entry points
# ---------------------------------------------------------------------------------------------


def _report(record_ref, check: str, device: str, settings: ContractSettings, options, world, hardware_batch) -> ContractReport:
    record, registered = _resolve(record_ref)
    name, kind = record.name, _kind_of(record)
    settings = attrs.evolve(settings, device=device)
    if check == "record":
        report = ContractReport(name, kind)
        _check_record(record, registered, report)
        return report
    if check == "without_hardware":
        if registered is None:
            return _without_hardware_here(record, registered, settings, options)
        data = hardware_batch(name) if hardware_batch else _without_hardware_subprocess([name], settings, {name: options})[name]
        return ContractReport.from_json(data)
    if device == "cuda" and not torch.cuda.is_available():
        raise ContractViolation("the CUDA checks need a CUDA device")  # contract_params marks these to skip
    key = (record, settings, repr(options), world)  # strong references: no reuse of a freed id
    if key not in _PASSES:  # one pass feeds several checks: run it once per record, device and settings
        if isinstance(record, FusionProvider):
            _PASSES[key] = _runtime_report(record_ref if world is not None else record, name, settings, world)
        else:
            _PASSES[key] = _residual_report(record, options, settings)
    return _PASSES[key]


_PASSES: dict = {}


def _checks_for(record, checks):
    allowed = {FusionProvider: FUSION_CHECKS, ResidualKind: RESIDUAL_CHECKS, Adapter: ADAPTER_CHECKS}[type(record)]
    checks = allowed if checks is None else tuple(checks)
    unknown = [c for c in checks if c not in allowed]
    if unknown:
        raise ValueError(f"unknown checks {unknown} for a {_kind_of(record)}; choose from {allowed}")
    return checks


def check_fusion_provider(record, *, checks: Optional[Sequence[str]] = None, devices: Sequence[str] = ("cpu",),
                          settings: Optional[ContractSettings] = None, world=None) -> ContractReport:
    """Run the contract on a `FusionProvider` (the record, or its registered name).

    `world`: run the runtime checks in this world (`run(fn, topology, *args)`, e.g. an NCCL
    `ProcessWorld`; pass the record by name then) instead of a threaded one per topology.
    Raises `ContractViolation` naming every broken rule; returns the report otherwise.
    """
    resolved, _ = _resolve(record)
    if not isinstance(resolved, FusionProvider):
        raise TypeError(f"{resolved.name!r} is a {_kind_of(resolved)}; use check_residual_kind")
    return _check(record, resolved, checks, devices, settings or ContractSettings(), (), world)


def check_residual_kind(record, *, options: Sequence[dict] = ({},), checks: Optional[Sequence[str]] = None,
                        devices: Sequence[str] = ("cpu",), settings: Optional[ContractSettings] = None) -> ContractReport:
    """Run the contract on a `ResidualKind` (the record, or its registered name), building its
    ops with each of `options` (keyword arguments of `residual_kind(kind, **options)`)."""
    resolved, _ = _resolve(record)
    if not isinstance(resolved, ResidualKind):
        raise TypeError(f"{resolved.name!r} is a {_kind_of(resolved)}; use check_fusion_provider")
    return _check(record, resolved, checks, devices, settings or ContractSettings(), tuple(dict(o) for o in options), None)


def _check(ref, resolved, checks, devices, settings, options, world) -> ContractReport:
    report = ContractReport(resolved.name, _kind_of(resolved))
    parts: list[ContractReport] = []
    for check in _checks_for(resolved, checks):
        for device in (("cpu",) if check in DEVICE_FREE_CHECKS else devices):
            part = _report(ref, check, device, settings, options, world, None).raise_if_violated([check])
            if not any(part is p for p in parts):  # several checks read one pass
                parts.append(part)
                report.merge(part)
    return report


@attrs.frozen
class ContractCase:
    """One rule of the contract for one record on one device; `run()` raises on a violation."""

    record: Any
    name: str
    check: str
    device: str
    settings: ContractSettings
    options: tuple = ()
    batch: Any = attrs.field(default=None, eq=False, repr=False)

    def run(self) -> ContractReport:
        hardware = self.batch.get if self.batch is not None else None
        return _report(self.record, self.check, self.device, self.settings, self.options, None, hardware).raise_if_violated([self.check])

    def __str__(self) -> str:
        return f"{self.name}::{self.check}" + ("" if self.check in DEVICE_FREE_CHECKS else f"[{self.device}]")


class _HardwareBatch:
    """One fresh interpreter answers the without-hardware check of every registered record."""

    def __init__(self, names, settings, options):
        self.names, self.settings, self.options = list(names), settings, options
        self._data: Optional[dict] = None

    def get(self, name: str) -> dict:
        if self._data is None:
            self._data = _without_hardware_subprocess(self.names, self.settings, self.options)
        return self._data[name]


def contract_cases(*records, options: Optional[dict] = None, devices: Sequence[str] = ("cpu", "cuda"),
                   settings: Optional[ContractSettings] = None) -> list[ContractCase]:
    """One `ContractCase` per (record, check, device). `records` are records or registered names
    (none: every registered record; adapters get the record rules only); `options` maps a
    residual kind's name to the option sets its ops are built with."""
    settings = settings or ContractSettings()
    options = dict(options or {})
    if not records:
        registry = get_registry()
        records = tuple(item.name for item in registry.fusion_providers + registry.residual_kinds + registry.adapters)
    resolved = [(_resolve(r), r) for r in records]
    registered_names = [rec.name for (rec, reg), _ in resolved if reg is not None and not isinstance(rec, Adapter)]
    batch = _HardwareBatch(registered_names, settings, {n: [dict(o) for o in options.get(n, [{}])] for n in registered_names})
    cases = []
    for (record, _), ref in resolved:
        opts = tuple(dict(o) for o in options.get(record.name, ({},)))
        for check in _checks_for(record, None):
            for device in (("cpu",) if check in DEVICE_FREE_CHECKS else devices):
                cases.append(ContractCase(ref, record.name, check, device, settings, opts, batch))
    return cases


def contract_params(*records, options: Optional[dict] = None, devices: Sequence[str] = ("cpu", "cuda"),
                    settings: Optional[ContractSettings] = None) -> list:
    """`contract_cases` as `pytest.param`s: ids `name::check[device]`, CUDA cases marked `gpu`
    and skipped without CUDA. Use with `@pytest.mark.parametrize("case", contract_params(...))`."""
    import pytest

    no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")
    return [
        pytest.param(case, id=str(case), marks=(pytest.mark.gpu, no_cuda) if case.device == "cuda" else ())
        for case in contract_cases(*records, options=options, devices=devices, settings=settings)
    ]


def _main(argv: Sequence[str]) -> int:
    if list(argv) == ["--without-hardware"]:
        request = json.loads(sys.stdin.read())
        settings = _settings_from_json(request["settings"])
        print(json.dumps(without_hardware(request["names"], settings, request["options"])))
        return 0
    failed = 0
    for case in contract_cases(*argv, devices=("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)):
        try:
            case.run()
            print(f"PASS {case}")
        except ContractViolation as exc:
            failed += 1
            print(f"FAIL {case}\n{exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
