import json
import subprocess
import sys

import pytest

from layer_boundary.plugin import (
    CpPathProvider,
    FusionProvider,
    PluginError,
    PluginLoadError,
    Priority,
    get_registry,
    hookimpl,
    reset_registry,
)

from layer_boundary.testing import expected_plugins

from fake_dists import PROVIDER_SOURCE, make_dist


class Providers:
    def __init__(self, *records):
        self.records = records

    @hookimpl
    def layer_boundary_fusion_providers(self):
        return self.records


def _provider(name, priority=0):
    return FusionProvider(name=name, factory=lambda stage: None, priority=priority)


def test_builtin_plugin_registers_through_the_hooks(fresh_registry):
    reg = get_registry()
    core = reg.plugin("core")
    assert core is not None and core.builtin and core.ok
    assert reg.fusion_providers[-1].name == "core.unfused"
    assert any(r.name == "core.plain" for r in reg.residual_kinds)


def test_order_is_priority_then_name_never_registration_order(fresh_registry, inline_plugin):
    inline_plugin(Providers(_provider("zeta.b", 100), _provider("alpha.a", 5)), name="first")
    inline_plugin(Providers(_provider("beta.c", 100), _provider("gamma.d", Priority.VENDOR)), name="second")
    mine = {"gamma.d", "beta.c", "zeta.b", "alpha.a"}
    names = [r.name for r in get_registry().fusion_providers]
    assert [n for n in names if n in mine] == ["gamma.d", "beta.c", "zeta.b", "alpha.a"]
    assert names[-1] == "core.unfused"


def test_duplicate_record_names_are_rejected_naming_both(fresh_registry, inline_plugin):
    inline_plugin(Providers(_provider("dup.same")), name="one")
    inline_plugin(Providers(_provider("dup.same")), name="two")
    with pytest.raises(PluginError, match=r"dup\.same.*'one'.*'two'|dup\.same.*'two'.*'one'"):
        get_registry()


def test_duplicate_across_distributions_names_both_distributions(tmp_path, monkeypatch, fresh_registry):
    make_dist(tmp_path, "acme-one", "acme_one_plugin", PROVIDER_SOURCE.format(name="acme.fused", priority=1))
    make_dist(tmp_path, "acme-two", "acme_two_plugin", PROVIDER_SOURCE.format(name="acme.fused", priority=2))
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_registry()
    with pytest.raises(PluginError) as info:
        get_registry()
    assert "acme-one" in str(info.value) and "acme-two" in str(info.value)


def test_record_names_must_be_prefixed_and_dotted():
    with pytest.raises(ValueError, match="dotted lowercase"):
        FusionProvider(name="nodot", factory=lambda s: None)
    with pytest.raises(TypeError, match="callable"):
        CpPathProvider(name="x.y", factory=None)


def test_wrong_record_type_is_an_error(fresh_registry, inline_plugin):
    class Bad:
        @hookimpl
        def layer_boundary_cp_paths(self):
            yield _provider("bad.provider")

    inline_plugin(Bad(), name="bad")
    with pytest.raises(PluginError, match="yielded FusionProvider from layer_boundary_cp_paths; expected CpPathProvider"):
        get_registry()


def test_a_raising_hook_names_the_plugin(fresh_registry, inline_plugin):
    class Raising:
        @hookimpl
        def layer_boundary_fusion_providers(self):
            raise ValueError("boom")

    inline_plugin(Raising(), name="raising")
    with pytest.raises(PluginError, match="'raising'.*boom"):
        get_registry()


BROKEN = "raise ImportError('libacme.so: cannot open shared object file')\n"


def test_broken_plugin_is_reported_and_skipped(tmp_path, monkeypatch, fresh_registry):
    make_dist(tmp_path, "acme-broken", "acme_broken_plugin", BROKEN, entry="acme_broken")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("LAYER_BOUNDARY_STRICT_PLUGINS", raising=False)
    reset_registry()
    reg = get_registry()
    report = reg.plugin("acme_broken")
    assert report.status.startswith("failed: ImportError: libacme.so")
    assert report.distribution == "acme-broken"
    assert reg.fusion_providers[-1].name == "core.unfused"  # the core keeps working


def test_broken_plugin_is_fatal_in_strict_mode(tmp_path, monkeypatch, fresh_registry):
    make_dist(tmp_path, "acme-broken", "acme_broken_plugin", BROKEN, entry="acme_broken")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LAYER_BOUNDARY_STRICT_PLUGINS", "1")
    reset_registry()
    with pytest.raises(PluginLoadError, match="acme_broken.*acme-broken.*LAYER_BOUNDARY_DISABLE_PLUGINS=acme_broken"):
        get_registry()


def test_disable_switch(tmp_path, monkeypatch, fresh_registry):
    make_dist(tmp_path, "acme-ok", "acme_ok_plugin", PROVIDER_SOURCE.format(name="acme.ok", priority=7), entry="acme_ok")
    make_dist(tmp_path / "b", "acme-broken", "acme_broken_plugin", BROKEN, entry="acme_broken")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    monkeypatch.setenv("LAYER_BOUNDARY_STRICT_PLUGINS", "1")
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "acme_broken")
    reset_registry()
    reg = get_registry()
    assert reg.plugin("acme_broken").status == "disabled"
    assert "acme.ok" in [r.name for r in reg.fusion_providers]
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "acme_broken, acme_ok")
    reset_registry()
    assert "acme.ok" not in [r.name for r in get_registry().fusion_providers]


def test_registry_is_cached_per_process(fresh_registry):
    assert get_registry() is get_registry()


def test_cli_lists_builtin_and_the_installed_plugins():
    out = subprocess.run(
        [sys.executable, "-m", "layer_boundary", "plugins", "--json"], capture_output=True, text=True, check=True
    )
    data = json.loads(out.stdout)
    plugins = {p["name"]: p for p in data["plugins"]}
    assert plugins["core"]["builtin"]
    assert set(plugins) == {"core", *expected_plugins()}
    for name in expected_plugins():
        assert plugins[name]["status"] == "ok", plugins[name]
        assert plugins[name]["distribution"] == f"layer-boundary-{name}"
    order = [r["priority"] for r in data["records"]["fusion_providers"]]
    assert order == sorted(order, reverse=True)


def test_cli_text_mode_runs():
    out = subprocess.run([sys.executable, "-m", "layer_boundary", "plugins"], capture_output=True, text=True, check=True)
    assert "core.unfused" in out.stdout and "(built-in)" in out.stdout
