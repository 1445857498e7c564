"""layer-boundary-example: the worked example of docs/plugins.md.

Importing this package does nothing; layer-boundary loads `layer_boundary_example.plugin`
through the entry point `example` in group `layer_boundary`.
"""

__version__ = "0.2.0"
