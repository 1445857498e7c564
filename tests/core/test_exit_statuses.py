"""`layer-boundary run`'s exit statuses, each from the outside: 0 a passed check, 1 a failed check,
2 bad input (before any rank starts), 3 a plugin that failed at run time (one line naming it and
the switch that disables it; with the switch set the same run passes). `run --help` says so.
The misbehaving plugins are throwaway distributions found through their entry points, so the
spawned ranks load them as an installed plugin."""

import json
import os
import subprocess
import sys

import pytest

from layer_boundary.cli.usage import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_PLUGIN_FAILED
from layer_boundary.testing import requires_plugins

from fake_dists import make_dist

#: a provider whose candidate completes the sum correctly, then spoils the result (`SPOIL`)
ACME = """
from layer_boundary.plugin import FusionProvider, add_rms_norm, hookimpl
from layer_boundary import FusedMlpInput


class Acme:
    def attention_input(self, stage):
        norm = stage.norm

        def run(owed, residual, fwd):
            normed, new_residual = add_rms_norm(norm, owed.group.all_reduce(owed.partial), residual)
            return {spoil}

        return (FusedMlpInput(run=run, name="acme.ar_add_rmsnorm"),)

    ffn_input = attention_input


@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(name="acme.fused", factory=lambda stage: Acme(), priority=10, description="test")
"""
#: shaped right, numerically wrong: only the check can tell
WRONG_VALUES = "normed * 1.5, new_residual"
#: a one-row residual, which would broadcast
ONE_ROW = "normed, new_residual[:1]"

RUN = ("run", "--model", "qwen3", "--tp", "2", "--dtype", "float64", "--decode-steps", "1", "--check", "single", "--json")


def cli(*args, site=None, **env):
    environ = {k: v for k, v in os.environ.items() if k != "LAYER_BOUNDARY_DISABLE_PLUGINS"}
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    environ.update(env)
    return subprocess.run([sys.executable, "-m", "layer_boundary", *args], capture_output=True, text=True, env=environ, timeout=300)


def _acme(tmp_path, spoil: str):
    make_dist(tmp_path, "acme", "acme_plugin", ACME.format(spoil=spoil))
    return tmp_path


def test_run_help_documents_every_exit_status():
    out = cli("run", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "exit status: 0 the check passed" in text
    assert f"{EXIT_CHECK_FAILED} the check failed" in text and f"{EXIT_BAD_INPUT} bad input" in text
    assert f"{EXIT_PLUGIN_FAILED} a plugin failed while the model was built, prepared or run" in text
    assert "LAYER_BOUNDARY_DISABLE_PLUGINS=<plugin>" in text


@requires_plugins("models")
def test_bad_input_exits_2_before_any_rank_starts():
    out = cli("run", "--model", "qwen3", "--tp", "3")
    assert out.returncode == EXIT_BAD_INPUT == 2
    assert len(out.stderr.splitlines()) == 1 and "spawning" not in out.stderr


@pytest.mark.gloo
@requires_plugins("models")
def test_a_failed_check_exits_1(tmp_path):
    out = cli(*RUN, site=_acme(tmp_path, WRONG_VALUES))
    assert out.returncode == EXIT_CHECK_FAILED == 1, out.stderr
    data = json.loads(out.stdout)
    assert data["check"]["passed"] is False and data["check"]["rel_err"] > 0.1
    fused = [c for b in data["kernels"]["boundaries"] for c in b["candidates"] if c["candidate"] == "acme.ar_add_rmsnorm"]
    assert fused and all(c["plugin"] == "acme" and c["accepted"] == 2 for c in fused)  # the vendor is named in the report


@pytest.mark.gloo
@requires_plugins("models")
def test_a_plugin_failing_at_run_time_exits_3_naming_it_and_its_switch(tmp_path):
    site = _acme(tmp_path, ONE_ROW)
    out = cli(*RUN, site=site)
    assert out.returncode == EXIT_PLUGIN_FAILED == 3, out.stderr
    assert out.stdout == ""
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, out.stderr
    line = errors[0]
    assert line.startswith("layer-boundary run: error: rank ")
    assert "fusion candidate 'acme.ar_add_rmsnorm' from record 'acme.fused' of plugin 'acme'" in line
    assert "returned a wrong new residual: 1 row where" in line
    assert line.endswith("set LAYER_BOUNDARY_DISABLE_PLUGINS=acme to run without it")
    switched_off = cli(*RUN, site=site, LAYER_BOUNDARY_DISABLE_PLUGINS="acme")
    assert switched_off.returncode == 0, switched_off.stderr
    assert json.loads(switched_off.stdout)["check"]["passed"] is True
