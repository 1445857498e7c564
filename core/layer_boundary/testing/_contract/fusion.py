"""Fusion providers at work: construction on every rank, then every candidate on real owed
values, declines checked for collectives and touched inputs, results against the unfused
reference and across ranks."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..._plugins.results import pair_matches, pair_problem
from ..._plugins.selection import Answer, call_record
from ..._plugins.builtin import UnfusedCompletion
from ...collectives import CollectiveCounter, CountingCollectives
from ..._planning import arriving_sum
from ..._contracts import FusedMlpInput, StageKind
from ..._forward import Forward, ForwardMode
from ..._fusions import consumer_candidates
from ..._layers import MoeFinalizeHandoff
from ...launch import RankTimeout
from ..._layout import SumGroup
from ..._output import UnreducedOutput
from ..._residual.add_norm import add_rms_norm
from ..._plugins.requests import AttentionInputFusion, DefersAllReduce, DefersFinalize, FfnInputFusion
from ..threaded import CollectiveAborted, ThreadWorld
from .records import resolve
from .report import DTYPES, PROVIDER_HOOKS, ContractReport, ContractSettings, relative_error
from .stages import NORM_KINDS, SITUATIONS, device_of, make_norm


CAPABILITIES = (AttentionInputFusion, FfnInputFusion, DefersFinalize, DefersAllReduce)


def _candidate_facts(candidates) -> list[tuple]:
    return [(c.name, c.fused.completes, c.fused.handoff, c.fused.preserves_residual) for c in candidates]


def _build_provider(record, plan, report: ContractReport, builtin: bool, where: str, registered=None):
    """The factory's provider for `plan` and its candidates, checking both; (provider, candidates).
    The candidates are named as a run names them (`registered`: where the record came from)."""
    try:
        provider = call_record(record, plan.description)
        again = call_record(record, plan.description)
    except Exception as exc:  # noqa: BLE001 - the contract reports it
        report.add("construction", f"factory raised on the {where} stage: {type(exc).__name__}: {exc}")
        return None, ()
    if (provider is None) != (again is None):
        report.add("construction", f"factory gave different answers when asked twice about the {where} stage")
    if provider is None:
        report.stats["stages_declined"] += 1
        return None, ()
    report.stats["stages_accepted"] += 1
    if not isinstance(provider, CAPABILITIES):
        report.add("construction", f"factory returned {type(provider).__name__}, which has none of {', '.join(PROVIDER_HOOKS)}")
        return None, ()
    ffn = plan.kind is StageKind.FFN
    method = "ffn_input" if ffn else "attention_input"
    if not isinstance(provider, FfnInputFusion if ffn else AttentionInputFusion):
        return provider, ()
    offer = provider.ffn_input if ffn else provider.attention_input
    try:
        raw = list(offer(plan) or ())
        raw_again = list(offer(plan) or ())
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
    plugin = None if registered is None else registered.plugin
    source = Answer(record.name, plugin, None if registered is None else registered.distribution).source
    candidates = _own(plan, raw, source, plugin, builtin)
    again_c = _own(plan, raw_again, source, plugin, builtin)
    if _candidate_facts(candidates) != _candidate_facts(again_c):
        report.add("construction", f"{method}(plan) listed different candidates when asked twice on the {where} stage")
    report.stats["candidates_listed"] += len(candidates)
    return provider, candidates


def _own(plan, raw, source: str, plugin, builtin: bool) -> tuple:
    """The candidates of `raw` the core binds for `plan` (those of the stage's format and norm
    kinds), without the core's last-resort one (unless `raw` is the core's own)."""
    bound = consumer_candidates(plan, [(_Listed(raw), source), (UnfusedCompletion(), "core")], (plugin, "core"))
    return tuple(c for c in bound if c.source == source and (builtin or not c.fused.always))


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
    _, sum_group = arriving_sum(plan.declaration, plan.two_batch_overlap)
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


def reference_completion(plan, total, residual):
    """The unfused reference in torch: the arriving post-norm (if any) on the completed sum, then
    `add_rms_norm` (the add in fp32, the read's norm of the unrounded sum)."""
    post = plan.post_norm
    if post is not None:
        total = post.torch_forward(total)
    return add_rms_norm(plan.norm, total, residual)


class _NoPreparation:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, provider, plan) -> None:
        pass


def preparation_of(record):
    """The record's contract preparation (see `FusionProvider.contract_preparation`)."""
    path = getattr(record, "contract_preparation", None)
    if not path:
        return _NoPreparation()
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)()
    except Exception as exc:
        raise RuntimeError(f"record {record.name!r}: its contract_preparation {path!r} did not load: {type(exc).__name__}: {exc}") from exc


class _RankRun:
    """One rank's pass over every situation, dtype and row count."""

    def __init__(self, parallel, record, builtin: bool, settings: ContractSettings, registered=None):
        self.record, self.builtin, self.settings, self.registered = record, builtin, settings, registered
        self.preparation = preparation_of(record)
        self.counter = CollectiveCounter()
        self.parallel = parallel.with_groups(lambda g: CountingCollectives(g, self.counter))
        self.report = ContractReport(record.name, "fusion provider")
        self.decisions: list[tuple[str, Any]] = []
        self.outputs: dict[str, tuple] = {}
        self.device = device_of(settings.device)
        self.case = 0
        self.plans = 0

    def run(self) -> dict:
        s = self.settings
        with torch.inference_mode(False), torch.no_grad(), self.preparation:  # the None rule reads version counters
            for situation in SITUATIONS:
                for norm_kind in NORM_KINDS:
                    for dtype_name in s.dtypes:
                        self._situation(situation, norm_kind, dtype_name)
        return {"report": self.report.to_json(), "decisions": self.decisions, "outputs": self.outputs}

    def _situation(self, situation, norm_kind, dtype_name):
        s, dtype = self.settings, DTYPES[dtype_name]
        self.plans += 1
        seed = s.seed + self.plans
        boundary = situation.boundary(self.parallel, lambda post=False: make_norm(norm_kind, s.hidden_size, dtype, self.device, seed,
                                                                                  post=post))
        plan = boundary.plan
        tag = f"{situation.name}/{norm_kind}/{dtype_name}/tp{plan.parallel.topology.tp}"
        self.counter.reset()
        where = f"{situation.name} (tp={plan.parallel.topology.tp}, norm {norm_kind})"
        provider, candidates = _build_provider(self.record, plan, self.report, self.builtin, where, self.registered)
        self.decisions.append((f"{tag}: construction", (provider is not None, _candidate_facts(candidates),
                                                        self.counter.snapshot())))
        if provider is None:
            return
        self.preparation.bind(provider, plan)
        self._defer_hooks(provider, plan, tag)
        entry = next(iter(plan.paths.values())).entry
        if not entry.candidates:  # the core offers no candidate at this stage (non-plain update, other norm)
            return
        _, sum_group = arriving_sum(plan.declaration, plan.two_batch_overlap)
        for owed_kind in situation.owed:
            for cand in candidates:
                if cand.fused.handoff != (owed_kind == "handoff"):
                    continue
                if cand.accepts is not None and sum_group not in cand.accepts:
                    continue
                for rows in s.rows:
                    self._case(plan, cand, owed_kind, rows, dtype_name, f"{tag}/{owed_kind}/{cand.name}/rows{rows}")

    def _defer_hooks(self, provider, plan, tag):
        if plan.kind is not StageKind.FFN:
            return
        for hook, capability in (("can_defer_finalize", DefersFinalize), ("can_defer_all_reduce", DefersAllReduce)):
            if not isinstance(provider, capability):
                continue
            fn = getattr(provider, hook)
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
        want = reference_completion(plan, owed_ref.complete(), residual.clone())
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
            err = relative_error(got, ref)
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
        """(compute input, new residual) shaped, typed and placed like the residual: the check a
        run makes (`run_candidates`), reported with its message word for word."""
        plain = cand.fused.output_format == "plain"
        if pair_matches(out, residual, plain):
            return True
        self.report.add("parity", f"{pair_problem(out, residual, cand.who, cand.plugin, plain)} ({case_id})")
        return False


def fusion_rank(parallel, record_ref, settings: ContractSettings) -> dict:
    """One rank's runtime pass (module-level, so process worlds can run it by name)."""
    record, registered = resolve(record_ref)
    builtin = registered is not None and registered.plugin == "core"
    return _RankRun(parallel, record, builtin, settings, registered).run()


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


def runtime_report(record_ref, name: str, settings: ContractSettings, world=None) -> ContractReport:
    report = ContractReport(name, "fusion provider")
    for topology in settings.topologies:
        if world is not None and getattr(world, "size", topology.world_size) != topology.world_size:
            continue
        runner = world if world is not None else ThreadWorld(topology.world_size, timeout=settings.timeout)
        try:
            results = runner.run(fusion_rank, topology, record_ref, settings)
        except (CollectiveAborted, RankTimeout) as exc:
            report.add("rank_uniform", f"ranks of tp={topology.tp} did not meet in a collective ({exc}); a candidate or "
                                       "hook decided differently on some rank, or issued a collective only on some ranks")
            continue
        for res in results:
            report.merge(ContractReport.from_json(res["report"]))
        _compare_ranks(results, topology, report)
        report.stats["worlds"] += 1
    if report.stats["worlds"] and not report.stats["cases_accepted"]:
        report.add("parity", f"record {name!r} accepted no case ({report.stats['stages_accepted']} stage(s) built a provider, "
                             f"{report.stats['cases_declined']} case(s) declined): nothing was compared with the unfused "
                             "reference. A record whose candidates need hardware or a prepare names a contract_preparation "
                             "that readies them on this machine (FusionProvider.contract_preparation)")
    return report
