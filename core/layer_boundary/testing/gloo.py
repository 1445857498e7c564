"""The gloo world of the tests: `ProcessWorld` with the gloo backend."""

from ..launch import ProcessWorld, RankError, RankTimeout, worker_parallel

GlooWorld = ProcessWorld
GlooRankError = RankError
GlooTimeout = RankTimeout

__all__ = ["GlooWorld", "GlooRankError", "GlooTimeout", "worker_parallel"]
