"""What a GPU step launches: kernel count and kernel time from torch.profiler (one step, after a
warm-up), shared by the decode bench and the GPU tests."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

__all__ = ["profile_step"]

_COPIES = ("Memcpy", "Memset")


def profile_step(fn: Callable[[], object], *, warmup: int = 2, top: int = 12) -> dict:
    """Run `fn` `warmup` times, then once under torch.profiler: `kernels` (device launches,
    copies and memsets included), `kernel_us` (their summed device time), `copies` (memcpy and
    memset launches among them), `by_name` (the `top` most frequent launch names with counts),
    `by_time` (the `top` names by summed device time: [name, launches, us]: where a step's time
    goes, which the count alone does not say)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    names = Counter(e.name for e in events)
    spent = Counter()
    for e in events:
        spent[e.name] += e.time_range.elapsed_us()
    return {
        "kernels": len(events),
        "kernel_us": float(sum(spent.values())),
        "copies": sum(n for name, n in names.items() if name.startswith(_COPIES)),
        "by_name": [[name[:90], n] for name, n in names.most_common(top)],
        "by_time": [[name[:90], names[name], round(float(us), 1)] for name, us in spent.most_common(top)],
    }
