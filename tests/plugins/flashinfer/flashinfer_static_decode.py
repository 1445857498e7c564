"""A bf16 qwen3 on one GPU, run through the reference models' static-cache path: what the
flashinfer plugin's model-wide kernels (rope, decode attention, gated activation) are tested in
(`test_flashinfer_decode_kernels_gpu.py`, `test_flashinfer_gated_activation_gpu.py`)."""

import torch

from layer_boundary import Parallel


def rel(got, want) -> float:
    """max |got - want| / max |want|."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def qwen3(layers=2, **hf):
    """(config, model): qwen3's embedded config with `layers` layers and the `hf` overrides, random
    weights, bf16 on the GPU, one rank."""
    from layer_boundary_models import build_model, family, model_config
    from layer_boundary.plugin import StateDictSource

    config = model_config("qwen3", dict(model_config("qwen3").hf, num_hidden_layers=layers, **hf))
    state = family("qwen3").random_weights(config, torch.float32, seed=7)
    model = build_model(config, Parallel.single(), dtype=torch.bfloat16, device="cuda")
    family("qwen3").load_weights(model, StateDictSource(state))
    return config, model.eval()


class StaticDecode:
    """Requests for `model` (`batch` prompts of about 6 tokens, `steps` decode steps): their logits through
    prefill and decode, and a captured decode step checked against eager."""

    def __init__(self, config, model, batch=4, steps=3, seed=3):
        from layer_boundary.cli.runner import make_requests

        self.model, self.parallel = model, Parallel.single()
        self.prompts, self.decode = make_requests(config.vocab_size, batch, 6, steps, seed=seed)
        self.base = torch.tensor([len(p) for p in self.prompts], device="cuda")
        self.ids = torch.tensor(self.decode[0], device="cuda")

    def new_cache(self):
        return self.model.new_static_cache(len(self.prompts), 32)

    def step(self, cache, ids, positions):
        from layer_boundary.cli.static_decode import static_decode_step

        return static_decode_step(self.model, self.parallel, cache, ids, None, positions)

    def prefill(self, cache):
        from layer_boundary.cli.static_decode import static_prefill

        return static_prefill(self.model, self.parallel, cache, self.prompts, "cuda")

    def logits(self, cache):
        """Prefill's logits, then each decode step's, in float32."""
        out = [self.prefill(cache).float()]
        for s, tokens in enumerate(self.decode):
            out.append(self.step(cache, torch.tensor(tokens, device="cuda"), self.base + s).float())
        return out

    def assert_replay_equals_eager(self, cache):
        """A decode step captured once (`CapturedStep`) replays, from each step's cache, what eager computes."""
        from layer_boundary._cuda_graphs import CapturedStep

        graph = CapturedStep(lambda i, p: self.step(cache, i, p), (self.ids.clone(), self.base.clone()))
        for s, tokens in enumerate(self.decode):
            tokens = torch.tensor(tokens, device="cuda")
            snap = cache.snapshot()
            eager = self.step(cache, tokens, self.base + s).clone()
            cache.restore(snap)
            replayed = graph.replay(tokens, self.base + s).clone()
            assert torch.equal(eager, replayed), f"step {s}: max diff {(eager - replayed).abs().max().item()}"
