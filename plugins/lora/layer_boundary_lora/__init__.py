"""layer-boundary-lora: loRA row publication and deferrable LoRA sums for layer-boundary."""

__version__ = "0.1.0"
