"""Model setup from plugins: prepare_model / release_model run every "setup" adapter, in order."""

from layer_boundary import Adapter, Parallel, hookimpl, prepare_model, release_model
from layer_boundary.models.runner import RunJob, make_requests, run_rank
from layer_boundary.models import model_config


def test_runner_prepares_and_releases_plugins(inline_plugin, fresh_registry):
    calls = []

    class Setup:
        @hookimpl
        def layer_boundary_adapters(self):
            yield Adapter(name="test.setup_a", kind="setup", factory=lambda req: calls.append(("a", req.phase, req.max_tokens)))
            yield Adapter(name="test.setup_b", kind="setup", factory=lambda req: calls.append(("b", req.phase, req.max_tokens)), priority=5)

    inline_plugin(Setup(), name="test-setup")
    import torch

    empty = torch.nn.Module()
    mine = lambda names: [n for n in names if n.startswith("test.")]  # noqa: E731
    assert mine(prepare_model(empty, max_tokens=7)) == ["test.setup_b", "test.setup_a"]  # priority, then name
    assert mine(release_model(empty)) == ["test.setup_a", "test.setup_b"]  # reverse order
    calls.clear()
    config = model_config("qwen3")
    prompts, decode = make_requests(config.vocab_size, 2, 4, 1, seed=0)
    run_rank(Parallel.single(), _job(prompts, decode, config))
    mine = [c for c in calls if c[0] in "ab"]
    assert mine == [("b", "prepare", 7), ("a", "prepare", 7), ("a", "release", 0), ("b", "release", 0)]  # prompts of 3 + 4 tokens


def _job(prompts, decode, config):
    import tempfile

    import torch

    from layer_boundary.models import family

    path = tempfile.mktemp(suffix=".pt")
    torch.save(family("qwen3").random_weights(config, torch.float32, 0), path)
    return RunJob(model="qwen3", hf_config=dict(config.hf), topology=Parallel.single().topology, reduction="ar",
                  dtype="float32", prompts=prompts, decode_tokens=decode, weights=path)
