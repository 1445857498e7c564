"""`mark_unloaded` / `mark_loaded` / `loads_weights` on any module: a forward refused with the
family's hint until the weights load, a copy keeping its own state, a meta module untouched."""

import copy

import pytest
import torch

from layer_boundary.plugin import UnloadedWeightsError, loads_weights, mark_loaded, mark_unloaded, weights_loaded


def test_a_marked_module_refuses_with_its_hint_until_loaded():
    layer = mark_unloaded(torch.nn.Linear(3, 2), "acme: load it with acme.load(layer)")
    with pytest.raises(UnloadedWeightsError, match=r"^acme: load it with acme.load\(layer\)$"):
        layer(torch.ones(1, 3))
    mark_unloaded(layer, "acme: again")  # marking twice keeps one refusal
    assert len(layer._forward_pre_hooks) == 1
    mark_loaded(layer)
    assert weights_loaded(layer) and not layer._forward_pre_hooks
    assert layer(torch.ones(1, 3)).shape == (1, 2)


def test_a_copy_keeps_its_own_state():
    layer = mark_unloaded(torch.nn.Linear(3, 2), "acme: load it")
    twin = copy.deepcopy(layer)
    mark_loaded(twin)
    twin(torch.ones(1, 3))
    with pytest.raises(UnloadedWeightsError):
        layer(torch.ones(1, 3))


def test_a_loader_wrapped_by_loads_weights_lifts_the_refusal_only_when_it_returns():
    @loads_weights
    def load(module, state):
        if state is None:
            raise ValueError("no weights")
        with torch.no_grad():  # written by hand: only the wrapper can lift the refusal
            module.weight.copy_(state["weight"])
            module.bias.copy_(state["bias"])

    layer = mark_unloaded(torch.nn.Linear(3, 2), "acme: load it")
    with pytest.raises(ValueError):
        load(layer, None)
    assert not weights_loaded(layer)
    load(layer, torch.nn.Linear(3, 2).state_dict())
    assert weights_loaded(layer)


def test_load_state_dict_lifts_the_refusal():
    layer = mark_unloaded(torch.nn.Linear(3, 2), "acme: load it")
    layer.load_state_dict(torch.nn.Linear(3, 2).state_dict())
    assert weights_loaded(layer)


def test_a_meta_module_is_not_marked():
    layer = mark_unloaded(torch.nn.Linear(3, 2, device="meta"), "acme: load it")
    assert weights_loaded(layer) and not layer._forward_pre_hooks
