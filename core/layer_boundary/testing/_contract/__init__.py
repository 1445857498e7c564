"""The provider contract suite's parts; the public entry points are in
`layer_boundary.testing.contract`."""
