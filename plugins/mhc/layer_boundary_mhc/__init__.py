"""layer-boundary-mhc: manifold-constrained hyper-connections as a layer-boundary residual kind."""

__version__ = "0.1.0"
