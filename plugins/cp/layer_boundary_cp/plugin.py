"""Hook implementations of the cp plugin (records only; their code is named lazily)."""

from layer_boundary.plugin import CpPathProvider, Priority, TokenMappingProvider, hookimpl, lazy

STAGE_PATHS = ("context-parallel batch variant: residual on each CP rank's rows, input gathered over attention CP where compute "
               "needs full rows, FFN output returned to CP rows or reduce-scattered onto them")
TOKEN_MAPPING = "the token mapping of a CP prefill batch (zigzag or contiguous per request), for Forward(cp=...)"


@hookimpl
def layer_boundary_cp_paths():
    yield CpPathProvider(name="cp.stage_paths", factory=lazy("layer_boundary_cp.stage:build_stage_path"), priority=Priority.REFERENCE,
                         description=STAGE_PATHS)


@hookimpl
def layer_boundary_token_mappings():
    yield TokenMappingProvider(name="cp.token_mapping", factory=lazy("layer_boundary_cp.mapping:token_mapping"),
                               priority=Priority.REFERENCE, description=TOKEN_MAPPING)
