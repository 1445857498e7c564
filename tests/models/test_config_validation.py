"""Every registered model family reads its config field by field: a mistyped field is refused in
one line naming the family and that field (or, where the family does not read it, ignored), a
missing one is refused in one line or takes a default, and nothing else escapes; `run` and `plan`
print that line and exit with status 2, before any rank starts."""

import json

import attrs
import pytest

from layer_boundary.cli.families import family_config, find_family
from layer_boundary.cli.main import main
from layer_boundary.plugin import ConfigError, get_registry

FAMILIES = sorted(r.record.model for r in get_registry().model_families)


def _parsed(config):
    """The parsed config's fields, the raw dict it keeps aside."""
    return {k: v for k, v in attrs.asdict(config, recurse=False).items() if k != "hf"}


def _mistyped(value):
    """A value of another JSON type than `value`'s."""
    return 7 if isinstance(value, str) else "abc"


def _changes(model):
    """(key, how, config) for every field of the family's tiny config: mistyped, then removed;
    the fields of an object field mistyped too."""
    preset = find_family(model).record.preset()
    for key, value in preset.items():
        if key != "model_type":
            yield key, "mistyped", {**preset, key: _mistyped(value)}
            yield key, "removed", {k: v for k, v in preset.items() if k != key}
        if isinstance(value, dict):  # an object's own fields (rope_parameters)
            for sub, inner in value.items():
                yield sub, "mistyped", {**preset, key: {**value, sub: _mistyped(inner)}}


CASES = [pytest.param(m, key, how, raw, id=f"{m}-{key}-{how}-{i}") for m in FAMILIES for i, (key, how, raw) in enumerate(_changes(m))]


@pytest.mark.parametrize("model, key, how, raw", CASES)
def test_a_changed_field_is_refused_in_one_line_or_has_no_effect(model, key, how, raw):
    item = find_family(model)
    try:
        config = family_config(item, raw)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message, message
        if how == "mistyped":  # the line names the field and the family
            assert key in message, message
            assert item.record.model_type in message or model in message, message
        return
    if how == "mistyped":  # accepted: the family does not read this field
        assert _parsed(config) == _parsed(family_config(item)), f"{key}={raw[key]!r} was half-read"


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_mistyped_hidden_size_is_one_line_and_exit_2(capsys, model, command):
    raw = dict(find_family(model).record.preset(), hidden_size="abc")
    status = main([command, "--model", model, "--tp", "1", "--hf-config", json.dumps(raw)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, err
    assert "hidden_size must be a positive integer, got 'abc' (a string)" in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hf-config", '{"model_type": "qwen3", "num_attention_heads": 5}'], "qwen3 config: hidden_size is missing; it needs a positive integer"),
        (["--hf-config", "[1, 2]"], "--hf-config is valid JSON but a list, not a config"),
        (["--hf-config", '"qwen3"'], "--hf-config is valid JSON but a string, not a config"),
        (["--hf-config", "/nonexistent/config.json"], "--hf-config /nonexistent/config.json: no such file or folder"),
        (["--checkpoint", "/nonexistent"], "--checkpoint /nonexistent: no such folder"),
        (["--model", "qwen3_moe", "--hf-config", '{"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, '
          '"num_attention_heads": 2, "intermediate_size": 64, "num_experts": "8"}'],
         "qwen3_moe config: num_experts must be a positive integer, got '8' (a string)"),
        (["--model", "gemma2", "--hf-config", '{"model_type": "gemma2", "rope_parameters": {"rope_theta": "fast"}}'],
         "gemma2 config: rope_parameters.rope_theta must be a positive number, got 'fast' (a string)"),
    ],
)
@pytest.mark.parametrize("command", ["run", "plan"])
def test_bad_config_input_is_one_line_and_exit_2(capsys, command, args, message):
    if command == "plan" and "--checkpoint" in args:
        pytest.skip("plan takes no --checkpoint")
    status = main([command, *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and message in lines[0], err


def _config_file(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"model_type": "qwen3", "hidden_size": "abc"}', "qwen3 config: hidden_size must be a positive integer, got 'abc' (a string)"),
        ("{model_type: qwen3", "config.json is not valid JSON"),
        ("[1, 2, 3]", "config.json holds a list, not a config object"),
    ],
)
@pytest.mark.parametrize("flag", ["--hf-config", "--checkpoint"])
def test_a_bad_config_json_in_a_folder_is_one_line_and_exit_2(capsys, tmp_path, flag, text, message):
    status = main(["run", flag, str(_config_file(tmp_path, text))])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and message in lines[0], err


def test_a_checkpoint_that_is_a_file_says_so(capsys, tmp_path):
    path = _config_file(tmp_path, "{}") / "config.json"
    assert main(["run", "--checkpoint", str(path)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
