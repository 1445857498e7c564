"""The plugin's error messages, kept in one place so tests match them exactly."""

from __future__ import annotations


class Messages:
    SHARED_STREAM = (
        "TBO microbatches 0 and 1 share one residual stream; each microbatch needs its own "
        "(Forward.child() gives one), or the interleaved stages apply each other's pending work"
    )
    HELD_EXIT = (
        "microbatch {index} reached a TBO yield point with an exit() scope open; finish the stage's compute and "
        "leave its `with boundary.exit(...)` block before yielding, or compute without exit() and call "
        "boundary.postprocess()"
    )
    PARENT_STREAM = (
        "this batch's residual stream is split into two TBO microbatches; run each microbatch's stages on the "
        "Forward the overlap adapter gave it, never on the parent batch's Forward"
    )
    NESTED = "two-batch overlap runs outside any exit() scope; call it between stages, not inside a stage's compute"
    NOT_GENERATOR = (
        "stages must be a generator function: `yield` where the other microbatch may run, and `return` the "
        "microbatch's output (got {got})"
    )
    FORKED = (
        "the residual of this batch moved into a prepared branch at stage {label}; merge the branch back with "
        "merge_branch() before the next stage reads it"
    )
