"""Kernels on one workspace run one after another, whatever stream launches them.

A trtllm workspace keeps one Lamport buffer index and one barrier counter per rank: two fused
kernels on it at once (two CUDA streams, as two-batch overlap gives each microbatch) would read
the same index, write the same buffers and wait forever for data the other consumed. So when a
launch comes from another stream than the previous one, its stream first waits for everything
the previous stream had queued (an event recorded at that moment). Launches from one stream, the
common case, cost one stream lookup. A launch inside a CUDA-graph capture does not wait for work
queued outside that capture (the graph's replay is ordered by the stream it replays on).
"""

from __future__ import annotations

import torch

__all__ = ["LaunchOrder"]


class LaunchOrder:
    __slots__ = ("stream", "capturing", "event", "waits")

    def __init__(self):
        self.stream = None
        self.capturing = False
        self.event = None
        self.waits = 0  #: cross-stream waits inserted (for tests and reports)

    def __call__(self) -> None:
        current = torch.cuda.current_stream()
        last = self.stream
        if last is None or last == current:
            self.stream = current
            return
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing == self.capturing:
            event = self.event
            if event is None:
                event = self.event = torch.cuda.Event()
            event.record(last)
            current.wait_event(event)
            self.waits += 1
        self.stream, self.capturing = current, capturing

    def reset(self) -> None:
        self.stream, self.capturing, self.event = None, False, None
