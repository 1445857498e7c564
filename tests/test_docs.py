"""Every code block of docs/plugins.md is checked: a block headed `# file: PATH` must appear in
that file verbatim (the example distribution, which tests/test_example_provider.py installs and
runs), every other Python block runs."""

import contextvars
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "plugins.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks():
    for match in FENCE.finditer(GUIDE.read_text()):
        lang, body = match.group(1), match.group(2)
        line = GUIDE.read_text()[: match.start()].count("\n") + 1
        if lang in ("python", "toml"):
            yield pytest.param(lang, body, id=f"plugins.md:{line}")


BLOCKS = list(_blocks())


def test_the_guide_has_examples_of_both_kinds():
    bodies = [p.values[1] for p in BLOCKS]
    assert any(b.startswith("# file: ") for b in bodies) and any(b.startswith("# run\n") for b in bodies)


@pytest.mark.parametrize("lang, body", BLOCKS)
def test_every_example_of_the_plugin_guide_is_checked(lang, body, fresh_registry):
    first, _, rest = body.partition("\n")
    if first.startswith("# file: "):
        source = (ROOT / first.removeprefix("# file: ").strip()).read_text()
        assert rest in source, f"the block is not the text of {first[8:]}:\n{rest}"
        return
    assert lang == "python" and first == "# run", "a block must be headed `# file: PATH` or `# run`"
    code = compile(rest, str(GUIDE), "exec")
    contextvars.copy_context().run(exec, code, {"__name__": "plugins_md"})  # publications stay in the block
