"""layer-boundary-tbo: two-batch overlap and branch adapters for layer-boundary."""

__version__ = "0.1.0"
