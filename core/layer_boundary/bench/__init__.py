"""Benchmarks behind `layer-boundary bench`: each measures against a baseline in the same run,
prints a table and writes JSON (and a PNG when matplotlib is installed) under an output folder."""
