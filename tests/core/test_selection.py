"""The one selection rule, asked for every extension point: explicit candidates first, then the
registry's records by (-priority, name), the built-in plugin's last; each asked in turn, a
decline (None, or NotImplementedError with a reason) recorded, a broken candidate an error that
names its plugin and the switch that disables it; across ranks, the first candidate all accept.
And the core's own call sites go through it (seen in `recording()`)."""

import pytest
import torch

from layer_boundary import Forward, Parallel, RMSNorm, Topology, declare_attn, declare_ffn, make_stages, residual_batch, residual_kind
from layer_boundary._plugins.manager import HOOKS
from layer_boundary._plugins.selection import DECLINED_ELSEWHERE, RETURNED_NONE
from layer_boundary.plugin import (
    FusionProvider,
    PluginError,
    Priority,
    ResidualKind,
    get_registry,
    hookimpl,
    recording,
    select,
    select_agreed,
)
from layer_boundary.testing import run_threaded


def _record(point: str, name: str, factory, priority: int):
    """A record of `point`'s type with the fields that type requires."""
    record_type = HOOKS[point][1]
    extra = {}
    if point in ("residual_kinds", "row_publishers"):
        extra["kind"] = "probe"
    if point == "benchmarks":
        extra["command"] = name.rpartition(".")[2]
    if point == "model_families":
        extra.update(model=name.rpartition(".")[2], model_type="probe", parse=dict, load_weights=print, random_weights=dict, preset=dict)
    return record_type(name=name, factory=factory, priority=priority, description="selection probe", **extra)


class Candidates:
    """Three records of one point: the first declines with None, the second with a reason, the
    third accepts (highest priority first, so they are asked in that order)."""

    def __init__(self, point):
        self.point, self.asked = point, []

    def _factory(self, answer):
        def factory(*args, **kwargs):
            self.asked.append(answer)
            if answer == "reason":
                raise NotImplementedError("not on this request")
            return None if answer == "none" else ("built", args, kwargs)

        return factory

    def records(self):
        return [
            _record(self.point, "probe.a_none", self._factory("none"), Priority.ARCH_SPECIFIC),
            _record(self.point, "probe.b_reason", self._factory("reason"), Priority.VENDOR),
            _record(self.point, "probe.c_yes", self._factory("yes"), Priority.GENERIC),
        ]


@pytest.mark.parametrize("point", list(HOOKS))
def test_every_extension_point_asks_in_order_and_records_the_declines(point, inline_plugin, fresh_registry):
    probe = Candidates(point)
    hook = HOOKS[point][0]
    inline_plugin(type("Probe", (), {hook: hookimpl(staticmethod(lambda: iter(probe.records())))})(), name="probe")
    records = tuple(r for r in get_registry().records(point) if r.plugin == "probe")
    with recording() as log:
        chosen = select(point, ("request",), records=records, subject="a probe")
    assert probe.asked == ["none", "reason", "yes"]
    assert chosen.chosen.candidate == "probe.c_yes" and chosen.value == ("built", ("request",), {})
    assert [(a.candidate, a.reason) for a in chosen.declined] == [("probe.a_none", RETURNED_NONE), ("probe.b_reason", "not on this request")]
    assert log == [chosen] and chosen.summary()["declined"][1] == {"candidate": "probe.b_reason", "plugin": "probe", "reason": "not on this request"}


def test_the_built_in_records_come_last_whatever_the_priority(inline_plugin, fresh_registry):
    class Low:
        @hookimpl
        def layer_boundary_fusion_providers(self):
            yield FusionProvider(name="low.fused", factory=lambda stage: None, priority=Priority.BUILTIN - 500, description="low")

    inline_plugin(Low(), name="low")
    assert [r.name for r in get_registry().fusion_providers][-2:] == ["low.fused", "core.unfused"]


def test_explicit_candidates_come_first_and_all_accepting_ones_are_kept_when_asked(inline_plugin, fresh_registry):
    probe = Candidates("fusion_providers")
    inline_plugin(type("Probe", (), {"layer_boundary_fusion_providers": hookimpl(staticmethod(lambda: iter(probe.records())))})(), name="probe")
    records = tuple(r for r in get_registry().fusion_providers if r.plugin in ("probe", "core"))
    chain = select("fusion_providers", ("stage",), records=records, explicit=[("mine", "the stage's provider")], first=False)
    assert [a.candidate for a in chain.accepted] == ["the stage's provider", "probe.c_yes", "core.unfused"]


def test_a_broken_candidate_names_its_plugin_and_the_switch(inline_plugin, fresh_registry):
    def boom(request):
        raise RuntimeError("no device")

    inline_plugin(type("B", (), {"layer_boundary_rope_kernels": hookimpl(staticmethod(lambda: iter([_record("rope_kernels", "broken.rope", boom, 5)])))})(),
                  name="broken")
    mine = tuple(r for r in get_registry().rope_kernels if r.plugin == "broken")
    with pytest.raises(PluginError, match=r"rope kernel 'broken.rope' of plugin 'broken' .*raised RuntimeError: no device while "
                       r"choosing.*LAYER_BOUNDARY_DISABLE_PLUGINS=broken"):
        select("rope_kernels", ("request",), records=mine, subject="choosing a rope")
    kept = select("rope_kernels", ("request",), records=mine, errors="collect")
    assert kept.chosen is None and "no device" in kept.error
    inline_plugin(type("T", (), {"layer_boundary_decode_attention_kernels": hookimpl(
        staticmethod(lambda: iter([_record("decode_attention_kernels", "text.attn", lambda r: "text", 5)])))})(), name="text")
    mine = tuple(r for r in get_registry().decode_attention_kernels if r.plugin == "text")
    with pytest.raises(PluginError, match="returned 'text', which is not callable"):
        select("decode_attention_kernels", ("request",), records=mine, check=callable)


def test_ranks_agree_on_the_first_candidate_every_rank_accepts(inline_plugin, fresh_registry):
    import threading

    ranks = {}

    def first(request):  # accepted on rank 0 only
        return (lambda: "first") if ranks.get(threading.get_ident()) == 0 else None

    records = [_record("rope_kernels", "agree.first", first, 10), _record("rope_kernels", "agree.second", lambda r: (lambda: "second"), 5)]
    inline_plugin(type("A", (), {"layer_boundary_rope_kernels": hookimpl(staticmethod(lambda: iter(records)))})(), name="agree")

    def run(parallel):
        ranks[threading.get_ident()] = parallel.rank
        mine = tuple(r for r in get_registry().rope_kernels if r.plugin == "agree")
        (chosen,) = select_agreed([("rope_kernels", mine, "request", "agreeing")], parallel.groups["tp"], "cpu")
        return chosen.chosen.candidate, [(a.candidate, a.reason) for a in chosen.declined]

    rank0, rank1 = run_threaded(run, Topology(tp=2))
    assert rank0 == ("agree.second", [("agree.first", DECLINED_ELSEWHERE)])
    assert rank1 == ("agree.second", [("agree.first", RETURNED_NONE)])


def test_the_core_asks_through_the_rule(inline_plugin, fresh_registry):
    """Planning a stage (fusion providers), building a residual kind and a norm's first add +
    norm each leave their selection in the log, with the plugin's decline."""

    class Declines:
        @hookimpl
        def layer_boundary_fusion_providers(self):
            def build(stage):
                raise NotImplementedError("only on GPUs")

            yield FusionProvider(name="gpuonly.fused", factory=build, priority=Priority.VENDOR, description="declines on CPU")

        @hookimpl
        def layer_boundary_residual_kinds(self):
            yield ResidualKind(name="gpuonly.plain", kind="plain", factory=lambda: None, priority=Priority.VENDOR, description="never")

    inline_plugin(Declines(), name="gpuonly")
    parallel = Parallel.single()
    with recording() as log:
        ops = residual_kind("plain")
        attn, ffn = make_stages((declare_attn(residual=ops), RMSNorm(8)), (declare_ffn(residual=ops), RMSNorm(8)), terminal=True, parallel=parallel)
        fwd = Forward(parallel, 2)
        residual_batch.start(fwd)
        h = attn.finish(attn.prepare(torch.randn(2, 8), fwd), fwd)
        ffn.prepare(h, fwd)
    points = {s.point: s for s in log}
    assert {"residual_kinds", "fusion_providers", "add_norm_kernels"} <= set(points)
    assert ("gpuonly.plain", RETURNED_NONE) in [(a.candidate, a.reason) for a in points["residual_kinds"].declined]
    fusion = [s for s in log if s.point == "fusion_providers"]
    assert all(("gpuonly.fused", "only on GPUs") in [(a.candidate, a.reason) for a in s.declined] for s in fusion)
    assert all(s.accepted[-1].candidate == "core.unfused" for s in fusion)
