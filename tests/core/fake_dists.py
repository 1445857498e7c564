"""Write throwaway distributions (dist-info + module) that register entry points."""

from __future__ import annotations

import textwrap
from pathlib import Path


def make_dist(root: Path, dist: str, module: str, source: str, entry: str | None = None) -> None:
    """A distribution `dist` whose entry point `entry` (default: dist) in group layer_boundary
    loads `module`, whose text is `source`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[layer_boundary]\n{entry or dist.replace('-', '_')} = {module}\n")


PROVIDER_SOURCE = """
from layer_boundary.plugin import FusionProvider, hookimpl

@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(name="{name}", factory=lambda stage: None, priority={priority}, description="test")
"""
