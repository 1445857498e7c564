"""Where each microbatch's work is issued: one CUDA stream per microbatch, or in turn on the CPU.

On a GPU, kernel launches return at once, so issuing microbatch 0's operation and then
microbatch 1's on two streams lets the device run one microbatch's communication (an NCCL
collective) while the other computes. Three rules keep that correct:

- both streams first wait for the work that produced the split inputs (`begin`), and the
  caller's stream waits for both before it reads their outputs (`end`); the split inputs stay
  referenced by the caller until then, so the caching allocator never hands their memory to
  another stream early;
- with `ordered=True`, microbatch 1's operation i starts after microbatch 0's operation i, so
  state the two share (a KV cache of a request cut between them) is written in the same order
  as on the CPU; microbatch 0's operation i + 1 still overlaps microbatch 1's operation i;
- everything a microbatch allocates is used on its own stream only.

On the CPU the operations simply run in turn (interleaved, serial).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["SerialSchedule", "StreamSchedule", "schedule_for"]


class SerialSchedule:
    """Interleaved on the calling thread's device queue (the CPU, or one CUDA stream)."""

    streams: tuple = ()

    def begin(self) -> None:
        pass

    @contextlib.contextmanager
    def step(self, index: int, operation: int) -> Iterator[None]:
        yield

    def end(self) -> None:
        pass


class StreamSchedule:
    """Each microbatch on its own CUDA stream (see the module docstring for the rules)."""

    def __init__(self, device: torch.device, streams: tuple, *, ordered: bool = True):
        self.device = device
        self.main = torch.cuda.current_stream(device)
        self.streams = streams
        self.ordered = ordered
        self._done: dict[int, torch.cuda.Event] = {}

    def begin(self) -> None:
        for stream in self.streams:
            stream.wait_stream(self.main)

    @contextlib.contextmanager
    def step(self, index: int, operation: int) -> Iterator[None]:
        stream = self.streams[index]
        if self.ordered and index == 1:
            done = self._done.pop(operation, None)
            if done is not None:
                stream.wait_event(done)
        with torch.cuda.stream(stream):
            yield
        if self.ordered and index == 0:
            event = torch.cuda.Event()
            event.record(stream)
            self._done[operation] = event

    def end(self) -> None:
        for stream in self.streams:
            self.main.wait_stream(stream)
        self._done.clear()


_STREAMS: dict = {}


def _streams_of(device: torch.device) -> tuple:
    """Two side streams per device, made once per process (streams are cheap but not free)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _STREAMS:
        _STREAMS[key] = tuple(torch.cuda.Stream(device=key) for _ in range(2))
    return _STREAMS[key]


def schedule_for(sample, *, streams: bool, ordered: bool = True):
    """The schedule for microbatches whose rows live where `sample` (a tensor, or a tuple of
    tensors) lives: CUDA streams when asked for and on a GPU, else in turn."""
    tensor = sample[0] if isinstance(sample, tuple) else sample
    if streams and isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        return StreamSchedule(tensor.device, _streams_of(tensor.device), ordered=ordered)
    return SerialSchedule()
