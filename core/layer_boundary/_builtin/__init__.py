"""The core's own defaults, registered through the same hooks as every plugin."""
