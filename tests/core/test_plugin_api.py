"""The public plugin API: how the manager treats a broken plugin, inline registration, the
life-cycle hooks, the fusion-provider contract as documented, and the removed legacy hook."""

import warnings

import pytest
import torch

import layer_boundary
from layer_boundary import (
    BatchVariant,
    RMSNorm,
    Topology,
    declare_attn,
    declare_ffn,
    hookimpl,
    make_stages,
    prepare_model,
    release_model,
    residual_batch,
)
from layer_boundary import plugin as api
from layer_boundary.plugin import (
    FusionProvider,
    PluginError,
    PluginLoadError,
    defers_to_next_input,
    env_flag,
    get_registry,
    register_inline,
    reset_registry,
    unregister_inline,
)
from layer_boundary.testing.threaded import run_threaded

from fake_dists import make_dist

def test_the_api_exports_what_it_lists():
    for module in (layer_boundary, api):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, (module.__name__, missing)


# --- the manager: a misspelled hook, a broken implementation ---------------------------------------


MISSPELLED = '''
from layer_boundary.plugin import FusionProvider, hookimpl

@hookimpl
def layer_boundary_fusion_provider():   # one letter short of layer_boundary_fusion_providers
    yield FusionProvider(name="typo.fused", factory=lambda stage: None, description="never seen")
'''


def test_a_misspelled_hook_is_reported_naming_the_plugin_and_the_hook(tmp_path, monkeypatch, fresh_registry):
    make_dist(tmp_path, "acme-typo", "acme_typo_plugin", MISSPELLED, entry="typo")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("LAYER_BOUNDARY_STRICT_PLUGINS", raising=False)
    reset_registry()
    report = get_registry().plugin("typo")
    assert report.status.startswith("failed: unknown hook 'layer_boundary_fusion_provider'")
    assert "did you mean 'layer_boundary_fusion_providers'?" in report.status
    assert report.distribution == "acme-typo"
    assert "typo.fused" not in [r.name for r in get_registry().fusion_providers]
    assert get_registry().fusion_providers[-1].name == "core.unfused"  # the rest keeps working


def test_a_misspelled_hook_fails_in_strict_mode(tmp_path, monkeypatch, fresh_registry):
    make_dist(tmp_path, "acme-typo", "acme_typo_plugin", MISSPELLED, entry="typo")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LAYER_BOUNDARY_STRICT_PLUGINS", "1")
    reset_registry()
    with pytest.raises(PluginLoadError, match=r"plugin 'typo' \(distribution acme-typo\) failed to load: unknown hook "
                       r"'layer_boundary_fusion_provider'.*LAYER_BOUNDARY_DISABLE_PLUGINS=typo"):
        get_registry()


def test_an_inline_plugin_with_a_misspelled_hook_fails_in_strict_mode(monkeypatch, fresh_registry):
    class Typo:
        @hookimpl
        def layer_boundary_prepare_modle(self, request):
            pass

    monkeypatch.setenv("LAYER_BOUNDARY_STRICT_PLUGINS", "1")
    get_registry()  # a manager exists: the registration is checked at once
    with pytest.raises(PluginLoadError, match="unknown hook 'layer_boundary_prepare_modle' .did you mean 'layer_boundary_prepare_model'"):
        register_inline(Typo(), name="typo")
    assert get_registry().plugin("typo") is None


def test_an_implementation_that_breaks_its_spec_is_an_error_not_a_skip(monkeypatch, fresh_registry):
    class Broken:
        @hookimpl
        def layer_boundary_fusion_providers(self, stage):  # the hook takes no argument
            yield from ()

    monkeypatch.delenv("LAYER_BOUNDARY_STRICT_PLUGINS", raising=False)
    get_registry()
    with pytest.raises(PluginError, match="plugin 'broken' .* does not match the hooks' rules"):
        register_inline(Broken(), name="broken")


# --- inline registration ---------------------------------------------------------------------------


class _Provider:
    def __init__(self, name):
        self.name = name

    @hookimpl
    def layer_boundary_fusion_providers(self):
        yield FusionProvider(name=self.name, factory=lambda stage: None, description="test")


def test_inline_plugins_survive_a_reset_until_unregistered(fresh_registry):
    register_inline(_Provider("inline.kept"), name="inline", distribution="test:inline")
    try:
        reset_registry()
        registry = get_registry()
        assert "inline.kept" in [r.name for r in registry.fusion_providers]
        report = registry.plugin("inline")
        assert report.ok and report.inline and report.distribution == "test:inline"
        with pytest.raises(PluginError, match="already registered"):
            register_inline(_Provider("inline.other"), name="inline")
    finally:
        unregister_inline("inline")
    assert "inline.kept" not in [r.name for r in get_registry().fusion_providers]
    assert get_registry().plugin("inline") is None


def test_an_inline_plugin_is_switched_off_like_an_installed_one(monkeypatch, fresh_registry):
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "inline")
    register_inline(_Provider("inline.off"), name="inline")
    try:
        reset_registry()
        assert get_registry().plugin("inline").status == "disabled"
        assert "inline.off" not in [r.name for r in get_registry().fusion_providers]
    finally:
        unregister_inline("inline")


# --- the life-cycle hooks ----------------------------------------------------------------------------


def test_prepare_and_release_run_every_plugin_in_name_order(inline_plugin, fresh_registry):
    calls = []

    class Lifecycle:
        def __init__(self, tag):
            self.tag = tag

        @hookimpl
        def layer_boundary_prepare_model(self, request):
            calls.append((self.tag, "prepare", request.max_tokens))

        @hookimpl
        def layer_boundary_release_model(self):  # an implementation may take fewer arguments
            calls.append((self.tag, "release"))

    inline_plugin(Lifecycle("b"), name="zz-b")
    inline_plugin(Lifecycle("a"), name="zz-a")
    model = torch.nn.Module()
    ran = prepare_model(model, max_tokens=7)
    assert [n for n in ran if n.startswith("zz-")] == ["zz-a", "zz-b"]
    assert [n for n in release_model(model) if n.startswith("zz-")] == ["zz-b", "zz-a"]
    assert calls == [("a", "prepare", 7), ("b", "prepare", 7), ("b", "release"), ("a", "release")]


# --- compatibility ---------------------------------------------------------------------------------------


LEGACY_PROVIDER = '''
"""A fusion provider written against the contract documented before the typed extension points."""
import functools

from layer_boundary import FusedMlpInput
from layer_boundary.plugin import FusionProvider, Priority, hookimpl

CALLS = []


class Provider:
    def attention_input(self, plan):
        # the documented facts of `plan`: its norm, its parallel and its description
        assert plan.parallel.topology.tp >= 1 and plan.description.incoming_sum is not None
        return (FusedMlpInput(run=functools.partial(self.run, plan.norm), name="legacy.fused", preserves_residual=True),)

    ffn_input = attention_input

    def run(self, norm, owed, residual, forward):
        CALLS.append(owed.partial.shape[0])
        return norm.add_forward(owed.group.all_reduce(owed.partial), residual)


def build(stage):
    if stage.incoming_sum is None or not (stage.plain_update and stage.plain_read):
        return None
    return Provider()


@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(name="legacy.fused", factory=build, priority=Priority.REFERENCE, description="legacy contract")
'''


def _legacy_run(parallel):
    norm = lambda: RMSNorm(8, dtype=torch.float64)  # noqa: E731
    attn, ffn = make_stages((declare_attn(), norm()), (declare_ffn(), norm()), terminal=True, parallel=parallel)
    from layer_boundary import Forward

    fwd = Forward(parallel, 3)
    residual_batch.start(fwd)
    h = attn.prepare(torch.ones(3, 8, dtype=torch.float64), fwd)
    h = attn.finish(h * 0.5, fwd)
    h = ffn.prepare(h, fwd)
    return [c.name for c in ffn.plan.paths[BatchVariant.ORDINARY].entry.candidates]


def test_a_fusion_provider_of_the_old_contract_works_unchanged(tmp_path, monkeypatch, fresh_registry):
    make_dist(tmp_path, "acme-legacy", "acme_legacy_plugin", LEGACY_PROVIDER, entry="legacy")
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_registry()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # nothing in it is deprecated
        names = run_threaded(_legacy_run, Topology(tp=2))[0]
    import acme_legacy_plugin

    assert names[0] == "legacy.fused" and acme_legacy_plugin.CALLS == [3, 3]  # both ranks' FFN input


LEGACY_ADAPTERS = '''
from layer_boundary.plugin import hookimpl

@hookimpl
def layer_boundary_adapters():   # the catch-all hook of 0.1, removed in 0.2
    yield from ()
'''


def test_the_removed_adapters_hook_is_an_unknown_hook(tmp_path, monkeypatch, fresh_registry):
    make_dist(tmp_path, "acme-old", "acme_old_plugin", LEGACY_ADAPTERS, entry="old")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LAYER_BOUNDARY_STRICT_PLUGINS", "1")
    reset_registry()
    with pytest.raises(PluginLoadError, match="plugin 'old' .* unknown hook 'layer_boundary_adapters'"):
        get_registry()
    assert not hasattr(layer_boundary, "Adapter") and not hasattr(api, "Adapter") and not hasattr(layer_boundary, "ModelSetup")


# --- one rule, one parser ----------------------------------------------------------------------------------


def test_deferral_happens_only_on_ordinary_rows_without_dp_or_cp():
    assert defers_to_next_input(Topology(tp=4), BatchVariant.ORDINARY)
    assert not defers_to_next_input(Topology(tp=4), BatchVariant.SEQUENCE_PARALLEL)
    assert not defers_to_next_input(Topology(tp=4, attn_dp=2), BatchVariant.ORDINARY)
    assert not defers_to_next_input(Topology(tp=4, attn_cp=2), BatchVariant.ORDINARY)


@pytest.mark.parametrize("raw, expected", [(None, False), ("", False), ("1", True), ("On", True), ("no", False), ("0", False)])
def test_env_flags_are_parsed_one_way(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("LAYER_BOUNDARY_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("LAYER_BOUNDARY_TEST_FLAG", raw)
    assert env_flag("LAYER_BOUNDARY_TEST_FLAG") is expected


def test_a_mistyped_flag_is_an_error(monkeypatch):
    monkeypatch.setenv("LAYER_BOUNDARY_TEST_FLAG", "ture")
    with pytest.raises(ValueError, match="LAYER_BOUNDARY_TEST_FLAG='ture' is not a switch"):
        env_flag("LAYER_BOUNDARY_TEST_FLAG")
