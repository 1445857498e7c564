"""The gloo world of the tests: `ProcessWorld` with the gloo backend."""

from ..launch import ProcessWorld, worker_parallel

GlooWorld = ProcessWorld

__all__ = ["GlooWorld", "worker_parallel"]
