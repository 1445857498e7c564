"""layer-boundary-cp: context-parallel adapters for layer-boundary.

An engine builds one `TokenMapping` per CP prefill batch on every rank and passes it as
`Forward(parallel, num_tokens, cp=mapping)`; the stages' CP paths (registered through the
`layer_boundary` entry point) move rows with it. Decode batches stay ordinary.
"""

from .mapping import ORDERS, TokenMapping, request_pieces

__version__ = "0.1.0"

__all__ = ["ORDERS", "TokenMapping", "request_pieces"]
