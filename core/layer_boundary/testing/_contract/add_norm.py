"""The contract of an `AddNormKernel` (a local add + norm kernel), one pass per device.

- construction: the factory answers every request of the pass (RMSNorm and Gemma, each dtype
  with each statistic dtype the models ask for it (`compute_dtypes`); LayerNorm with and without a
  bias where the record declares "layer"; the settings' width) with a callable or None, never
  raising; so does a `post_norm_factory` for the post-norm pairs of the kinds it declares
  (Gemma's sandwich, OLMo-2's post-norm before an identity read, ...);
- purity: an accepted kernel returns new tensors and leaves contribution and residual unchanged
  (values and version counters): the caller may still hold both (captures, snapshots);
- parity: its (normed, new residual) are shaped, typed and placed as asked (a wrong one is
  reported with the message a run raises) and match the torch reference `add_rms_norm` within
  the dtype's tolerance, at every row count of the settings (zero rows included). A record that accepts no
  request on a device fails parity there unless it names a `contract_preparation` (then the pass
  runs the factory that returns on this machine; cutedsl and flashinfer bind their reference
  kernels) - or, on CUDA, whatever the hardware takes.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..._plugins.results import matches, pair_matches, pair_problem, result_problem
from ..._plugins.selection import Answer, call_record
from ..._residual.add_norm import NORM_READ, GemmaRMSNorm, LayerNorm, RMSNorm, add_rms_norm
from ..._residual.kernels import OUTPUTS, kernel_who, request_for
from ..._residual.post_norm import POST_NORM, PostNormRead, post_norm_arguments
from .report import DTYPES, ContractReport, ContractSettings, relative_error
from .stages import Identity

__all__ = ["ADD_NORM_CHECKS", "add_norm_report", "compute_dtypes"]

ADD_NORM_CHECKS = ("record", "construction", "purity", "parity")


def compute_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    """The norm statistic dtypes asked with rows of `dtype`: float32, as every shipped model's
    norms compute (float64 rows included: `run --dtype float64` asks AddNormRequest(dtype=float64,
    compute_dtype=float32)), and the rows' own dtype where it is wider (float64 statistics, as the
    float64 test grids ask)."""
    widest = torch.promote_types(dtype, torch.float32)
    return [torch.float32] + ([widest] if widest != torch.float32 else [])


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _factory(record, device: str):
    path = getattr(record, "contract_preparation", None)
    if not path or device == "cuda":
        return functools.partial(call_record, record)
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)()
    except Exception as exc:
        raise RuntimeError(f"record {record.name!r}: its contract_preparation {path!r} did not load: {type(exc).__name__}: {exc}") from exc


def _norm_factory(record, device: str, prepared, field: str):
    """The plain-norm (`field="norm_factory"`) or post-norm factory to check: the record's own on
    CUDA (or with no preparation), else the prepared factory's attribute of that name (None:
    unchecked here)."""
    if getattr(record, field) is None:
        return None
    if not getattr(record, "contract_preparation", None) or device == "cuda":
        return functools.partial(call_record, record, factory=field)
    return getattr(prepared, field, None)


#: the norms a pass asks about: (label, kind, build(hidden, dtype, statistic dtype))
_NORMS = (
    ("RMSNorm", "rms", lambda h, dtype, compute: RMSNorm(h, dtype=dtype, compute_dtype=compute)),
    ("GemmaRMSNorm", "gemma_rms", lambda h, dtype, compute: GemmaRMSNorm(h, dtype=dtype, compute_dtype=compute)),
    ("LayerNorm", "layer", lambda h, dtype, compute: LayerNorm(h, dtype=dtype, compute_dtype=compute)),
    ("LayerNorm(bias=False)", "layer", lambda h, dtype, compute: LayerNorm(h, bias=False, dtype=dtype, compute_dtype=compute)),
)
#: the (post-norm, read) pairs a `post_norm_factory` is asked about: Gemma's sandwich, a plain
#: RMSNorm pair, OLMo-2's post-norm before an identity read, LayerNorm around LayerNorm
_POST_PAIRS = (("RMSNorm", "RMSNorm"), ("GemmaRMSNorm", "GemmaRMSNorm"), ("RMSNorm", None), ("LayerNorm", "LayerNorm"))


def _computes(kind: str, dtype: torch.dtype) -> list:
    """The statistic dtypes a pass asks a norm of `kind` with rows of `dtype`: an RMS norm's
    `compute_dtypes`; a LayerNorm's own (None: the wider of the rows' dtype and float32)."""
    return [None] if kind == "layer" else compute_dtypes(dtype)


def _weighted(build, hidden, dtype, compute, g, device):
    """A norm with weights (and a bias) away from their defaults, on `device`."""
    norm = build(hidden, dtype, compute)
    with torch.no_grad():
        norm.weight.copy_((0.0 if norm.offset else 1.0) + 0.1 * torch.randn(hidden, generator=g))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(0.1 * torch.randn(hidden, generator=g))
    return norm.to(device)


def add_norm_report(record, settings: ContractSettings, registered=None) -> ContractReport:
    report = ContractReport(record.name, "add norm kernel")
    device = torch.device(settings.device)
    factory = _factory(record, settings.device)
    norm_factory = _norm_factory(record, settings.device, factory, "norm_factory")
    post_factory = _norm_factory(record, settings.device, factory, "post_norm_factory")
    kinds = record.norm_kinds
    # the record as a run names it (`Answer.source`), so a wrong return reads as it would there
    plugin = None if registered is None else registered.plugin
    source = Answer(record.name, plugin, None if registered is None else registered.distribution).source
    g = torch.Generator().manual_seed(settings.seed)
    accepted = 0
    for label, kind, build in _NORMS:
        if kind not in kinds:
            continue
        for dtype_name in settings.dtypes:
            dtype = DTYPES[dtype_name]
            for compute in _computes(kind, dtype):
                norm = _weighted(build, settings.hidden_size, dtype, compute, g, device)
                statistics = "" if compute is None else f" (statistics in {_dtype(compute)})"
                case = f"{label} {dtype_name}{statistics} H={settings.hidden_size} on {settings.device}"
                request = request_for(norm, device, dtype, dtype)
                kernel = _construct(report, factory, request, case)
                if kernel is not None:
                    accepted += 1
                    who = (kernel_who(source), plugin)
                    for rows in settings.rows:
                        _run(report, kernel, norm, rows, dtype, dtype_name, settings, g, f"{case} T={rows}", who)
                # the plain norm is its own answer: a record may run it and decline the add + norm
                if norm_factory is not None and kind != "layer":
                    who = (kernel_who(source, "norm"), plugin)
                    accepted += _plain(report, norm_factory, norm, request, dtype, dtype_name, settings, g, case, who)
    if post_factory is not None:
        accepted += _post_norms(report, post_factory, kinds, settings, g, device, (kernel_who(source, POST_NORM), plugin))
    report.stats["accepted"] += accepted
    if not accepted and (getattr(record, "contract_preparation", None) or settings.device == "cpu"):
        report.add("parity", f"accepted no request on {settings.device}: nothing was checked. A record whose kernels need "
                             "hardware names a contract_preparation (AddNormKernel.contract_preparation) that readies them here")
    return report


def _construct(report, factory, request, case: str):
    """The factory's kernel for `request`, or None (declined, or a construction violation)."""
    try:
        kernel = factory(request)
    except Exception as exc:  # noqa: BLE001 - the rule is "never raises"
        report.add("construction", f"{case}: the factory raised {type(exc).__name__}: {exc} (decline with None)")
        return None
    if kernel is None:
        report.stats["declined"] += 1
        return None
    if not callable(kernel):
        report.add("construction", f"{case}: the factory returned {kernel!r}, which is not callable")
        return None
    return kernel


def _run(report, kernel, norm, rows, dtype, dtype_name, settings, g, case, who) -> None:
    extra = (norm.bias,) if norm.norm_kind == "layer" else ()  # a LayerNorm's kernel takes its bias
    _check_pair(report, case, lambda c, r: kernel(c, r, norm.weight, *extra), lambda c, r: add_rms_norm(norm, c, r), "add_rms_norm",
                rows, dtype, dtype_name, settings, g, who)


def _check_pair(report, case, call, reference, reference_name, rows, dtype, dtype_name, settings, g, who) -> None:
    """`call(c, r)` on random rows: inputs untouched, new tensors out, a (normed, new residual)
    pair as a run checks it, each within the dtype's tolerance of `reference(c, r)`."""
    hidden = settings.hidden_size
    c = (torch.randn(rows, hidden, generator=g) * 2).to(dtype).to(settings.device)
    r = torch.randn(rows, hidden, generator=g).to(dtype).to(settings.device)
    held = (c.clone(), r.clone(), c._version, r._version)
    try:
        out = call(c, r)
    except Exception as exc:  # noqa: BLE001
        report.add("parity", f"{case}: the kernel raised {type(exc).__name__}: {exc}")
        return
    report.stats["launches"] += 1
    if not (torch.equal(c, held[0]) and torch.equal(r, held[1])) or (c._version, r._version) != held[2:]:
        report.add("purity", f"{case}: the kernel wrote its contribution or residual (return new tensors)")
    if not pair_matches(out, r):  # what a run raises (`FusionError`), word for word
        report.add("parity", f"{case}: {pair_problem(out, r, *who, names=OUTPUTS)}")
        return
    normed, new_residual = out
    ptrs = {c.data_ptr(), r.data_ptr()} if rows else set()
    if rows and (normed.data_ptr() in ptrs or new_residual.data_ptr() in ptrs):
        report.add("purity", f"{case}: an output is an input's memory")
    want_normed, want_residual = reference(held[0], held[1])
    tol = settings.tolerance(dtype_name)
    for what, got, want in (("normed", normed, want_normed), ("new residual", new_residual, want_residual)):
        err = relative_error(got, want)
        if err > tol:
            report.add("parity", f"{case}: {what} differs from {reference_name} by {err:.2e} relative (tolerance {tol:.0e})")


def _plain(report, norm_factory, norm, request, dtype, dtype_name, settings, g, case, who) -> bool:
    """The plain norm (no add) of the same request: never raises, new tensor, x untouched, and
    within the dtype's tolerance of the norm's torch path, on 2-D rows, on 3-D per-head rows, and
    on per-head rows that are a slice of a fused q/k/v projection's output (strided by its width).
    Returns whether the norm factory accepted."""
    kernel = _construct(report, norm_factory, request, f"{case} (no add)")
    if kernel is None:
        return False
    hidden = settings.hidden_size
    shapes = [(rows, hidden) for rows in settings.rows] + [(3, 2, hidden)]
    inputs = [(f"shape {shape}", torch.randn(*shape, generator=g).to(dtype).to(settings.device)) for shape in shapes]
    # columns hidden..3*hidden of [3, 4*hidden] rows as [3, 2, hidden] heads: a view whose rows are
    # strided by the fused width, as a q or k slice of a fused q/k/v projection is
    fused = torch.randn(3, 4 * hidden, generator=g).to(dtype).to(settings.device)
    inputs.append((f"heads {(3, 2, hidden)} of a fused projection", fused[:, hidden : 3 * hidden].view(3, 2, hidden)))
    for label, x in inputs:
        held, version = x.clone(), x._version
        where = f"{case} (no add) {label}"
        try:
            out = kernel(x, norm.weight)
        except Exception as exc:  # noqa: BLE001
            report.add("parity", f"{where}: the kernel raised {type(exc).__name__}: {exc}")
            continue
        report.stats["launches"] += 1
        wrong = not matches(out, x.shape, x)
        if not torch.equal(x, held) or x._version != version or (not wrong and x.numel() and out.data_ptr() == x.data_ptr()):
            report.add("purity", f"{where}: the plain norm wrote x or returned its memory (return a new tensor)")
        if wrong:  # what a run raises, word for word
            report.add("parity", f"{where}: {result_problem(*who, OUTPUTS[0], out, x.shape, x)}")
            continue
        want = norm.torch_forward(held)
        err = relative_error(out, want)
        if err > settings.tolerance(dtype_name):
            report.add("parity", f"{where}: differs from the torch norm by {err:.2e} relative (tolerance {settings.tolerance(dtype_name):.0e})")
    return True


def _post_norms(report, post_factory, kinds, settings, g, device, who) -> int:
    """The post-norm + add + norm of every pair of the kinds the record declares: never raises,
    new tensors out, inputs untouched, within the dtype's tolerance of the torch completion (the
    post-norm's `torch_forward`, then `add_rms_norm`). Returns how many requests it accepted."""
    builds = {label: (kind, build) for label, kind, build in _NORMS}
    accepted = 0
    hidden = settings.hidden_size
    for post_label, read_label in _POST_PAIRS:
        post_kind = builds[post_label][0]
        read_kind = "none" if read_label is None else builds[read_label][0]
        if post_kind not in kinds or (read_kind != "none" and read_kind not in kinds):
            continue
        for dtype_name in settings.dtypes:
            dtype = DTYPES[dtype_name]
            widest = compute_dtypes(dtype)[-1]  # float64 rows take float64 statistics: the reference then matches to 1e-10
            post = _weighted(builds[post_label][1], hidden, dtype, widest, g, device)
            read = Identity(hidden) if read_label is None else _weighted(builds[read_label][1], hidden, dtype, widest, g, device)
            case = f"post-norm {post_label} + add + {read_label or 'identity'} {dtype_name} H={hidden} on {settings.device}"
            request = PostNormRead(post, NORM_READ, read).request(device, dtype, dtype)
            kernel = _construct(report, post_factory, request, case)
            if kernel is None:
                continue
            accepted += 1
            for rows in settings.rows:
                _check_pair(report, f"{case} T={rows}", lambda c, r, k=kernel, p=post, n=read: k(c, r, *post_norm_arguments(p, n)),
                            lambda c, r, p=post, n=read: add_rms_norm(n, p.torch_forward(c), r), "the torch completion",
                            rows, dtype, dtype_name, settings, g, who)
    return accepted
