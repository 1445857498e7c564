"""Hook implementations of the cp plugin (records only; the work is imported by the factories)."""

from layer_boundary.plugin import Adapter, Priority, hookimpl


def _stage_path(plan):
    from .stage import build_stage_path

    return build_stage_path(plan)


def _token_mapping(request):
    """`request`: {"parallel", "lengths", "order" (optional), "device" (optional)}."""
    from .mapping import TokenMapping

    return TokenMapping(
        request["parallel"], request["lengths"], order=request.get("order") or "zigzag", device=request.get("device")
    )


@hookimpl
def layer_boundary_adapters():
    yield Adapter(
        name="cp.stage_paths",
        kind="cp",
        factory=_stage_path,
        priority=Priority.REFERENCE,
        description="context-parallel batch variant: residual on each CP rank's rows, input gathered over attention CP "
        "where compute needs full rows, FFN output returned to CP rows or reduce-scattered onto them",
    )
    yield Adapter(
        name="cp.token_mapping",
        kind="cp_batch",
        factory=_token_mapping,
        priority=Priority.REFERENCE,
        description="the token mapping of a CP prefill batch (zigzag or contiguous per request), for Forward(cp=...)",
    )
