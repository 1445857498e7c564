"""Residual kinds: the laws their update and read must keep, on every dtype, norm and row count."""

from __future__ import annotations

import types
from typing import Sequence

import torch

from ..._plugins.selection import call_record
from ..._residual import ResidualOps
from ..._residual.add_norm import PLAIN_ADD
from .report import DTYPES, ContractReport, ContractSettings, relative_error
from .stages import device_of, make_norm


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
    return max((relative_error(a, b) for a, b in zip(got_parts, want_parts)), default=0.0)


def _same_bits(a, b) -> bool:
    pa, pb = _rows(a), _rows(b)
    return len(pa) == len(pb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(pa, pb))


def _residual_laws(ops: ResidualOps, tag: str, settings: ContractSettings, report: ContractReport) -> None:
    device = device_of(settings.device)
    H = settings.hidden_size
    for dtype_name in settings.dtypes:
        dtype, tol = DTYPES[dtype_name], settings.tolerance(dtype_name)
        for norm_kind in ("rms", "gemma_rms"):
            norm = make_norm(norm_kind, H, dtype, device, settings.seed)
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


def _on_device(value, device: torch.device):
    """`value` with every tensor inside it (dicts, lists, tuples, namespaces) moved to `device`.

    Option sets are written once, on the CPU; the laws run on the device under test, and a kind
    whose options hold parameters (hyper-connection mappings) must find them there too."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _on_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_device(v, device) for v in value)
    if isinstance(value, types.SimpleNamespace):
        return types.SimpleNamespace(**_on_device(vars(value), device))
    return value


def _describe(opts: dict) -> str:
    """Option names and their scalar values; tensors by shape (a case line stays one line)."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return f"tensor{tuple(v.shape)}"
        if isinstance(v, types.SimpleNamespace):
            return "namespace(" + ", ".join(f"{k}={one(x)}" for k, x in vars(v).items()) + ")"
        if isinstance(v, (list, tuple)):
            inner = ", ".join(one(x) for x in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner})"
        return repr(v)
    return "options {" + ", ".join(f"{k}={one(v)}" for k, v in opts.items()) + "}"


def residual_report(record, options: Sequence[dict], settings: ContractSettings) -> ContractReport:
    report = ContractReport(record.name, "residual kind")
    device = device_of(settings.device)
    with torch.inference_mode(False), torch.no_grad():
        for opts in options:
            tag = _describe(opts) if opts else "no options"
            opts = _on_device(opts, device)
            try:
                ops, again = call_record(record, **opts), call_record(record, **opts)
            except Exception as exc:  # noqa: BLE001
                report.add("construction", f"factory with {tag} raised {type(exc).__name__}: {exc}")
                continue
            if not isinstance(ops, ResidualOps):
                report.add("construction", f"factory with {tag} returned {type(ops).__name__}; expected ResidualOps")
                continue
            flags = lambda o: (o.name, o.supports_slices, repr(o.attn_update.plain_add), repr(o.ffn_read.plain_norm))  # noqa: E731
            if not isinstance(again, ResidualOps) or flags(ops) != flags(again):
                report.add("construction", f"factory with {tag} built different ops when called twice")
            report.stats["ops_built"] += 1
            _residual_laws(ops, tag, settings, report)
    return report
