"""The provider contract suite: the rules every fusion provider and residual kind must keep.

Point it at a record (the object, or its registered name) and it raises `ContractViolation`
listing every rule the record breaks::

    from layer_boundary.testing.contract import check_fusion_provider, check_residual_kind

    check_fusion_provider("acme.ar_add_rmsnorm")
    # a residual kind is built with the options its factory takes (mhc: streams and mappings)
    check_residual_kind("mhc.torch", options=[{"streams": 4, "attn": attn_mapping, "ffn": ffn_mapping}])

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
- parity: accepted results are (compute input, new residual) shaped, typed and placed like the
  residual (a wrong one reported with the message a run raises), match the unfused reference
  (`add_rms_norm` of the completed sum) within the dtype's tolerance, and a candidate claiming
  `preserves_residual` keeps it.

Rules of an add + norm kernel (`ADD_NORM_CHECKS`, `check_add_norm_kernel`): record,
construction (the factory answers every request with a callable or None, never raising: each
dtype with every norm statistic dtype the models ask for it, float32 for all rows and the rows'
own where wider), purity (new tensors out, contribution and residual unchanged: values and
version counters) and parity (outputs shaped, typed and placed as asked, a wrong one reported
with the message a run raises; the torch reference `add_rms_norm` within the dtype's tolerance,
zero rows included; a record that accepts nothing fails, unless its `contract_preparation`
readies reference kernels).

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

import json
import sys
from typing import Any, Optional, Sequence

import attrs
import torch

from .._plugins.manager import get_registry
from .._plugins.records import AddNormKernel, FusionProvider, ResidualKind
from ._contract.add_norm import ADD_NORM_CHECKS, add_norm_report
from ._contract.fusion import runtime_report
from ._contract.hardware import settings_from_json, without_hardware, without_hardware_here, without_hardware_subprocess
from ._contract.records import check_record, kind_of, registered_entries, resolve
from ._contract.report import (
    ADAPTER_CHECKS,
    DEVICE_FREE_CHECKS,
    FUSION_CHECKS,
    RESIDUAL_CHECKS,
    TOLERANCES,
    ContractReport,
    ContractSettings,
    ContractViolation,
)
from ._contract.residual import residual_report

__all__ = [
    "ContractViolation",
    "ContractSettings",
    "ContractReport",
    "ContractCase",
    "FUSION_CHECKS",
    "RESIDUAL_CHECKS",
    "ADD_NORM_CHECKS",
    "ADAPTER_CHECKS",
    "DEVICE_FREE_CHECKS",
    "TOLERANCES",
    "check_fusion_provider",
    "check_residual_kind",
    "check_add_norm_kernel",
    "contract_cases",
    "contract_params",
]


def _report(record_ref, check: str, device: str, settings: ContractSettings, options, world, hardware_batch) -> ContractReport:
    record, registered = resolve(record_ref)
    name, kind = record.name, kind_of(record)
    settings = attrs.evolve(settings, device=device)
    if check == "record":
        report = ContractReport(name, kind)
        check_record(record, registered, report)
        return report
    if check == "without_hardware":
        if registered is None:
            return without_hardware_here(record, registered, settings, options)
        data = hardware_batch(name) if hardware_batch else without_hardware_subprocess([name], settings, {name: options})[name]
        return ContractReport.from_json(data)
    if device == "cuda" and not torch.cuda.is_available():
        raise ContractViolation("the CUDA checks need a CUDA device")  # contract_params marks these to skip
    key = (record, settings, repr(options), world)  # strong references: no reuse of a freed id
    if key not in _PASSES:  # one pass feeds several checks: run it once per record, device and settings
        if isinstance(record, FusionProvider):
            _PASSES[key] = runtime_report(record_ref if world is not None else record, name, settings, world)
        elif isinstance(record, AddNormKernel):
            _PASSES[key] = add_norm_report(record, settings, registered)
        else:
            _PASSES[key] = residual_report(record, options, settings)
    return _PASSES[key]


_PASSES: dict = {}


def _checks_for(record, checks):
    allowed = {FusionProvider: FUSION_CHECKS, ResidualKind: RESIDUAL_CHECKS, AddNormKernel: ADD_NORM_CHECKS}.get(type(record), ADAPTER_CHECKS)
    checks = allowed if checks is None else tuple(checks)
    unknown = [c for c in checks if c not in allowed]
    if unknown:
        raise ValueError(f"unknown checks {unknown} for a {kind_of(record)}; choose from {allowed}")
    return checks


def check_fusion_provider(record, *, checks: Optional[Sequence[str]] = None, devices: Sequence[str] = ("cpu",),
                          settings: Optional[ContractSettings] = None, world=None) -> ContractReport:
    """Run the contract on a `FusionProvider` (the record, or its registered name).

    `world`: run the runtime checks in this world (`run(fn, topology, *args)`, e.g. an NCCL
    `ProcessWorld`; pass the record by name then) instead of a threaded one per topology.
    Raises `ContractViolation` naming every broken rule; returns the report otherwise.
    """
    resolved, _ = resolve(record)
    if not isinstance(resolved, FusionProvider):
        raise TypeError(f"{resolved.name!r} is a {kind_of(resolved)}; use check_residual_kind")
    return _check(record, resolved, checks, devices, settings or ContractSettings(), (), world)


def check_residual_kind(record, *, options: Sequence[dict] = ({},), checks: Optional[Sequence[str]] = None,
                        devices: Sequence[str] = ("cpu",), settings: Optional[ContractSettings] = None) -> ContractReport:
    """Run the contract on a `ResidualKind` (the record, or its registered name), building its
    ops with each of `options` (keyword arguments of `residual_kind(kind, **options)`)."""
    resolved, _ = resolve(record)
    if not isinstance(resolved, ResidualKind):
        raise TypeError(f"{resolved.name!r} is a {kind_of(resolved)}; use check_fusion_provider")
    return _check(record, resolved, checks, devices, settings or ContractSettings(), tuple(dict(o) for o in options), None)


def check_add_norm_kernel(record, *, checks: Optional[Sequence[str]] = None, devices: Sequence[str] = ("cpu",),
                          settings: Optional[ContractSettings] = None) -> ContractReport:
    """Run the contract on an `AddNormKernel` (the record, or its registered name): the factory
    never raises, accepted kernels write nothing they read and match `add_rms_norm`."""
    resolved, _ = resolve(record)
    if not isinstance(resolved, AddNormKernel):
        raise TypeError(f"{resolved.name!r} is a {kind_of(resolved)}, not an add norm kernel")
    return _check(record, resolved, checks, devices, settings or ContractSettings(), (), None)


def _check(ref, resolved, checks, devices, settings, options, world) -> ContractReport:
    report = ContractReport(resolved.name, kind_of(resolved))
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
            self._data = without_hardware_subprocess(self.names, self.settings, self.options)
        return self._data[name]


def contract_cases(*records, options: Optional[dict] = None, devices: Sequence[str] = ("cpu", "cuda"),
                   settings: Optional[ContractSettings] = None) -> list[ContractCase]:
    """One `ContractCase` per (record, check, device). `records` are records or registered names
    (none: every registered record; records other than fusion providers and residual kinds get
    the record rules only); `options` maps a
    residual kind's name to the option sets its ops are built with."""
    settings = settings or ContractSettings()
    options = dict(options or {})
    if not records:
        records = tuple(dict.fromkeys(item.name for item in registered_entries(get_registry())))
    resolved = [(resolve(r), r) for r in records]
    registered_names = [rec.name for (rec, reg), _ in resolved if reg is not None and isinstance(rec, (FusionProvider, ResidualKind))]
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
        import pickle

        request = pickle.loads(sys.stdin.buffer.read())  # options may hold tensors and namespaces
        settings = settings_from_json(request["settings"])
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
