"""layer-boundary-lora: LoRA row publication and deferrable LoRA sums for layer-boundary.

A stage built with the option `publish_rows=("lora",)` publishes, after each `prepare()`, which
adapter every row of its compute input uses (`LoraRows`, read through
`layer_boundary.get_compute_rows().published["lora"]`), in the compute's own row order. The
engine gives the adapter of each of this rank's rows as `Forward.extras["lora_ids"]`.
"""

from .rows import IDS_KEY, LoraRows, lora_rows

__version__ = "0.1.0"

__all__ = ["IDS_KEY", "LoraRows", "lora_rows"]
