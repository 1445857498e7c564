"""A Llama model family on layer-boundary, as a third party writes one: the model, its config,
weight loading and a `ModelFamily` record, importing only `layer_boundary` and
`layer_boundary.plugin`."""
