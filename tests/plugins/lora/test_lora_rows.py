"""Row publication: every stage's compute sees the adapter of each of its own rows (threaded world)."""

import pytest
import torch

from layer_boundary import (
    Forward,
    MissingPluginError,
    RMSNorm,
    RowLayout,
    Topology,
    declare_attn,
    declare_ffn,
    get_compute_rows,
    get_forward,
    make_stages,
    residual_batch,
)
from layer_boundary._forward import publish_compute_rows
from layer_boundary_models.lora_layers import LoraSlots, random_lora_spec
from layer_boundary._stage import PublishingStageBoundary, StageBoundary
from layer_boundary.testing.threaded import run_threaded

H = 4
LORA = {"publish_rows": ("lora",)}
#: each DP rank's per-row adapter slots (-1: base model only)
IDS = {0: [0, 1, -1], 1: [2]}


def _norm():
    return RMSNorm(H, dtype=torch.float64)


def _snapshot(rows):
    lora = rows.published["lora"]
    return {
        "stage": rows.stage,
        "layout": rows.layout,
        "num_rows": rows.num_rows,
        "ids": lora.adapter_ids.tolist(),
        "segments": {slot: idx.tolist() for slot, idx in lora.segments},
    }


def _one_layer(parallel, *, counts=(3,), padding="sum_len", variant=None, latent=False, policy="ar"):
    """Run attention + FFN with LoRA row publication; return what each compute saw."""
    seen = {}

    def qkv_latent(x):
        seen["latent"] = _snapshot(get_compute_rows())
        return x

    attn_options = dict(LORA, qkv_latent_func=qkv_latent) if latent else LORA
    attn, ffn = make_stages(
        (declare_attn(), _norm(), attn_options),
        (declare_ffn(), _norm(), LORA),
        terminal=True,
        parallel=parallel,
        reduction=policy,
    )
    dp_rank = parallel.attn_dp_rank
    ids = IDS[dp_rank] if parallel.topology.attn_dp > 1 else IDS[0]
    n = counts[dp_rank]
    kwargs = {"sequence_parallel": variant == "sp", "input_scattered": variant == "is"}
    fwd = Forward(parallel, n, dp_counts=counts, dp_padding=padding, extras={"lora_ids": torch.tensor(ids)}, **kwargs)
    residual_batch.start(fwd)
    h = torch.arange(n * H, dtype=torch.float64).reshape(n, H) / 7 + 1
    x = attn.prepare(h, fwd)
    seen["attn"] = _snapshot(get_compute_rows())
    h = attn.finish(x * 0.5, fwd)
    x = ffn.prepare(h, fwd)
    seen["ffn"] = _snapshot(get_compute_rows())
    with ffn.exit(fwd) as out:
        y = x * 0.25 if get_forward().skips_reduction else parallel.groups["tp"].all_reduce(x * 0.25)
    out.finish(y)
    return seen


def test_attention_and_ffn_see_their_own_rows_under_tp():
    for seen in run_threaded(_one_layer, Topology(tp=2)):
        for stage in ("attn", "ffn"):
            assert seen[stage]["layout"] is RowLayout.DP_LOCAL
            assert seen[stage]["ids"] == [0, 1, -1] and seen[stage]["num_rows"] == 3
            assert seen[stage]["segments"] == {0: [0], 1: [1]}


@pytest.mark.parametrize(
    "padding, ids, segments",
    [
        ("sum_len", [0, 1, -1, 2], {0: [0], 1: [1], 2: [3]}),
        # MAX_LEN: each DP set padded to 4 rows (3 rounded up to attn_tp=2); padding uses no adapter
        ("max_len", [0, 1, -1, -1, 2, -1, -1, -1], {0: [0], 1: [1], 2: [4]}),
    ],
)
def test_ffn_under_attention_dp_sees_the_gathered_rows_in_dp_order(padding, ids, segments):
    results = run_threaded(lambda p: _one_layer(p, counts=(3, 1), padding=padding), Topology(tp=4, attn_dp=2))
    for rank, seen in enumerate(results):
        dp_rank = rank // 2
        assert seen["attn"]["layout"] is RowLayout.DP_LOCAL and seen["attn"]["ids"] == IDS[dp_rank]
        assert seen["ffn"]["layout"] is RowLayout.DP_GATHERED
        assert seen["ffn"]["ids"] == ids and seen["ffn"]["num_rows"] == len(ids)
        assert seen["ffn"]["segments"] == segments


def test_sequence_parallel_compute_sees_the_gathered_attention_rows():
    for seen in run_threaded(lambda p: _one_layer(p, variant="sp", policy="rsv"), Topology(tp=2)):
        assert seen["attn"]["layout"] is seen["ffn"]["layout"] is RowLayout.DP_LOCAL
        assert seen["attn"]["ids"] == seen["ffn"]["ids"] == [0, 1, -1]


def test_a_latent_projection_on_input_slices_sees_the_slice_rows():
    results = run_threaded(lambda p: _one_layer(p, variant="is", latent=True), Topology(tp=2))
    # 3 rows over 2 attention-TP ranks: rank 0 holds rows 0-1, rank 1 row 2
    assert [seen["latent"]["ids"] for seen in results] == [[0, 1], [-1]]
    assert all(seen["latent"]["layout"] is RowLayout.ATTN_TP_SLICE for seen in results)
    assert results[0]["latent"]["segments"] == {0: [0], 1: [1]} and results[1]["latent"]["segments"] == {}
    # the latent's publication is scoped: the attention after the gather sees its whole rows
    assert all(seen["attn"]["layout"] is RowLayout.DP_LOCAL and seen["attn"]["ids"] == [0, 1, -1] for seen in results)


def test_a_batch_without_ids_publishes_no_adapters():
    def run(parallel):
        attn, ffn = make_stages((declare_attn(), _norm(), LORA), (declare_ffn(), _norm(), LORA), terminal=True, parallel=parallel)
        fwd = Forward(parallel, 2)
        residual_batch.start(fwd)
        attn.prepare(torch.ones(2, H, dtype=torch.float64), fwd)
        return get_compute_rows().published["lora"]

    (rows,) = run_threaded(run, Topology())
    assert rows.segments == () and rows.adapter_ids.tolist() == [-1, -1]


def test_only_stages_that_ask_publish_and_only_lora_ffn_sums_wait_for_a_fused_consumer():
    from layer_boundary import Parallel

    parallel = Parallel.single()
    attn, ffn = make_stages((declare_attn(), _norm(), LORA), (declare_ffn(), _norm(), LORA), terminal=True, parallel=parallel)
    plain_attn, plain_ffn = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), terminal=True, parallel=parallel)
    assert type(attn) is PublishingStageBoundary and type(ffn) is PublishingStageBoundary
    assert type(plain_attn) is StageBoundary and type(plain_ffn) is StageBoundary
    assert ffn.plan.fused_consumer_only and not attn.plan.fused_consumer_only and not plain_ffn.plan.fused_consumer_only
    entry = ffn.describe()["variants"]["ordinary"]["entry"]
    assert entry[-1] == "publish the compute rows (dp_local) to lora"


def test_a_lora_ffn_is_described_as_deferring_only_when_a_provider_accepts():
    class Accepts:
        def can_defer_all_reduce(self, plan, forward):
            return True

    def exit_steps(parallel, options):
        _, ffn = make_stages(
            (declare_attn(), _norm(), options), (declare_ffn(), _norm(), options), following=declare_attn(), parallel=parallel
        )
        return ffn.describe()["variants"]["ordinary"]["exit"]

    lora, plain = run_threaded(
        lambda p: (exit_steps(p, {**LORA, "fusions": Accepts()}), exit_steps(p, {"fusions": Accepts()})), Topology(tp=2)
    )[0]
    assert lora[0] == "defer the TP all-reduce to the next input when a provider accepts the batch (can_defer_all_reduce)"
    assert plain[0] == "defer the TP all-reduce to the next input when the batch has tokens (fuse_mlp_allreduce)"


def test_the_gathered_publication_is_described_in_the_plan():
    def describe(parallel):
        _, ffn = make_stages((declare_attn(), _norm(), LORA), (declare_ffn(), _norm(), LORA), terminal=True, parallel=parallel)
        return ffn.describe()["variants"]["ordinary"]["entry"][-1]

    text = run_threaded(describe, Topology(tp=2, attn_dp=2))[0]
    assert text == "publish the compute rows (dp_gathered) to lora (adapter ids all_gatherv@attn_dp once per forward)"


# errors ---------------------------------------------------------------------------------------


def _stages(parallel, options):
    return make_stages((declare_attn(), _norm(), options), (declare_ffn(), _norm()), terminal=True, parallel=parallel)


def test_without_the_plugin_construction_names_the_distribution(monkeypatch, fresh_registry):
    from layer_boundary import Parallel
    from layer_boundary.plugin import reset_registry

    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "lora")
    reset_registry()
    with pytest.raises(MissingPluginError, match="pip install layer-boundary-lora"):
        _stages(Parallel.single(), LORA)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (("nope",), MissingPluginError, "no installed plugin provides the 'nope' row adapter that stage .* asks for"),
        ((1,), TypeError, "publish_rows takes adapter kinds"),
        (("lora", "lora"), ValueError, "names an adapter kind twice"),
    ],
)
def test_bad_publish_rows_options_fail_at_construction(value, error, match):
    from layer_boundary import Parallel

    with pytest.raises(error, match=match):
        _stages(Parallel.single(), {"publish_rows": value})


def test_context_parallel_is_refused_at_construction(inline_plugin):
    """Until CP publishes its token order, LoRA under attn_cp > 1 fails when the model is built."""
    from layer_boundary import hookimpl
    from layer_boundary.plugin import CpPathProvider

    class DecliningCp:  # a CP plugin that supports no stage, so only the LoRA binding decides
        @hookimpl
        def layer_boundary_cp_paths(self):
            yield CpPathProvider(name="testcp.none", factory=lambda request: None, description="declines every stage")

    inline_plugin(DecliningCp(), name="testcp")
    with pytest.raises(NotImplementedError, match="does not support context parallel .attn_cp=2"):
        run_threaded(lambda p: _stages(p, LORA), Topology(tp=2, attn_cp=2))


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (torch.tensor([0, 1]), ValueError, "has 2 entries but this rank's batch has 3 rows"),
        (torch.tensor([0.0, 1.0, 2.0]), TypeError, "must be a 1-D integer tensor"),
        (torch.tensor([[0, 1, 2]]), TypeError, "got a 2-D"),
        ([0, 1, 2], TypeError, "got list"),
        (torch.tensor([0, -2, 1]), ValueError, "holds -2; adapter slots are >= 0"),
    ],
)
def test_bad_adapter_ids_fail_at_the_first_prepare(ids, error, match):
    from layer_boundary import Parallel

    parallel = Parallel.single()
    attn, _ = _stages(parallel, LORA)
    fwd = Forward(parallel, 3, extras={"lora_ids": ids})
    residual_batch.start(fwd)
    with pytest.raises(error, match=match):
        attn.prepare(torch.ones(3, H, dtype=torch.float64), fwd)


def _slots():
    return LoraSlots(H, 2, random_lora_spec(2), dtype=torch.float64)


def test_a_lora_layer_outside_a_publishing_stage_says_how_to_fix_it():
    publish_compute_rows(None)
    with pytest.raises(RuntimeError, match=r"build the stage with options \{'publish_rows': \('lora',\)\}"):
        _slots()(torch.ones(3, H, dtype=torch.float64))


def test_a_lora_layer_on_other_rows_than_published_fails_clearly():
    from layer_boundary import Parallel

    parallel = Parallel.single()
    attn, _ = _stages(parallel, LORA)
    fwd = Forward(parallel, 3, extras={"lora_ids": torch.tensor([0, 1, 5])})
    residual_batch.start(fwd)
    attn.prepare(torch.ones(3, H, dtype=torch.float64), fwd)
    with pytest.raises(RuntimeError, match="got 2 rows but stage .* published 3 .dp_local. rows"):
        _slots()(torch.ones(2, H, dtype=torch.float64))
    with pytest.raises(ValueError, match="adapter slot 5, but the model holds 2 adapters"):
        _slots()(torch.ones(3, H, dtype=torch.float64))


# inside a compiled region ------------------------------------------------------------------------


def _compiled_lora_step(parallel):
    """attention prepare + one LoRA layer, compiled whole; the eager step beside it."""
    attn, _ = _stages(parallel, LORA)
    slots = _slots()
    with torch.no_grad():
        for slot in range(slots.num_adapters):
            a, b = getattr(slots, f"a{slot}"), getattr(slots, f"b{slot}")
            slots.load(slot, torch.randn(a.shape, dtype=torch.float64), torch.randn(b.shape, dtype=torch.float64))

    def step(h, fwd):
        return slots(attn.prepare(h, fwd))

    return step, torch.compile(step, backend="eager", fullgraph=True)


def _batch(parallel, ids):
    fwd = Forward(parallel, len(ids), extras={"lora_ids": torch.tensor(ids)})
    residual_batch.start(fwd)
    return torch.arange(len(ids) * H, dtype=torch.float64).reshape(len(ids), H) / 5 + 1, fwd


def test_a_compiled_lora_layer_keeps_each_rows_adapter():
    """Every adapter on every row, each row keeping its own: eager's per-adapter rows, to
    rounding (a GEMM over all rows may round apart from one over the adapter's rows)."""
    from layer_boundary import Parallel

    torch._dynamo.reset()
    parallel = Parallel.single()
    step, compiled = _compiled_lora_step(parallel)
    ids = [0, 1, -1, 1]
    got = compiled(*_batch(parallel, ids))
    want = step(*_batch(parallel, ids))
    assert (got - want).abs().max().item() < 1e-12 * want.abs().max().item()
    assert torch.equal(got[2], torch.zeros(2, dtype=torch.float64))  # the base-only row: no delta
    assert not torch.equal(got[0], got[1])


@pytest.mark.parametrize(
    "ids, match",
    [([0, -2, 1], "holds -2; adapter slots are >= 0"), ([0, 1, 5], "adapter slot 5, but the model holds 2 adapters")],
    ids=["below -1", "no such adapter"],
)
def test_bad_adapter_ids_fail_the_same_way_inside_a_compiled_region(ids, match):
    """The values are data in a graph: checked when it runs, with the eager errors."""
    from layer_boundary import Parallel

    torch._dynamo.reset()
    parallel = Parallel.single()
    step, compiled = _compiled_lora_step(parallel)
    compiled(*_batch(parallel, [0, 1, -1]))  # compiled once on good ids
    for run in (step, compiled):
        with pytest.raises(ValueError, match=match):
            run(*_batch(parallel, ids))
