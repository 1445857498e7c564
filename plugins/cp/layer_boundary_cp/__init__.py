"""layer-boundary-cp: context-parallel adapters for layer-boundary."""

__version__ = "0.1.0"
