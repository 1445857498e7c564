"""Hook implementations of the cp plugin (records only; the work is imported by the factories)."""

from layer_boundary.plugin import CpPathProvider, Priority, TokenMappingProvider, hookimpl


def _stage_path(request):
    from .stage import build_stage_path

    return build_stage_path(request)


def _token_mapping(request):
    from .mapping import TokenMapping

    return TokenMapping(request.parallel, request.lengths, order=request.order or "zigzag", device=request.device)


@hookimpl
def layer_boundary_cp_paths():
    yield CpPathProvider(
        name="cp.stage_paths",
        factory=_stage_path,
        priority=Priority.REFERENCE,
        description="context-parallel batch variant: residual on each CP rank's rows, input gathered over attention CP "
        "where compute needs full rows, FFN output returned to CP rows or reduce-scattered onto them",
    )


@hookimpl
def layer_boundary_token_mappings():
    yield TokenMappingProvider(
        name="cp.token_mapping",
        factory=_token_mapping,
        priority=Priority.REFERENCE,
        description="the token mapping of a CP prefill batch (zigzag or contiguous per request), for Forward(cp=...)",
    )
