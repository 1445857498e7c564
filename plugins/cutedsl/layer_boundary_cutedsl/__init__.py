"""layer-boundary-cutedsl: cuTe DSL fused MoE finalize + all-reduce + residual add + RMSNorm kernels for layer-boundary."""

__version__ = "0.1.0"
