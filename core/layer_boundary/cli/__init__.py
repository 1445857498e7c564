"""The `layer-boundary` command line."""
