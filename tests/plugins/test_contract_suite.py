"""The provider contract suite itself: it passes correct providers and catches each way a
provider can break the contract (so a plugin that passes it has been checked, not waved through)."""

import importlib.util
from pathlib import Path

import attrs
import pytest
import torch

from layer_boundary import FusedMlpInput, FusionProvider, Priority, ResidualKind, ResidualOps, Topology, hookimpl
from layer_boundary.plugin import reset_registry
from layer_boundary._residual.add_norm import NORM_READ, PLAIN_ADD, add_rms_norm
from layer_boundary.testing.contract import (
    ContractSettings,
    ContractViolation,
    check_fusion_provider,
    check_residual_kind,
    contract_cases,
    contract_params,
)

#: a small run: one TP=2 world, two dtypes, an empty and a small batch
SMALL = ContractSettings(topologies=(Topology(tp=2),), dtypes=("float32", "bfloat16"), rows=(0, 3))
RUNTIME = ("construction", "none_rule", "rank_uniform", "parity")


class Candidates:
    """A provider whose one candidate is `run(norm, owed, residual, forward)`."""

    def __init__(self, run, **fused):
        self.run, self.fused = run, fused

    def attention_input(self, plan):
        norm = plan.norm
        return (FusedMlpInput(run=lambda owed, r, fwd: self.run(norm, owed, r, fwd), name="test.candidate", **self.fused),)

    ffn_input = attention_input


def provider(run, name="test.provider", priority=Priority.GENERIC, description="a test provider", **fused):
    return FusionProvider(name=name, factory=lambda stage: Candidates(run, **fused), priority=priority, description=description)


def correct(norm, owed, residual, fwd):
    return add_rms_norm(norm, owed.group.all_reduce(owed.partial), residual)


def violation(record, *checks, settings=SMALL, match):
    with pytest.raises(ContractViolation, match=match) as info:
        check_fusion_provider(record, checks=checks, settings=settings)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# correct providers pass, and the pass exercised something


def test_a_correct_provider_passes_and_its_candidate_ran():
    report = check_fusion_provider(provider(correct), checks=RUNTIME, settings=SMALL)
    assert report.stats["cases_accepted"] > 0 and not report.failures()


def test_a_provider_that_accepts_no_case_fails_parity():
    """A record whose candidates never accept (declining every stage, or candidates that need a
    prepare or hardware this machine lacks) would pass vacuously: the suite says so instead."""
    never = FusionProvider(name="test.never", factory=lambda stage: None, description="declines")
    with pytest.raises(ContractViolation, match="accepted no case"):
        check_fusion_provider(never, checks=RUNTIME, settings=SMALL)
    report = check_fusion_provider(never, checks=("construction", "none_rule", "rank_uniform"), settings=SMALL)
    assert report.stats["stages_declined"] > 0 and report.stats["cases_accepted"] == 0


class InertUntilBound:
    """A contract preparation (module-level: named by 'module:Class'): the factory's providers
    stay inert until `bind` arms them, as a plugin's candidates stay inert until `prepare`."""

    entered = 0

    def __enter__(self):
        type(self).entered += 1
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, provider, plan):
        provider.armed = True


class _Inert:
    armed = False

    def __init__(self, stage):
        self.stage = stage

    def attention_input(self, plan):
        def run(owed, residual, fwd=None):
            if not self.armed:
                return None
            return add_rms_norm(plan.norm, owed.complete(), residual)

        return (FusedMlpInput(run=run, name="test.inert.add_norm"),)

    ffn_input = attention_input


def test_a_contract_preparation_readies_a_record_that_needs_it():
    inert = FusionProvider(name="test.inert", factory=_Inert, description="inert until bound")
    with pytest.raises(ContractViolation, match="accepted no case"):
        check_fusion_provider(inert, checks=RUNTIME, settings=SMALL)
    prepared = attrs.evolve(inert, contract_preparation=f"{__name__}:InertUntilBound")
    report = check_fusion_provider(prepared, checks=RUNTIME, settings=SMALL)
    assert report.stats["cases_accepted"] > 0 and InertUntilBound.entered > 0
    broken = attrs.evolve(inert, contract_preparation="no_such_module:Nothing")
    with pytest.raises(Exception, match="contract_preparation 'no_such_module:Nothing' did not load"):
        check_fusion_provider(broken, checks=RUNTIME, settings=SMALL)


# ---------------------------------------------------------------------------------------------
# the None rule


def test_declining_after_touching_an_input_is_caught():
    def sloppy(norm, owed, residual, fwd):
        owed.partial.mul_(1.0)  # same values, but an in-place write
        return None

    violation(provider(sloppy), "none_rule", match=r"\[none_rule\].*declined after modifying its inputs")


def test_declining_after_starting_a_collective_is_caught():
    def chatty(norm, owed, residual, fwd):
        owed.group.all_reduce(owed.partial.clone())
        return None

    violation(provider(chatty), "none_rule", match=r"\[none_rule\].*declined after issuing \{'all_reduce@")


def test_raising_instead_of_declining_is_caught():
    def picky(norm, owed, residual, fwd):
        if residual.dtype == torch.bfloat16:
            raise NotImplementedError("no bf16 kernel")
        return correct(norm, owed, residual, fwd)

    violation(provider(picky), "none_rule", match=r"raised on declared bfloat16 input: NotImplementedError.*decline with None")


# ---------------------------------------------------------------------------------------------
# rank uniformity


def test_a_rank_dependent_decision_is_caught():
    def rank_zero_only(norm, owed, residual, fwd):
        if fwd.parallel.rank != 0:
            return None
        return add_rms_norm(norm, owed.partial * owed.group.size, residual)  # no collective, so no hang

    violation(provider(rank_zero_only), "rank_uniform", match=r"rank 0 and rank 1 of tp=2 decided differently")


def test_a_rank_dependent_collective_becomes_a_violation_not_a_hang():
    def rank_zero_reduces(norm, owed, residual, fwd):
        return correct(norm, owed, residual, fwd) if fwd.parallel.rank == 0 else None

    quick = ContractSettings(topologies=(Topology(tp=2),), dtypes=("float32",), rows=(3,), timeout=1.0)
    violation(provider(rank_zero_reduces), "rank_uniform", settings=quick, match=r"did not meet in a collective")


def test_results_that_differ_across_ranks_are_caught():
    def local_noise(norm, owed, residual, fwd):
        out, new_residual = correct(norm, owed, residual, fwd)
        return out, new_residual + fwd.parallel.rank * 1e-7  # passes parity, breaks replication

    violation(provider(local_noise), "rank_uniform", match=r"got different results.*same residual")


def test_a_non_bool_defer_answer_is_caught():
    class Defers(Candidates):
        def can_defer_all_reduce(self, plan, fwd):
            return fwd.num_tokens or None

    record = FusionProvider(name="test.defers", factory=lambda stage: Defers(correct), description="defers")
    violation(record, "construction", match=r"can_defer_all_reduce returned (int|NoneType); it must return a bool")


# ---------------------------------------------------------------------------------------------
# parity


def test_ignoring_the_gemma_offset_is_caught():
    def llama_order_only(norm, owed, residual, fwd):
        total = owed.group.all_reduce(owed.partial).float() + residual.float()
        normalized = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + norm.eps)
        return (norm.weight * normalized.to(residual.dtype)).to(residual.dtype), total.to(residual.dtype)

    message = violation(provider(llama_order_only), "parity", match=r"\[parity\].*input differs from the unfused reference")
    assert "gemma_rms" in message and "/rms/" not in message  # only the Gemma stages are wrong


def test_a_wrong_return_shape_is_caught():
    def just_the_input(norm, owed, residual, fwd):
        return correct(norm, owed, residual, fwd)[0]

    violation(provider(just_the_input), "parity", match=r"returned a tensor \(3, 64\) float32 on cpu where a pair \(compute input, new residual\) was asked")


def test_a_false_preserves_residual_claim_is_caught():
    def in_place(norm, owed, residual, fwd):
        out, new_residual = correct(norm, owed, residual, fwd)
        residual.copy_(new_residual)
        return out, residual

    violation(provider(in_place, preserves_residual=True), "parity", match=r"claims preserves_residual but wrote")


# ---------------------------------------------------------------------------------------------
# construction and the record


def test_an_always_candidate_outside_the_core_is_caught():
    violation(provider(correct, always=True), "construction", match=r"sets always=True")


def test_a_factory_that_raises_on_some_stages_is_caught():
    def factory(stage):
        if stage.norm_kind == "gemma_rms":
            raise RuntimeError("unsupported norm")
        return Candidates(correct)

    record = FusionProvider(name="test.raises", factory=factory, description="raises")
    violation(record, "construction", match=r"factory raised on the \w+ \(tp=2, norm gemma_rms\) stage: RuntimeError: unsupported norm")
    if not torch.cuda.is_available():  # the in-process without-hardware fallback needs CUDA absent
        violation(record, "without_hardware", match=r"factory raised without CUDA")


def test_a_factory_that_changes_its_mind_is_caught():
    answers = iter(range(10_000))
    record = FusionProvider(name="test.flaky", factory=lambda stage: Candidates(correct) if next(answers) % 2 else None,
                            description="flaky")
    violation(record, "construction", match=r"factory gave different answers when asked twice about the ffn_after_attention")


@pytest.mark.parametrize(
    "record, message",
    [
        (provider(correct, priority=Priority.BUILTIN), r"built-in band"),
        (provider(correct, description=" "), r"description is empty"),
        (FusionProvider(name="test.two_args", factory=lambda stage, extra: None, description="x"), r"exactly one argument"),
    ],
)
def test_record_rules(record, message):
    violation(record, "record", match=message)


def test_a_record_named_after_another_plugin_is_caught(inline_plugin, fresh_registry):
    record = provider(correct, name="other.provider")

    class Plugin:
        @hookimpl
        def layer_boundary_fusion_providers(self):
            yield record

    inline_plugin(Plugin(), name="acme")
    violation("other.provider", "record", match=r"must start with its plugin's entry-point name 'acme'")


# ---------------------------------------------------------------------------------------------
# without hardware: a fresh interpreter with CUDA hidden, through real entry points


HEAVY = "raise_if_imported_heavy_vendor_lib = True\n"
LAZY_PLUGIN = """
from layer_boundary.plugin import FusionProvider, hookimpl

def factory(stage):
    import heavy_vendor_lib  # before deciding: the mistake
    return None

@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(name="lazyvendor.fused", factory=factory, priority=10, description="imports before deciding")
"""
EAGER_PLUGIN = """
import heavy_vendor_lib  # at plugin import: the worse mistake
from layer_boundary.plugin import FusionProvider, hookimpl

@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(name="eagervendor.fused", factory=lambda stage: None, priority=10, description="imports eagerly")
"""


def _make_dist():
    """tests/core/fake_dists.make_dist (a throwaway distribution with an entry point)."""
    spec = importlib.util.spec_from_file_location("fake_dists", Path(__file__).parents[1] / "core" / "fake_dists.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_dist


def test_heavy_imports_before_deciding_are_caught_without_hardware(tmp_path, monkeypatch, fresh_registry):
    (tmp_path / "heavy_vendor_lib.py").write_text(HEAVY)
    make_dist = _make_dist()
    make_dist(tmp_path, "lazyvendor", "lazyvendor_plugin", LAZY_PLUGIN)
    make_dist(tmp_path, "eagervendor", "eagervendor_plugin", EAGER_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_registry()
    lazy, eager = contract_cases("lazyvendor.fused", "eagervendor.fused", devices=("cpu",))[1::6]
    assert (lazy.check, eager.check) == ("without_hardware", "without_hardware")
    with pytest.raises(ContractViolation, match=r"factory imported heavy_vendor_lib without CUDA and then declined"):
        lazy.run()
    with pytest.raises(ContractViolation, match=r"importing plugin 'eagervendor' imported heavy_vendor_lib"):
        eager.run()


# ---------------------------------------------------------------------------------------------
# residual kinds


class HalfAdd:
    """Claims plain_add but halves the sum."""

    plain_add, at_producer, outlives_layer = True, False, True

    def apply(self, contribution, residual):
        return (contribution + residual) * 0.5


class RowMixing:
    """An update that mixes rows: the boundary could not split it over ranks."""

    plain_add, at_producer, outlives_layer = False, False, True

    def apply(self, contribution, residual):
        return residual + contribution.mean(0, keepdim=True)


class SloppyRead:
    """A read whose fused update + read forgets the norm's weight."""

    plain_norm, before_gather = True, False

    def enter(self, hidden):
        return hidden

    def read(self, residual, norm):
        return norm(residual), residual

    def update_and_read(self, update, contribution, residual, norm):
        new_residual = update.apply(contribution, residual)
        x = new_residual.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)).to(residual.dtype), new_residual


def kind(update=PLAIN_ADD, read=NORM_READ, returns=None):
    ops = ResidualOps(name="test.kind", attn_read=read, attn_update=update, ffn_read=read, ffn_update=update)
    return ResidualKind(name="test.kind", kind="test", factory=lambda **o: returns if returns is not None else ops,
                        description="a test residual kind")


RESIDUAL_SMALL = ContractSettings(dtypes=("float32",), rows=(0, 4))


@pytest.mark.parametrize(
    "record, check, message",
    [
        (kind(update=HalfAdd()), "parity", r"claims plain_add but apply\(\) is not residual \+ contribution"),
        (kind(update=RowMixing()), "row_local", r"apply\(\) on a subset of rows differs"),
        (kind(read=SloppyRead()), "parity", r"update_and_read\(\) differs from read\(apply\(\)\)"),
        (kind(returns=object()), "construction", r"returned object; expected ResidualOps"),
    ],
)
def test_residual_kind_violations_are_caught(record, check, message):
    with pytest.raises(ContractViolation, match=message):
        check_residual_kind(record, checks=[check], settings=RESIDUAL_SMALL)


def test_a_correct_residual_kind_passes():
    assert check_residual_kind(kind(), checks=["construction", "parity", "row_local"], settings=RESIDUAL_SMALL).stats["laws_checked"]


def test_option_tensors_follow_the_device_under_test():
    """Option sets are written on the CPU; the CUDA cases must find their tensors on the GPU (the
    mhc kinds' mappings stayed on the CPU and every CUDA law failed on a device mismatch)."""
    import types

    from layer_boundary.testing._contract.residual import _describe, _on_device

    opts = dict(streams=3, attn=types.SimpleNamespace(fn=torch.ones(2, 4), base=[torch.zeros(2)], scale=(torch.ones(1), 2.0)))
    moved = _on_device(opts, torch.device("meta"))
    assert moved["streams"] == 3 and moved["attn"].scale[1] == 2.0
    assert all(t.device.type == "meta" for t in (moved["attn"].fn, moved["attn"].base[0], moved["attn"].scale[0]))
    assert opts["attn"].fn.device.type == "cpu"  # the caller's option set is left as it was
    assert _describe(opts) == "options {streams=3, attn=namespace(fn=tensor(2, 4), base=[tensor(2,)], scale=(tensor(1,), 2.0))}"


# ---------------------------------------------------------------------------------------------
# the pytest helper


def test_contract_params_give_one_case_per_rule_and_device_with_gpu_marks():
    params = contract_params("core.unfused", "core.plain")
    ids = [p.id for p in params]
    assert "core.unfused::record" in ids and "core.unfused::parity[cpu]" in ids and "core.plain::row_local[cuda]" in ids
    cuda = [p for p in params if p.id.endswith("[cuda]")]
    assert cuda and all(any(m.name == "gpu" for m in p.marks) for p in cuda)
    assert len(ids) == len(set(ids))
