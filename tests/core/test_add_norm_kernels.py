"""The local add + RMSNorm kernels (`AddNormKernel` records): which one a norm runs, that the
boundaries and the final norm run it, and that it never writes what the caller holds."""

import copy

import pytest

from layer_boundary.testing import requires_plugins
import torch

from layer_boundary import Forward, GemmaRMSNorm, Parallel, RMSNorm, declare_attn, declare_ffn, layer_stack, make_stages, residual_batch
from layer_boundary.plugin import AddNormKernel, AddNormRequest, add_rms_norm, get_registry, hookimpl, reset_registry

from layer_boundary._residual import kernels
from layer_boundary._residual.add_norm import describe_add_norm, prepare_norms


def torch_kernel(calls, name):
    """A kernel with the reference numerics that records its calls."""

    def run(contribution, residual, weight):
        calls.append(name)
        total = contribution.float() + residual.float()
        stat = torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (total * stat).to(residual.dtype) * weight, total.to(residual.dtype)

    return run


class Kernels:
    """An inline plugin yielding `AddNormKernel` records; each factory logs its requests."""

    def __init__(self, *specs):
        self.requests = []
        self.calls = []
        self.records = [self._record(*spec) for spec in specs]

    def _record(self, name, priority, accepts):
        def factory(request):
            self.requests.append((name, request))
            return torch_kernel(self.calls, name) if accepts(request) else None

        return AddNormKernel(name=name, factory=factory, priority=priority, description=f"test kernel {name}")

    @hookimpl
    def layer_boundary_add_norm_kernels(self):
        return self.records


def always(request):
    return True


def never(request):
    return False


@pytest.fixture
def kernels_of(fresh_registry, inline_plugin):
    def make(*specs, name="testkernels"):
        return inline_plugin(Kernels(*specs), name=name)

    return make


def _inputs(rows=3, hidden=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(rows * hidden)
    return torch.randn(rows, hidden, generator=g, dtype=dtype), torch.randn(rows, hidden, generator=g, dtype=dtype)


def test_record_is_public_and_ordered_by_priority_then_name(kernels_of):
    kernels_of(("zz.low", 5, always), ("aa.high", 300, always), ("bb.high", 300, always))
    names = [r.name for r in get_registry().add_norm_kernels if r.plugin == "testkernels"]
    assert names == ["aa.high", "bb.high", "zz.low"]
    with pytest.raises(ValueError, match="dotted"):
        AddNormKernel(name="nodot", factory=always)


def test_first_accepting_record_wins_and_is_asked_once_per_key(kernels_of):
    plugin = kernels_of(("a.declines", 300, never), ("b.accepts", 200, always), ("c.later", 100, always))
    norm = RMSNorm(16)
    c, r = _inputs()
    for _ in range(3):
        normed, new_residual = norm.fused_add_forward(c, r)
    assert plugin.calls == ["b.accepts"] * 3
    assert [name for name, _ in plugin.requests] == ["a.declines", "b.accepts"]  # once; c never asked
    assert norm.add_norm_kernel() == "b.accepts"
    want = add_rms_norm(norm, c, r)
    torch.testing.assert_close(normed, want[0])
    torch.testing.assert_close(new_residual, want[1])
    # another dtype is another key: asked again
    norm64 = norm.double()
    norm64.fused_add_forward(c.double(), r.double())
    assert len(plugin.requests) == 4


def test_request_carries_the_norm_facts(kernels_of):
    plugin = kernels_of(("a.k", 300, always))
    gemma = GemmaRMSNorm(16, eps=1e-5, dtype=torch.bfloat16)
    c, r = _inputs(dtype=torch.bfloat16)
    gemma.fused_add_forward(c, r)
    (_, request), = plugin.requests
    assert isinstance(request, AddNormRequest)
    assert request == AddNormRequest(
        device=torch.device("cpu"), dtype=torch.bfloat16, contribution_dtype=torch.bfloat16, weight_dtype=torch.bfloat16,
        hidden_size=16, offset=1.0, eps=1e-5, compute_dtype=torch.float32, norm_kind="gemma_rms",
    )
    assert request.uniform_dtype is torch.bfloat16
    mixed = AddNormRequest(device=torch.device("cpu"), dtype=torch.bfloat16, contribution_dtype=torch.float32,
                           weight_dtype=torch.bfloat16, hidden_size=16, offset=0.0, eps=1e-6, compute_dtype=torch.float32,
                           norm_kind="rms")
    assert mixed.uniform_dtype is None


def test_none_accepts_runs_the_torch_path(kernels_of):
    plugin = kernels_of(("a.declines", 300, never))
    norm = RMSNorm(16)
    c, r = _inputs()
    got = norm.fused_add_forward(c, r)
    want = norm.add_forward(c, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert norm.add_norm_kernel() == kernels.TORCH
    assert plugin.calls == []


@requires_plugins("models")
def test_opt_out_and_own_math_never_ask_a_kernel(kernels_of):
    plugin = kernels_of(("a.k", 300, always))

    class Custom(RMSNorm):
        def _normalize(self, x):
            return super()._normalize(x) * 2

    c, r = _inputs()
    for norm in (RMSNorm(16, kernels=False), Custom(16)):
        got = norm.fused_add_forward(c, r)
        want = norm.add_forward(c, r)
        assert torch.equal(got[0], want[0])
        assert norm.add_norm_kernel() == kernels.TORCH
    assert plugin.requests == [] and plugin.calls == []
    assert "kernels=False" in describe_add_norm(RMSNorm(16, kernels=False))
    from layer_boundary_models.nemotron_h import NemotronHRMSNorm  # its scale is the kernels': asked

    NemotronHRMSNorm(16).fused_add_forward(c, r)
    assert plugin.calls == ["a.k"]
    assert "overrides" in describe_add_norm(Custom(16))


def test_disabled_plugin_and_reset_registry_forget_the_choice(kernels_of, monkeypatch):
    plugin = kernels_of(("a.k", 300, always), name="testkernels")
    norm = RMSNorm(16)
    c, r = _inputs()
    norm.fused_add_forward(c, r)
    assert norm.add_norm_kernel() == "a.k"
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "testkernels")
    reset_registry()
    assert [x.name for x in get_registry().add_norm_kernels if x.name == "a.k"] == []
    norm.fused_add_forward(c, r)
    assert norm.add_norm_kernel() == kernels.TORCH
    assert plugin.calls == ["a.k"]
    monkeypatch.delenv("LAYER_BOUNDARY_DISABLE_PLUGINS")
    reset_registry()
    norm.fused_add_forward(c, r)
    assert plugin.calls == ["a.k", "a.k"]


def test_moving_or_copying_a_norm_chooses_again(kernels_of):
    plugin = kernels_of(("a.k", 300, lambda req: req.dtype == torch.float32))
    norm = RMSNorm(16)
    c, r = _inputs()
    norm.fused_add_forward(c, r)
    clone = copy.deepcopy(norm)
    assert "_add_norm_kernels" not in clone.__dict__  # bound to the original's weight: not copied
    with torch.no_grad():
        clone.weight.mul_(2)
    got = clone.fused_add_forward(c, r)
    torch.testing.assert_close(got[0], clone.add_forward(c, r)[0])
    norm.to(torch.float64)
    assert "_add_norm_kernels" not in norm.__dict__
    norm.fused_add_forward(c.double(), r.double())
    assert norm.add_norm_kernel() == kernels.TORCH
    assert len(plugin.requests) == 2  # the copy shares the original's answer (its own weight bound in)


def test_factory_returning_a_non_callable_is_an_error(kernels_of, inline_plugin):
    class Bad:
        @hookimpl
        def layer_boundary_add_norm_kernels(self):
            yield AddNormKernel(name="bad.kernel", factory=lambda request: 42, priority=400)

    inline_plugin(Bad(), name="bad")
    with pytest.raises(TypeError, match="bad.kernel"):
        RMSNorm(16).fused_add_forward(*_inputs())


# the boundaries and the final norm run the chosen kernel ------------------------------------------


class Stack(torch.nn.Module):
    """A TP=1 stack of attention + FFN layers through the boundaries (nothing is ever owed)."""

    def __init__(self, hidden=16, layers=3, norm=RMSNorm):
        super().__init__()
        torch.manual_seed(0)
        self.parallel = Parallel.single()
        self.norms, self.lins, self.boundaries = torch.nn.ModuleList(), torch.nn.ModuleList(), []
        with layer_stack(self.parallel, reduction="ar"):
            for i in range(layers):
                n1, n2 = norm(hidden), norm(hidden)
                with torch.no_grad():
                    n1.weight.normal_(1, 0.1)
                    n2.weight.normal_(0, 0.1)
                self.norms.extend([n1, n2])
                self.lins.extend([torch.nn.Linear(hidden, hidden, bias=False), torch.nn.Linear(hidden, hidden, bias=False)])
                self.boundaries.append(make_stages((declare_attn(), n1), (declare_ffn(), n2), previous=declare_ffn() if i else None,
                                                   terminal=i == layers - 1))
        self.final = norm(hidden)

    def forward(self, x):
        fwd = Forward(self.parallel, x.shape[0])
        residual_batch.start(fwd)
        h = x
        for i, (attn, ffn) in enumerate(self.boundaries):
            h = attn.prepare(h, fwd)
            h = attn.finish(self.lins[2 * i](h), fwd)
            h = ffn.prepare(h, fwd)
            with ffn.exit(fwd) as out:
                y = self.lins[2 * i + 1](h)
            h = out.finish(y)
        return residual_batch.norm(h, fwd, self.final)

    def by_hand(self, x):
        h, residual, y = self.norms[0](x), x, None
        for i in range(len(self.boundaries)):
            if i:
                h, residual = self.norms[2 * i].add_forward(y, residual)
            a = self.lins[2 * i](h)
            h, residual = self.norms[2 * i + 1].add_forward(a, residual)
            y = self.lins[2 * i + 1](h)
        return self.final.add_forward(y, residual)[0]


@pytest.mark.parametrize("norm", [RMSNorm, GemmaRMSNorm])
def test_every_boundary_and_the_final_norm_run_the_kernel_at_tp1(kernels_of, norm):
    plugin = kernels_of(("a.k", 300, always))
    with torch.no_grad():
        stack = Stack(norm=norm)
        x = torch.randn(5, 16)
        got = stack(x)
        want = stack.by_hand(x)
    # per layer: attention's read (after the first) and the FFN's read, plus the final norm
    assert len(plugin.calls) == 2 * 3 - 1 + 1
    if norm is RMSNorm:  # the test kernel is the plain RMSNorm
        torch.testing.assert_close(got, want)
    described = [b.plan.describe() for pair in stack.boundaries for b in pair]
    assert "add_norm" not in described[0]  # the stack entry norms without an add
    assert all("add_norm" in d and "a.k" in d["add_norm"] for d in described[1:])
    line = described[1]["add_norm"]
    assert line.startswith(f"add + {norm.__name__}: a.k on cpu float32; chain: ") and line.endswith(" > core.torch")


def test_norm_read_after_an_unfused_sum_runs_the_kernel(kernels_of):
    from layer_boundary._plugins.builtin import _complete_then_read
    from layer_boundary._residual.add_norm import NORM_READ
    from layer_boundary._residual.post_norm import LocalRead

    plugin = kernels_of(("a.k", 300, always))
    norm = RMSNorm(16)
    c, r = _inputs()

    class Owed:
        def complete(self):
            return c

    normed, new_residual = _complete_then_read(LocalRead(NORM_READ, norm), Owed(), r, None)
    assert plugin.calls == ["a.k"]
    torch.testing.assert_close(new_residual, c + r)


def test_prepare_model_chooses_before_the_first_forward(kernels_of):
    import layer_boundary

    plugin = kernels_of(("a.k", 300, always))
    stack = Stack(layers=2)
    layer_boundary.prepare_model(stack)
    assert len(plugin.requests) == 1  # every norm of the model has the same facts: one request for all
    assert {name for name, _ in plugin.requests} == {"a.k"}
    assert all(n.__dict__.get("_add_norm_kernels") for n in stack.norms)
    assert stack.final.__dict__.get("_add_norm_kernels")


def test_no_kernel_writes_what_the_caller_holds(kernels_of):
    """The torch path and the core's dispatch leave contribution and residual untouched
    (values and version counters): a capture or a snapshot of them stays valid."""
    kernels_of(("a.k", 300, always))
    for norm in (RMSNorm(16), RMSNorm(16, kernels=False), GemmaRMSNorm(16)):
        c, r = _inputs()
        held = (c.clone(), r.clone(), c._version, r._version)
        normed, new_residual = norm.fused_add_forward(c, r)
        assert torch.equal(c, held[0]) and torch.equal(r, held[1])
        assert (c._version, r._version) == held[2:]
        assert normed.data_ptr() not in (c.data_ptr(), r.data_ptr())
        assert new_residual.data_ptr() not in (c.data_ptr(), r.data_ptr())


def test_capture_of_the_residual_survives_the_next_boundary(kernels_of):
    kernels_of(("a.k", 300, always))
    parallel = Parallel.single()
    n1, n2, final = RMSNorm(8), RMSNorm(8), RMSNorm(8)
    with layer_stack(parallel, reduction="ar"):
        attn, ffn = make_stages((declare_attn(), n1), (declare_ffn(), n2), terminal=True)
    x = torch.randn(3, 8)
    fwd = Forward(parallel, 3)
    residual_batch.start(fwd)
    h = attn.prepare(x, fwd)
    h = attn.finish(h * 2, fwd)
    snap = residual_batch.snapshot(h, fwd)
    kept = snap.clone()
    h = ffn.prepare(h, fwd)
    with ffn.exit(fwd) as out:
        y = h * 3
    h = out.finish(y)
    residual_batch.norm(h, fwd, final)
    assert torch.equal(snap, kept)


def test_compiled_fullgraph_traces_the_chosen_kernel(kernels_of, inline_plugin):
    """A kernel behind a torch.library custom op traces under torch.compile(fullgraph=True)
    once chosen (eager first, or prepare_model); an unchosen norm traces its torch path."""

    @torch.library.custom_op("lb_test::add_rmsnorm", mutates_args=())
    def op(contribution: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = contribution + residual
        return total * weight, total.clone()

    @op.register_fake
    def _(contribution, residual, weight):
        return torch.empty_like(residual), torch.empty_like(residual)

    class OpKernel:
        @hookimpl
        def layer_boundary_add_norm_kernels(self):
            yield AddNormKernel(name="op.k", factory=lambda req: torch.ops.lb_test.add_rmsnorm, priority=400)

    inline_plugin(OpKernel(), name="opkernel")
    norm, fresh = RMSNorm(16), RMSNorm(16)
    c, r = _inputs()
    eager = norm.fused_add_forward(c, r)  # chooses op.k
    compiled = torch.compile(lambda a, b: norm.fused_add_forward(a, b), fullgraph=True, backend="eager")
    got = compiled(c, r)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    torch._dynamo.reset()
    compiled_fresh = torch.compile(lambda a, b: fresh.fused_add_forward(a, b), fullgraph=True, backend="eager")
    got = compiled_fresh(c, r)
    torch.testing.assert_close(got[0], fresh.add_forward(c, r)[0])
    torch._dynamo.reset()


# the contract suite ------------------------------------------------------------------------------


def _contract(factory):
    from layer_boundary.testing.contract import ContractViolation, check_add_norm_kernel

    record = AddNormKernel(name="suite.kernel", factory=factory, priority=100, description="under test")
    try:
        return check_add_norm_kernel(record), None
    except ContractViolation as exc:
        return None, str(exc)


def test_contract_passes_a_correct_kernel_and_names_each_broken_rule():
    def _ref(c, r, w):
        total = c.float() + r.float()
        return ((total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)) * w.float()).to(r.dtype), total.to(r.dtype)

    report, error = _contract(lambda request: _ref if request.dtype == torch.bfloat16 and not request.offset else None)
    assert error is None and report.stats["accepted"] == 1 and report.stats["launches"] == 4

    def writes(c, r, w):
        normed, total = _ref(c, r, w)
        r.copy_(total)
        return normed, r

    _, error = _contract(lambda request: writes if request.dtype == torch.bfloat16 else None)
    assert "[purity]" in error and "wrote its contribution or residual" in error

    _, error = _contract(lambda request: (lambda c, r, w: (c * 0, r.clone())) if request.dtype == torch.float32 else None)
    assert "[parity]" in error and "normed differs" in error

    def raises(request):
        raise RuntimeError("boom")

    _, error = _contract(raises)
    assert "[construction]" in error and "boom" in error

    _, error = _contract(lambda request: None)
    assert "accepted no request" in error


@pytest.mark.parametrize("name", ["cutedsl.add_rmsnorm", "flashinfer.add_rmsnorm"])
def test_the_plugins_kernels_pass_the_contract_on_their_references(name, fresh_registry):
    from layer_boundary.testing.contract import check_add_norm_kernel

    if name not in [r.name for r in get_registry().add_norm_kernels]:
        pytest.skip(f"{name}'s plugin is not installed")
    report = check_add_norm_kernel(name)
    assert report.stats["accepted"] >= 4 and report.stats["launches"] >= 16


# ---------------------------------------------------------------- plain norms (no add): `norm_factory`


class NormKernels:
    """An inline plugin whose records offer a plain-norm kernel (`norm_factory`) or none."""

    def __init__(self, *specs):
        self.calls = []
        self.records = [self._record(*spec) for spec in specs]

    def _record(self, name, priority, has_norm):
        def norm_factory(request):
            def run(x, weight):
                self.calls.append((name, tuple(x.shape)))
                xf = x.float()
                return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + request.eps) * (weight.float() + request.offset)).to(x.dtype)

            return run

        return AddNormKernel(name=name, factory=lambda request: None, priority=priority, description=f"test kernel {name}",
                             norm_factory=norm_factory if has_norm else None)

    @hookimpl
    def layer_boundary_add_norm_kernels(self):
        return self.records


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
def test_plain_norm_runs_the_first_record_with_a_norm_factory(fresh_registry, inline_plugin, norm_cls):
    """A record without `norm_factory` declines plain norms; the next one's kernel runs, on the
    3-D per-head rows Qwen3's q/k norms pass, and only once it is chosen outside a trace."""
    plugin = inline_plugin(NormKernels(("a.nonorm", 300, False), ("b.norm", 200, True)), name="normkernels")
    norm = norm_cls(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 4, 16)
    got = norm(x)
    assert plugin.calls == [("b.norm", (3, 4, 16))]
    choice = kernels.choose_norm(norm, x.device, x.dtype)
    assert choice.name == "b.norm" and choice.declined[0] == "a.nonorm"  # then any installed plugin above b
    torch.testing.assert_close(got, norm.torch_forward(x), rtol=1e-6, atol=1e-6)
    assert prepare_norms(torch.nn.Sequential(norm)) == [("0", kernels.TORCH), ("0 (no add)", "b.norm")]


def test_plain_norm_without_any_norm_factory_runs_torch(fresh_registry, inline_plugin):
    inline_plugin(NormKernels(("a.nonorm", 300, False)), name="normkernels")
    norm = RMSNorm(16)
    x = torch.randn(2, 16)
    assert torch.equal(norm(x), norm.torch_forward(x))
    assert kernels.choose_norm(norm, x.device, x.dtype).name == kernels.TORCH


def test_plain_norm_choice_is_forgotten_with_the_registry_and_on_move(fresh_registry, inline_plugin):
    inline_plugin(NormKernels(("b.norm", 200, True)), name="normkernels")
    norm = RMSNorm(16)
    x = torch.randn(2, 16)
    norm(x)
    assert norm.__dict__["_norm_kernels"]
    reset_registry()
    assert not norm.__dict__["_norm_kernels"] and not norm.__dict__["_norm_choices"]
    norm(x)
    norm.double()
    assert "_norm_kernels" not in norm.__dict__ and "_norm_choices" not in norm.__dict__


def test_plain_norm_never_chooses_inside_torch_compile(fresh_registry, inline_plugin):
    plugin = inline_plugin(NormKernels(("b.norm", 200, True)), name="normkernels")
    norm = RMSNorm(16)
    x = torch.randn(2, 16)
    out = torch.compile(norm, backend="eager", fullgraph=True)(x)
    assert plugin.calls == [] and torch.equal(out, norm.torch_forward(x))


def test_contract_checks_the_plain_norm_purity_and_parity():
    """A norm factory whose kernel normalizes in place, or computes another norm, fails the
    contract (`check_add_norm_kernel`) while its add + norm passes."""
    from layer_boundary.testing.contract import ContractSettings, ContractViolation, check_add_norm_kernel

    def good_add_norm(request):
        return torch_kernel([], "x") if request.dtype == torch.float32 and not request.offset else None

    def in_place(request):
        def run(x, weight):
            return x.mul_(1.0)

        return run

    def wrong(request):
        return lambda x, weight: x * 2

    for name, norm_factory, rule in (("t.inplace", in_place, "purity"), ("t.wrong", wrong, "parity")):
        record = AddNormKernel(name=name, factory=good_add_norm, norm_factory=norm_factory, description="test")
        with pytest.raises(ContractViolation, match=rf"\[{rule}\] RMSNorm float32 \(statistics in float32\) H=64 on cpu \(no add\)"):
            check_add_norm_kernel(record, settings=ContractSettings(dtypes=("float32",)))
    check_add_norm_kernel(AddNormKernel(name="t.addonly", factory=good_add_norm, description="test"),
                          settings=ContractSettings(dtypes=("float32",)))  # no norm factory: nothing more to check
    # a record that declines every add + norm still has its plain norm checked
    with pytest.raises(ContractViolation, match=r"\[parity\] RMSNorm float32 \(statistics in float32\) H=64 on cpu \(no add\)"):
        check_add_norm_kernel(AddNormKernel(name="t.normonly", factory=lambda request: None, norm_factory=wrong, description="test"),
                              settings=ContractSettings(dtypes=("float32",)))
    good_norm = NormKernels(("t.goodnorm", 0, True)).records[0]
    report = check_add_norm_kernel(good_norm, settings=ContractSettings(dtypes=("float32",)))
    assert report.stats["accepted"] == 2  # RMSNorm and Gemma, plain norms only: not "accepted no request"
