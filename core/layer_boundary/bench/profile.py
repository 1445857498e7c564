"""What a GPU step launches: kernel count and kernel time from torch.profiler (one step, after a
warm-up), shared by the decode bench and the GPU tests."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

__all__ = ["profile_step", "timeline"]

_COPIES = ("Memcpy", "Memset")


def timeline(intervals, *, top: int = 8) -> dict:
    """Where a stream of kernels sat idle: `intervals` are (name, start_us, end_us) of device
    work. `span_us` runs from the first start to the last end, `busy_us` is the union of the
    intervals (overlapping kernels count once), `idle_us` the rest, and `gaps` the `top` largest
    idle stretches as [previous kernel, next kernel, us], largest first. A graph replay's time
    beyond its kernels' sum shows up here as gaps, each named by the launches around it."""
    ordered = sorted(intervals, key=lambda item: (item[1], item[2]))
    if not ordered:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": []}
    busy, gaps = 0.0, []
    name, start, end = ordered[0]
    run_start, run_end, last = start, end, name
    for name, start, end in ordered[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append((start - run_end, last, name))
            run_start = start
        if end >= run_end:
            run_end, last = end, name
    busy += run_end - run_start
    span = run_end - ordered[0][1]
    gaps.sort(key=lambda gap: -gap[0])
    return {
        "span_us": round(float(span), 1),
        "busy_us": round(float(busy), 1),
        "idle_us": round(float(span - busy), 1),
        "gaps": [[before[:60], after[:60], round(float(us), 2)] for us, before, after in gaps[:top]],
    }


def profile_step(fn: Callable[[], object], *, warmup: int = 2, top: int = 12) -> dict:
    """Run `fn` `warmup` times, then once under torch.profiler: `kernels` (device launches,
    copies and memsets included), `kernel_us` (their summed device time), `copies` (memcpy and
    memset launches among them), `by_name` (the `top` most frequent launch names with counts),
    `by_time` (the `top` names by summed device time: [name, launches, us]: where a step's time
    goes, which the count alone does not say), `timeline` (span, busy and idle time of the step
    on the device, and its largest gaps: `timeline`)."""
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
        "timeline": timeline([(e.name, e.time_range.start, e.time_range.end) for e in events]),
    }
