"""Model setup from plugins: the runner's prepare_model / release_model run every plugin's
life-cycle hooks, in plugin-name order (release in reverse)."""

from layer_boundary import Parallel, hookimpl, prepare_model, release_model
from layer_boundary.cli.runner import RunJob, make_requests, run_rank
from layer_boundary_models import model_config


def test_runner_prepares_and_releases_plugins(inline_plugin, fresh_registry):
    calls = []

    class Setup:
        def __init__(self, tag):
            self.tag = tag

        @hookimpl
        def layer_boundary_prepare_model(self, request):
            calls.append((self.tag, "prepare", request.max_tokens))

        @hookimpl
        def layer_boundary_release_model(self, request):
            calls.append((self.tag, "release", 0))

    inline_plugin(Setup("b"), name="test-setup-b")
    inline_plugin(Setup("a"), name="test-setup-a")
    import torch

    empty = torch.nn.Module()
    mine = lambda names: [n for n in names if n.startswith("test-")]  # noqa: E731
    assert mine(prepare_model(empty, max_tokens=7)) == ["test-setup-a", "test-setup-b"]  # plugin-name order
    assert mine(release_model(empty)) == ["test-setup-b", "test-setup-a"]  # reverse order
    calls.clear()
    config = model_config("qwen3")
    prompts, decode = make_requests(config.vocab_size, 2, 4, 1, seed=0)
    run_rank(Parallel.single(), _job(prompts, decode, config))
    mine = [c for c in calls if c[0] in "ab"]
    assert mine == [("a", "prepare", 7), ("b", "prepare", 7), ("b", "release", 0), ("a", "release", 0)]  # prompts of 3 + 4 tokens


def _job(prompts, decode, config):
    import tempfile

    import torch

    from layer_boundary_models import family

    path = tempfile.mktemp(suffix=".pt")
    torch.save(family("qwen3").random_weights(config, torch.float32, 0), path)
    return RunJob(model="qwen3", hf_config=dict(config.hf), topology=Parallel.single().topology, reduction="ar",
                  dtype="float32", prompts=prompts, decode_tokens=decode, weights=path)
