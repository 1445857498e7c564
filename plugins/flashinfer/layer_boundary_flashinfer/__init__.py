"""layer-boundary-flashinfer: flashInfer fused all-reduce + residual add + RMSNorm for layer-boundary."""

__version__ = "0.1.0"
