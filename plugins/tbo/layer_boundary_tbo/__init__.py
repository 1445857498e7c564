"""layer-boundary-tbo: two-batch overlap and branch adapters for layer-boundary.

Model code never imports this package: it calls `layer_boundary.two_batch_overlap(forward)`,
`branch_input`, `branch_output` and `merge_branch`, which find these adapters in the registry.
"""

__version__ = "0.1.0"
