#!/usr/bin/env python3
"""Install-combination test matrix: the core alone, the reference model families on top of it,
each plugin with them, and a third party's model family without them.

Environments (reused between runs; rebuilt when a pyproject or a pin changes):
- `.venv-core`: torch 2.13 CPU + the core (`pip install -e .[test]`), no plugin;
- `.venv-plugin-<name>`: a venv that layers on `.venv-core` (a .pth runs site.addsitedir on its
  site-packages, so torch is shared, not reinstalled) plus `pip install -e` of its distributions
  and their own third-party dependencies: `models` alone (layer-boundary-models), each plugin with
  `models` (their tests drive the reference models), and `example_family` alone (the third-party
  family in tests/example_family);
- `.venv-plugin-oracle-low` / `-oracle-high`: `models`, `mhc`, `tbo` and `lora` over the lowest
  and the highest transformers the oracle supports (installed in the layer, so they shadow the
  core's pin), running the Hugging Face parity subset (`pytest -m oracle`).

Each environment runs the tests meant for it, with LAYER_BOUNDARY_EXPECT_PLUGINS naming what is
installed (tests that need more skip with a reason only when that variable says so). Prints
the matrix (environment -> tests -> result) and exits non-zero when any cell fails.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ("flashinfer", "cutedsl", "mhc", "cp", "tbo", "lora")
#: what the oracle's families need: deepseek_v4 runs on mhc, longcat_flash on tbo, LoRA checks through peft
ORACLE_PLUGINS = ["plugins/models", "plugins/mhc", "plugins/tbo", "plugins/lora"]
#: environment -> (its distributions' folders, the tests meant for it)
ENVIRONMENTS = {
    "models": (["plugins/models"], ["tests/models", "tests/install"]),
    **{name: (["plugins/models", f"plugins/{name}"], [f"tests/plugins/{name}", "tests/install"]) for name in PLUGINS},
    "example_family": (["tests/example_family"], ["tests/test_example_family.py", "tests/install"]),
    **{name: (ORACLE_PLUGINS, ["tests/models", "tests/plugins/lora"]) for name in ("oracle-low", "oracle-high")},
}
#: environment -> third-party pins installed over the core's: both ends of the oracle's
#: transformers range (pyproject's `oracle` extra); 5.17 predates hub 2.0
PINS = {
    "oracle-low": ["transformers==5.17.0", "huggingface-hub<2.0", "peft==0.21.2"],
    "oracle-high": ["transformers==5.25.0", "peft==0.21.2"],
}
#: environment -> the pytest -m selection it runs: the oracle's subset at both ends; the families
#: without any plugin in their threaded cases (the slow gloo ones run once, in `make test-full`)
SELECTIONS = {"models": "not gloo", "oracle-low": "oracle", "oracle-high": "oracle"}
PYTHON = os.environ.get("PYTHON", "python3")


def sh(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def site_packages(venv: Path) -> str:
    out = subprocess.run(
        [str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    )
    return out.stdout.strip()


def _digest(inputs: list[Path], pins: list[str]) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in inputs) + " ".join(pins).encode()).hexdigest()


def stamp_ok(venv: Path, inputs: list[Path], pins: list[str] = ()) -> bool:
    stamp = venv / ".matrix-stamp"
    return stamp.exists() and stamp.read_text() == _digest(inputs, list(pins))


def write_stamp(venv: Path, inputs: list[Path], pins: list[str] = ()) -> None:
    (venv / ".matrix-stamp").write_text(_digest(inputs, list(pins)))


def pip(venv: Path, *args):
    sh([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args])


def core_env() -> Path:
    venv = ROOT / ".venv-core"
    inputs = [ROOT / "pyproject.toml"]
    if stamp_ok(venv, inputs):
        return venv
    if not (venv / "bin/python").exists():
        sh([PYTHON, "-m", "venv", str(venv)])
    pip(venv, "--upgrade", "pip", "setuptools", "wheel")
    pip(venv, "torch==2.13.0")
    pip(venv, "-e", f"{ROOT}[test]")
    write_stamp(venv, inputs)
    return venv


def plugin_env(name: str, core: Path) -> Path:
    venv = ROOT / f".venv-plugin-{name}"
    folders = ENVIRONMENTS[name][0]
    pins = PINS.get(name, [])
    inputs = [ROOT / "pyproject.toml", *(ROOT / folder / "pyproject.toml" for folder in folders)]
    if stamp_ok(venv, inputs, pins):
        return venv
    if not (venv / "bin/python").exists():
        sh([PYTHON, "-m", "venv", str(venv)])
    layer = Path(site_packages(venv)) / "_layer_boundary_core_env.pth"
    layer.write_text(f"import site; site.addsitedir({site_packages(core)!r})\n")
    # one resolution: the distributions with any pins, installed into this layer, which comes
    # first on sys.path (pip leaves the core's copies alone)
    pip(venv, *(arg for folder in folders for arg in ("-e", str(ROOT / folder))), *pins)
    write_stamp(venv, inputs, pins)
    return venv


def run_tests(venv: Path, expect: str, paths: list[str], select: str = None) -> tuple[bool, str, float]:
    env = dict(os.environ, LAYER_BOUNDARY_STRICT_PLUGINS="1", LAYER_BOUNDARY_EXPECT_PLUGINS=expect, HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    paths = [p for p in paths if (ROOT / p).exists()]
    if not paths:
        return False, "no tests found", 0.0
    start = time.perf_counter()
    proc = subprocess.run(
        [str(venv / "bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-m", select] if select else []), *paths],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    took = time.perf_counter() - start
    tail = [line for line in proc.stdout.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:] + proc.stderr[-3000:])
    return proc.returncode == 0, tail[0], took


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", help="environments to run (core and/or plugin names)")
    args = ap.parse_args()
    wanted = args.only or ["core", *ENVIRONMENTS]
    core = core_env()
    rows = []
    if "core" in wanted:
        ok, summary, took = run_tests(core, "", ["tests/core", "tests/install"])
        rows.append(("core alone", "tests/core tests/install", ok, summary, took))
    for name, (folders, tests) in ENVIRONMENTS.items():
        if name not in wanted:
            continue
        venv = plugin_env(name, core)
        expect = ",".join(Path(folder).name for folder in folders)  # the entry-point names: the folders' names
        pins, select = PINS.get(name, []), SELECTIONS.get(name)
        ok, summary, took = run_tests(venv, expect, tests, select)
        label = f"core + {' + '.join(Path(f).name for f in folders)}" + (f" + {pins[0]}" if pins else "")
        rows.append((label, " ".join(tests) + (f" -m {select}" if select else ""), ok, summary, took))
    print("\nenvironment matrix:")
    width = max(len(r[0]) for r in rows)
    for env, tests, ok, summary, took in rows:
        print(f"  {env:<{width}}  {'PASS' if ok else 'FAIL'}  {tests}: {summary} ({took:.0f} s)")
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
