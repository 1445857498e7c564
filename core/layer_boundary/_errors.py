"""Error types and the messages the guide names, kept in one place so tests can match them."""

from __future__ import annotations

__all__ = ["MissingPluginError", "FusionError", "missing_feature", "FEATURE_DISTRIBUTIONS", "Messages"]

#: Which distribution provides a feature the core only names.
FEATURE_DISTRIBUTIONS = {
    "mhc": "layer-boundary-mhc",
    "ihc": "layer-boundary-mhc",
    "cp": "layer-boundary-cp",
    "tbo": "layer-boundary-tbo",
    "branch": "layer-boundary-tbo",
    "lora": "layer-boundary-lora",
    "flashinfer": "layer-boundary-flashinfer",
    "cutedsl": "layer-boundary-cutedsl",
    "models": "layer-boundary-models",
}


class MissingPluginError(RuntimeError):
    """A feature needs a plugin distribution that is not installed (or is disabled)."""

    def __init__(self, message: str, distribution: str | None):
        super().__init__(message)
        self.distribution = distribution


class FusionError(RuntimeError):
    """A fusion candidate or provider broke its contract or raised."""


def missing_feature(what: str, key: str) -> MissingPluginError:
    dist = FEATURE_DISTRIBUTIONS.get(key)
    if dist is None:
        return MissingPluginError(f"no installed plugin provides {what}", None)
    return MissingPluginError(
        f"{what} needs the {dist} distribution, which is not installed or is disabled: pip install {dist}", dist
    )


class Messages:
    """The guide's error table, verbatim."""

    NOT_STARTED = "start the layer stack before entering a stage"
    FOREIGN_OUTPUT = (
        "output does not belong to this residual stream; change layer outputs through boundary accessors"
    )
    PENDING_AT_TAKE = "write the residual update before taking the final output"
    NO_VARIANT = "no stage boundary path for the active {variant} batch"
    BRANCH_PREPARE = "a prepared branch must enter through branch_input, not prepare"
    PARTIAL_FFN = "PARTIAL is not supported for ffn stages"
    LOCAL_TAIL_ATTN = "LOCAL_TAIL is not supported for attention stages"
    SNAPSHOT_PLAIN = "snapshot requires a plain residual update"
    FINAL_READ = (
        "the residual is a tuple of row tensors (a multi-stream residual kind such as mhc); leave the stack with "
        "residual_batch.norm(..., final_read=ops.final_read), the kind's stack-exit read"
    )
