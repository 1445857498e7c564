"""`ConfigFields`: a config read field by field, each wrong field one line naming the family, the
field, the type it needs and what the config holds; and the command line's net under a family
parser that does not use it."""

import pytest

from layer_boundary.plugin import ConfigError, ConfigFields, ModelFamily, Priority, hookimpl, inline_plugin


def fields(**raw):
    return ConfigFields(raw, "acme")


@pytest.mark.parametrize(
    "read, raw, message",
    [
        (lambda f: f.int("hidden_size", min=1), {}, "acme config: hidden_size is missing; it needs a positive integer"),
        (lambda f: f.int("hidden_size", min=1), {"hidden_size": None}, "acme config: hidden_size is missing; it needs a positive integer"),
        (lambda f: f.int("hidden_size", min=1), {"hidden_size": "abc"}, "acme config: hidden_size must be a positive integer, got 'abc' (a string)"),
        (lambda f: f.int("hidden_size", min=1), {"hidden_size": 0}, "hidden_size must be a positive integer, got 0 (an integer)"),
        (lambda f: f.int("layers", min=1), {"layers": True}, "layers must be a positive integer, got True (a boolean)"),
        (lambda f: f.int("layers"), {"layers": 2.5}, "layers must be an integer, got 2.5 (a number)"),
        (lambda f: f.int("zeros", min=0), {"zeros": -1}, "zeros must be an integer >= 0, got -1"),
        (lambda f: f.float("eps", positive=True), {"eps": "1e-6"}, "eps must be a positive number, got '1e-6' (a string)"),
        (lambda f: f.float("eps", positive=True), {"eps": 0}, "eps must be a positive number, got 0"),
        (lambda f: f.bool("tie"), {"tie": "yes"}, "tie must be true or false, got 'yes' (a string)"),
        (lambda f: f.str("act", choices=("silu", "gelu")), {"act": "relu"}, "act must be one of 'silu', 'gelu', got 'relu'"),
        (lambda f: f.str("act"), {"act": 3}, "act must be a string, got 3 (an integer)"),
        (lambda f: f.list("types", of=str), {"types": "sliding"}, "types must be a list of strings, got 'sliding' (a string)"),
        (lambda f: f.list("ids", of=int), {"ids": [1, "2"]}, "ids must be a list of integers, got [1, '2'] (a list)"),
        (lambda f: f.dict("rope"), {"rope": [1]}, "rope must be an object, got [1] (a list)"),
        (lambda f: f.sub("rope").float("rope_theta"), {"rope": {"rope_theta": "x"}}, "acme config: rope.rope_theta must be a number, got 'x'"),
        (lambda f: f.sub("rope").float("rope_theta"), {"rope": "x"}, "acme config: rope must be an object, got 'x' (a string)"),
    ],
)
def test_a_wrong_field_is_one_line_naming_family_field_and_type(read, raw, message):
    with pytest.raises(ConfigError) as info:
        read(fields(**raw))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_good_field_is_returned_with_its_type_and_a_missing_one_takes_the_default():
    f = fields(hidden_size=64, eps=1, tie=False, act="silu", types=["a", "b"], rope={"rope_theta": 10000}, empty=None)
    assert f.int("hidden_size", min=1) == 64 and f.int("absent", 7) == 7 and f.int("empty", None) is None
    value = f.float("eps", positive=True)
    assert value == 1.0 and isinstance(value, float)
    assert f.bool("tie") is False and f.bool("absent", True) is True
    assert f.str("act", choices=("silu",)) == "silu"
    assert f.list("types", of=str) == ("a", "b")
    assert f.sub("rope").float("rope_theta") == 10000.0 and f.sub("absent").raw == {}
    assert f.first(("absent", "empty", "tie", "act")) == "tie" and f.first(("absent",)) is None
    assert f.has("act") and not f.has("empty") and not f.has("absent")


def test_a_config_that_is_not_an_object_is_one_line():
    with pytest.raises(ConfigError, match=r"^acme config: expected a JSON object of fields, got a list$"):
        ConfigFields([1, 2], "acme")


def test_a_family_s_own_error_class_is_raised():
    class FamilyError(ConfigError):
        pass

    with pytest.raises(FamilyError, match="width is missing"):
        ConfigFields({}, "acme", error=FamilyError).int("width")


class _Careless:
    """A family whose parser indexes the raw config without checking it."""

    @hookimpl
    def layer_boundary_model_families(self):
        yield ModelFamily(name="careless.probe", model="probe", model_type="probe", factory=lambda request: None,
                          parse=lambda raw: int(raw["hidden_size"]), load_weights=print, random_weights=dict,
                          preset=lambda: {"model_type": "probe"}, priority=Priority.REFERENCE, description="a careless parser")


@pytest.mark.parametrize("raw, detail", [({"model_type": "probe"}, "field 'hidden_size' is missing"),
                                         ({"model_type": "probe", "hidden_size": "abc"}, "ValueError: invalid literal")])
def test_a_family_parser_that_raises_a_python_error_is_one_line(fresh_registry, raw, detail):
    """The command line's net: a third party's parser failing with KeyError / ValueError is one
    ConfigError naming the family and the error (the run ends with exit status 2, no traceback)."""
    from layer_boundary.cli.families import family_config, find_family

    with inline_plugin(_Careless(), name="careless"):
        with pytest.raises(ConfigError) as info:
            family_config(find_family("probe"), raw)
    message = str(info.value)
    assert "--model probe: the family 'careless.probe' cannot read this config" in message and detail in message and "\n" not in message
