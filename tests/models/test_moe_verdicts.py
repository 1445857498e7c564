"""The verdict of a low-precision MoE run: one rank routed like the run is the reference.

In bfloat16 a reduced sum rounds differently on every topology, and a token whose experts nearly
tie picks another one: against an unpinned reference a correct run fails. Every MoE family
passes here in bfloat16 over seeds and topologies (threaded ranks), and three injected errors
fail in bfloat16 and in float32: one layer's sum skipped on one rank, a MoE output added to the
residual twice, experts offset on one expert-parallel rank; router errors that pinning could
hide fail on the routing checks themselves.
"""

import argparse
import functools

import attrs
import pytest
import torch

from layer_boundary import Forward, Topology
from layer_boundary.cli import run_cmd, runner
from layer_boundary.cli.families import family_config, find_family
from layer_boundary.cli.routing import RoutingRecorder, step_keys
from layer_boundary.cli.runner import DTYPES, RunJob, make_requests, run_rank
from layer_boundary.plugin import dp_gather
from layer_boundary.testing import requires_plugins
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_models import family, model_config

pytestmark = requires_plugins("mhc", "tbo")

TP2 = (Topology(tp=2), "ar", "sum_len", {})
DP2 = (Topology(tp=4, attn_dp=2), "rs+rsv", "sum_len", {})
DP2_MAX = (Topology(tp=4, attn_dp=2), "rs+rsv", "max_len", {})
EP2 = (Topology(tp=2, moe_ep=2), "ar", "sum_len", {})
PP2 = (Topology(tp=2, pp=2), "ar", "sum_len", {})
EP2_TBO = (Topology(tp=4, attn_dp=2, moe_ep=2), "rs+rsv", "sum_len", {"tbo": True})


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("moe-verdicts")


def _job(weights_dir, model, dtype, case, seed) -> RunJob:
    topology, reduction, padding, options = case
    config = model_config(model)
    path = weights_dir / f"{model}-{seed}.pt"
    if not path.exists():
        torch.save(family(model).random_weights(config, torch.float32, seed=seed), path)
    prompts, decode = make_requests(config.vocab_size, 3, 7, 4, seed)
    return RunJob(model=model, hf_config=dict(config.hf), topology=topology, reduction=reduction, dtype=dtype, weights=str(path),
                  prompts=prompts, decode_tokens=decode, dp_padding=padding, options=options)


def _args(job, check="single"):
    return argparse.Namespace(check=check, dtype=job.dtype, model=job.model, checkpoint=None, fp8=None,
                              pp=job.topology.pp, tbo=bool(job.options.get("tbo")))


def _verdict(job, pinned=True) -> dict:
    """`layer-boundary run --check single`'s verdict of `job` on threaded ranks."""
    results = run_threaded(run_rank, job.topology, attrs.evolve(job, routing="record" if pinned else None), timeout=120)
    item = find_family(job.model)
    config = family_config(item, job.hf_config)
    args = _args(job)
    reference = run_cmd._reference(args, item, config, job, DTYPES[job.dtype], results, pinned, None)
    return run_cmd._verdict(args, item, results, reference)


CORRECT = [
    ("qwen3_moe", TP2, 0), ("qwen3_moe", DP2, 1), ("qwen3_moe", EP2, 2), ("qwen3_moe", DP2_MAX, 3),
    ("deepseek_v4", TP2, 1), ("deepseek_v4", DP2, 2),
    ("nemotron_h", DP2, 1), ("nemotron_h", PP2, 2),
    ("longcat_flash", TP2, 1), ("longcat_flash", EP2_TBO, 0),
]


@pytest.mark.parametrize("model, case, seed", CORRECT, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(CORRECT)])
def test_a_correct_bfloat16_moe_run_passes(weights_dir, model, case, seed):
    check = _verdict(_job(weights_dir, model, "bfloat16", case, seed))
    assert check["passed"] is True and check["comparison"] == run_cmd.PINNED, check
    routing = check["routing"]
    assert routing["choices"] > 0 and routing["ranks_disagree"] == routing["not_top_k"] == routing["unexplained_flips"] == 0


def test_a_flipped_expert_fails_the_unpinned_comparison_and_passes_the_pinned_one(weights_dir):
    """The failure this verdict removes: a seed whose routing flips somewhere fails against one
    rank computing its own routing, and passes against one routed like the run."""
    for seed in range(4):
        job = _job(weights_dir, "qwen3_moe", "bfloat16", TP2, seed)
        pinned = _verdict(job)
        assert pinned["passed"] is True, pinned
        if pinned["routing"]["flipped"]:
            unpinned = _verdict(job, pinned=False)
            if unpinned["passed"] is False:
                assert unpinned["comparison"] == "logits" and pinned["rel_err"] < unpinned["rel_err"] / 5
                return
    pytest.fail("no seed flipped a token's experts into an unpinned failure")


# injected errors ---------------------------------------------------------------------------------


def _moe_modules(model):
    for layer in model.layers:
        for name in ("mlp", "mixer"):
            module = getattr(layer, name, None)
            if module is not None and hasattr(module, "first"):
                yield module
                break


def _skip_one_sum(model, parallel):
    """Rank 1 keeps its own partial of the second sum over TP of the first forward (it still
    joins the collective, so no rank hangs)."""
    if parallel.rank != 1:
        return
    group, calls = parallel.groups["tp"], [None]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] or 0))
    inner = {name: getattr(group, name) for name in ("all_reduce", "reduce_scatter", "reduce_scatterv")}

    def skipped(name, x, *sizes):
        out = inner[name](x, *sizes)
        if calls[0] is None:
            return out
        calls[0] += 1
        if calls[0] != 2:
            return out
        if name == "all_reduce":
            return x
        rows = sizes[0] if sizes else [x.shape[0] // group.size] * group.size
        start = sum(rows[: group.rank])
        return x[start : start + rows[group.rank]]

    for name in inner:
        setattr(group, name, functools.partial(skipped, name))


def _output_twice(model, parallel):
    """The second MoE layer's output reaches the residual twice, on every rank."""
    module = list(_moe_modules(model))[1]
    module.register_forward_hook(lambda mod, args, out: out * 2)


def _experts_offset(model, parallel):
    """Expert-parallel rank 1 runs each expert's weights on the next expert's tokens."""
    if parallel.moe_ep_rank != 1:
        return
    done = []

    def shift(*_):
        if not done:
            for module in _moe_modules(model):
                module.first += 1
            done.append(True)

    model.register_forward_pre_hook(shift)


def _router_offset(model, parallel, ranks=(1,)):
    """The routers of `ranks` (None: every rank) pick the next expert after each they choose."""
    if ranks is not None and parallel.rank not in ranks:
        return
    for _, router in model.routed_layers():
        original = router.choose

        def choose(scores, original=original):
            choice, experts = original(scores)
            return choice, (experts + 1) % choice.shape[1]

        router.choose = choose


def _faulty_build(fault, build, item, config, parallel, **kwargs):
    model = build(item, config, parallel, **kwargs)
    if parallel.topology.world_size > 1:  # the run only, never its reference
        fault(model, parallel)
    return model


@pytest.fixture
def inject(monkeypatch):
    def install(fault):
        monkeypatch.setattr(runner, "build", functools.partial(_faulty_build, fault, runner.build))

    return install


FAULTS = {"sum-skipped": _skip_one_sum, "output-twice": _output_twice, "experts-offset": _experts_offset}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_injected_error_fails_in_bfloat16_and_float32(weights_dir, inject, fault, dtype):
    inject(FAULTS[fault])
    check = _verdict(_job(weights_dir, "qwen3_moe", dtype, EP2, 0))
    assert check["passed"] is False and check["rel_err"] > 5 * check["tolerance"], check


@pytest.mark.parametrize(
    "model, fault, dtype, case",
    [("nemotron_h", "sum-skipped", "bfloat16", DP2), ("deepseek_v4", "output-twice", "float32", TP2),
     ("longcat_flash", "experts-offset", "bfloat16", EP2)],
)
def test_every_family_fails_an_injected_error(weights_dir, inject, model, fault, dtype, case):
    inject(FAULTS[fault])
    check = _verdict(_job(weights_dir, model, dtype, case, 1))
    assert check["passed"] is False and check["rel_err"] > 5 * check["tolerance"], check


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_router_error_on_one_rank_fails_as_a_disagreement(weights_dir, inject, dtype):
    inject(_router_offset)
    check = _verdict(_job(weights_dir, "qwen3_moe", dtype, EP2, 0))
    routing = check["routing"]
    assert check["passed"] is False and routing["passed"] is False and routing["ranks_disagree"] > 0
    assert "ranks 0 and 1 routed request" in routing["problems"][0]


def test_a_router_error_on_every_rank_fails_though_the_reference_follows_it(weights_dir, inject):
    """Every rank routes each token to the wrong experts, alike: the reference takes the same
    experts, yet they are not a top-k of the scores the routers ranked."""
    inject(functools.partial(_router_offset, ranks=None))
    check = _verdict(_job(weights_dir, "qwen3_moe", "bfloat16", TP2, 0))
    routing = check["routing"]
    assert check["passed"] is False and routing["not_top_k"] > 0 and routing["ranks_disagree"] == 0
    assert any("not a top-k of its own choice scores" in p for p in routing["problems"])


# keys, hooks, the plan ---------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["sum_len", "max_len"])
@pytest.mark.parametrize("tbo", [False, True])
def test_each_routers_rows_are_keyed_as_the_library_gathers_them(padding, tbo):
    """The keys of every DP rank's rows are what `dp_gather` makes of each rank's own keys, in
    a Forward of the step (or of each microbatch) with the run's padding."""
    topology = Topology(tp=4, attn_dp=2)
    job = RunJob(model="qwen3_moe", hf_config={}, topology=topology, reduction="ar", dtype="float32",
                 prompts=((1, 2), (3, 4, 5), (6, 7, 8, 9)), decode_tokens=((1, 2, 3),) * 2, dp_padding=padding,
                 options={"tbo": True} if tbo else {})

    def gathered(parallel, index):
        out = []
        for part in range(2 if tbo else 1):
            keys = [step_keys(job, index, _with_dp(parallel, d))[part][0] for d in range(2)]
            fwd = Forward(parallel, keys[parallel.attn_dp_rank].shape[0], dp_counts=[k.shape[0] for k in keys], dp_padding=padding)
            out.append((dp_gather(keys[parallel.attn_dp_rank] + 1, fwd) - 1, step_keys(job, index, parallel)[part][1]))
        return out

    for index in (0, 1):
        for result in run_threaded(gathered, topology, index):
            for library, ours in result:
                assert torch.equal(library, ours)


def _with_dp(parallel, dp_rank):
    return argparse.Namespace(topology=parallel.topology, attn_dp_rank=dp_rank)


def test_recording_replaces_choose_on_the_instances_of_one_run_only():
    from layer_boundary import Parallel
    from layer_boundary_models import build_model

    model = build_model(model_config("qwen3_moe"), Parallel.single(), device="meta")
    routers = [router for _, router in model.routed_layers()]
    assert routers and all("choose" not in vars(r) for r in routers)
    job = RunJob(model="qwen3_moe", hf_config={}, topology=Topology(), reduction="ar", dtype="float32", prompts=((1,),))
    recorder = RoutingRecorder(model, job, Parallel.single())
    assert all("choose" in vars(r) for r in routers)
    recorder.restore()
    assert all("choose" not in vars(r) for r in routers)


def test_an_ordinary_run_records_nothing(weights_dir, monkeypatch):
    import layer_boundary.cli.routing as routing

    monkeypatch.setattr(routing, "RoutingRecorder", None)  # any use would raise
    job = _job(weights_dir, "qwen3_moe", "bfloat16", (Topology(), "ar", "sum_len", {}), 0)
    assert run_rank(__import__("layer_boundary").Parallel.single(), job)["routing"] is None


class _NoRouters:
    """A third party's model: no `routed_layers()`."""


@pytest.mark.parametrize(
    "hf, dtype, pinned, note",
    [({"num_local_experts": 8}, "bfloat16", False, "names no routers"), ({"num_local_experts": 8}, "float64", False, None),
     ({"hidden_size": 64}, "bfloat16", False, None)],
)
def test_a_family_without_routers_is_compared_unpinned_and_says_so(hf, dtype, pinned, note):
    args = argparse.Namespace(check="hf", dtype=dtype, model="llama_moe", pp=1, tbo=False)
    got = run_cmd._routing_plan(args, None, argparse.Namespace(hf=hf), "ar", {}, _NoRouters())
    assert got[0] is pinned and (got[1] is None if note is None else note in got[1])


def test_a_dense_model_of_a_routed_family_is_not_pinned():
    from layer_boundary import Parallel
    from layer_boundary_models import build_model

    model = build_model(model_config("qwen3"), Parallel.single(), device="meta")
    args = argparse.Namespace(check="single", dtype="bfloat16", model="qwen3", pp=1, tbo=False)
    assert run_cmd._routing_plan(args, None, argparse.Namespace(hf={}), "ar", {}, model) == (False, None)


@pytest.mark.gloo
def test_the_default_check_of_a_bfloat16_moe_run_says_what_it_compared():
    """`run --model qwen3_moe --dtype bfloat16` (check hf): the run against one rank routed like
    it, that rank against Hugging Face in float64, both in the JSON and under the verdict line."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "layer_boundary", "run", "--model", "qwen3_moe", "--tp", "2", "--dtype", "bfloat16",
                          "--decode-steps", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    check = json.loads(out.stdout)["check"]
    assert check["passed"] is True and check["reference"] == "hf" and check["comparison"] == run_cmd.PINNED, check
    assert check["routing"]["passed"] is True and check["routing"]["choices"] > 0
    assert check["hf_parity"]["dtype"] == "float64" and check["hf_parity"]["rel_err"] < 1e-10
    lines = run_cmd._check_details(check, "bfloat16")
    assert lines[0].startswith("compared: logits against one rank routed like the run")
    assert lines[1].startswith("routing: PASS") and lines[2].startswith("one rank vs hf in float64: PASS")


def test_a_layer_the_run_never_routed_fails_the_check(weights_dir, inject):
    """A run whose ranks record no routing for a layer (its router never ran there): the
    reference cannot follow it, and the check fails saying so."""

    def drop_first(model, parallel):
        layers = model.routed_layers()
        model.routed_layers = lambda: layers[1:]

    inject(drop_first)
    check = _verdict(_job(weights_dir, "qwen3_moe", "bfloat16", TP2, 0))
    assert check["passed"] is False and check["comparison"] == "logits against one rank (routing not pinned)"
    assert "the reference cannot route like the run: the run recorded no routing for layer 0" in check["routing"]["problems"][0]
    assert run_cmd._check_details(check, "bfloat16")[2].startswith("  the reference cannot route like the run")
