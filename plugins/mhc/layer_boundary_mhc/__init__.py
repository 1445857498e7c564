"""layer-boundary-mhc: manifold-constrained hyper-connections as a layer-boundary residual kind.

Model code asks for it by name, never by import:
`ops = layer_boundary.residual_kind("mhc", streams=4, attn=..., ffn=..., head=...)`.
"""

__version__ = "0.1.0"
