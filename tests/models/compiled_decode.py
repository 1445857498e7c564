"""The check every kernel record's compile test makes: a prepared model's decode steps traced
whole by `torch.compile(fullgraph=True)` equal its eager steps, with no graph break."""

import torch

from layer_boundary import Forward, ForwardMode, Parallel, prepare_model
from layer_boundary.compiling import graph_breaks, reset_graph_breaks
from layer_boundary.plugin import DecodeLayout
from layer_boundary.cli.static_decode import static_decode_step, static_prefill
from layer_boundary.cli.runner import make_requests


def reset_compiler() -> None:
    """Call before registering the record under test: no graph or break count from earlier tests."""
    torch._dynamo.reset()
    reset_graph_breaks()


def compiled_decode_graph(model, config) -> torch.fx.GraphModule:
    """Prepare `model` (TP=1, CPU), prefill two prompts, then run two decode steps both eagerly
    and compiled fullgraph, asserting equal logits, zero graph breaks and a single graph; returns
    that graph, for the caller to look for its kernel's nodes."""
    prepare_model(model, max_tokens=16)
    parallel = Parallel.single()
    prompts, decode = make_requests(config.vocab_size, 2, 5, 2, seed=4)
    cache = model.new_static_cache(len(prompts), 16)
    static_prefill(model, parallel, cache, prompts, "cpu")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    run = torch.compile(model, backend=backend, fullgraph=True)
    base = torch.tensor([len(p) for p in prompts])
    for s, tokens in enumerate(decode):
        ids = torch.tensor(tokens)
        snap = cache.snapshot()
        eager = static_decode_step(model, parallel, cache, ids, None, base + s).clone()
        cache.restore(snap)
        compiled = run(ids, Forward(parallel, len(tokens), mode=ForwardMode.DECODE), DecodeLayout(None, base + s), cache)
        assert torch.equal(compiled, eager)
    assert graph_breaks() == 0 and len(graphs) == 1
    return graphs[0]


def call_nodes(graph: torch.fx.GraphModule, matches) -> list:
    """The graph's call_function nodes whose target `matches`."""
    return [n for n in graph.graph.nodes if n.op == "call_function" and matches(n.target)]
