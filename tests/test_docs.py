"""Every code block of the guides (docs/plugins.md, docs/models.md) is checked: a block headed
`# file: PATH` must appear in that file verbatim (the example distribution, which
tests/test_example_provider.py installs and runs), every other Python block runs."""

import contextvars
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "plugins.md"
#: the guides whose examples run
GUIDES = (GUIDE, ROOT / "docs" / "models.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(guide=GUIDE):
    text = guide.read_text()
    for match in FENCE.finditer(text):
        lang, body = match.group(1), match.group(2)
        line = text[: match.start()].count("\n") + 1
        if lang in ("python", "toml"):
            yield pytest.param(guide, lang, body, id=f"{guide.name}:{line}")


BLOCKS = [block for guide in GUIDES for block in _blocks(guide)]


def test_the_guide_has_examples_of_both_kinds():
    bodies = [p.values[2] for p in _blocks(GUIDE)]
    assert any(b.startswith("# file: ") for b in bodies) and any(b.startswith("# run\n") for b in bodies)


def test_the_models_guide_builds_loads_and_runs_a_model():
    """docs/models.md opens with one runnable example: build, load weights, forward."""
    runs = [p.values[2] for p in _blocks(ROOT / "docs" / "models.md") if p.values[2].startswith("# run\n")]
    assert runs and all(word in runs[0] for word in ("build_model(", "load_weights(", "model("))


@pytest.mark.parametrize("guide, lang, body", BLOCKS)
def test_every_example_of_the_plugin_guide_is_checked(guide, lang, body, fresh_registry):
    first, _, rest = body.partition("\n")
    if first.startswith("# file: "):
        source = (ROOT / first.removeprefix("# file: ").strip()).read_text()
        assert rest in source, f"the block is not the text of {first[8:]}:\n{rest}"
        return
    assert lang == "python" and first == "# run", "a block must be headed `# file: PATH` or `# run`"
    code = compile(rest, str(guide), "exec")
    contextvars.copy_context().run(exec, code, {"__name__": guide.stem + "_md"})  # publications stay in the block
