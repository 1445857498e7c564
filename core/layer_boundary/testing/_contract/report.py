"""The suite's vocabulary: its checks, settings, tolerances, and the report a run produces."""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional

import attrs
import torch

from ..._parallel import Topology


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


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    scale = want64.abs().max().item() if want64.numel() else 0.0
    err = (got64 - want64).abs().max().item() if want64.numel() else 0.0
    return err / scale if scale else err
