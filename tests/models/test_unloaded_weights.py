"""A reference model built without weights refuses a forward, in one line naming how to load
them, until they load (`load_weights`, the family's loader, `load_state_dict`); loaded, it runs
with no hook left; on the meta device nothing is marked. `from_pretrained` builds and loads a
save_pretrained() folder."""

import attrs
import pytest
import torch

from layer_boundary import Forward, ForwardMode, Parallel
from layer_boundary.cli.families import check_requirements, find_family
from layer_boundary.cli.usage import UsageError
from layer_boundary.plugin import StateDictSource, StepLayout, UnloadedWeightsError, get_registry, mark_loaded, weights_loaded
from layer_boundary_models import build_model, family, from_pretrained, load_weights, model_config, random_weights

FAMILIES = sorted(f.record.model for f in get_registry().model_families if f.plugin == "models")


def _buildable(name):
    try:
        check_requirements(find_family(name))
    except UsageError as exc:
        pytest.skip(str(exc))
    return model_config(name)


def _prefill(model, tokens=5):
    ids = torch.arange(tokens) % model.config.vocab_size
    with torch.inference_mode():
        return model(ids, Forward(Parallel.single(), tokens, mode=ForwardMode.EXTEND), StepLayout([0], [tokens], [0]), model.new_cache())


@pytest.mark.parametrize("name", FAMILIES)
def test_a_model_without_weights_refuses_a_forward_until_they_load(name):
    config = _buildable(name)
    model = build_model(config, Parallel.single(), dtype=torch.float32)
    assert not weights_loaded(model)
    with pytest.raises(UnloadedWeightsError) as info:
        _prefill(model)
    message = str(info.value)
    assert f"this {name} model was built without weights" in message and "load_weights(model, " in message and "\n" not in message
    load_weights(model, random_weights(config, seed=1))
    assert weights_loaded(model) and not model._forward_pre_hooks  # the refusal is gone, not skipped on every call
    logits = _prefill(model)
    assert logits.shape[-1] == config.vocab_size and torch.isfinite(logits).all()


@pytest.mark.parametrize("load", ["family", "state_dict", "mark_loaded"])
def test_every_way_of_loading_lifts_the_refusal(load):
    config = model_config("qwen3")
    model = build_model(config, Parallel.single())
    state = random_weights(config, seed=2)
    if load == "family":  # the record's loader, as the runner calls it
        family("qwen3").load_weights(model, StateDictSource(state))
    elif load == "state_dict":  # torch's own: the model's parameters by module name
        reference = build_model(config, Parallel.single())
        load_weights(reference, state)
        model.load_state_dict(reference.state_dict())
    else:  # code that writes every parameter itself
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.01)
        mark_loaded(model)
    assert weights_loaded(model) and torch.isfinite(_prefill(model)).all()


def test_a_meta_model_is_not_marked():
    model = build_model(model_config("qwen3"), Parallel.single(), device="meta")
    assert weights_loaded(model) and not model._forward_pre_hooks


def test_load_weights_refuses_what_is_not_weights():
    model = build_model(model_config("qwen3"), Parallel.single())
    with pytest.raises(TypeError, match="expected a state dict, a TensorSource or a folder, got int"):
        load_weights(model, 3)
    assert not weights_loaded(model)


def test_from_pretrained_builds_and_loads_a_save_pretrained_folder(tmp_path):
    pytest.importorskip("transformers")
    from layer_boundary.cli.oracle import hf_from_state

    config = model_config("qwen3")
    state = random_weights(config, seed=4)
    hf_from_state(dict(config.hf), state, torch.float32).save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, Parallel.single(), dtype=torch.float32)
    assert weights_loaded(loaded) and attrs.evolve(loaded.config, hf={}) == attrs.evolve(config, hf={})
    expected = build_model(config, Parallel.single(), dtype=torch.float32)
    load_weights(expected, state)
    assert torch.equal(_prefill(loaded), _prefill(expected))
