"""Reading a config file safely (``omni_trio.config.reading``): unreadable, unparsable, not UTF-8,
nested too deep, duplicate keys, YAML alias bombs, numbers that are not finite, and msgspec's
errors explained (the value found, the values allowed). Each a ConfigError naming the file
and the exact ``$``-path.

The file helpers here (``write``, ``one_stage_yaml``, ``config_error``, ``stage_error``) serve
the other ``test_config_*`` modules too."""

import pytest

from omni_trio import ConfigError, load_config


def write(tmp_path, name, text):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def one_stage_yaml(extra=""):
    return "name: t\nstages:\n  - id: a\n    final_output: true\n" + extra


def config_error(path, where):
    """Load ``path``; assert a ConfigError naming the file and exactly ``where``."""
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    assert info.value.path == where
    assert str(info.value).startswith(f"{path}: {where}: ")
    return str(info.value)


def stage_error(tmp_path, lines, where):
    """Write a one-stage YAML file with ``lines`` added to the stage; return its error."""
    path = write(tmp_path, f"stage{len(list(tmp_path.iterdir()))}.yaml", one_stage_yaml(lines))
    return config_error(path, where)


def test_unreadable_and_unparsable_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad)
    odd = tmp_path / "x.ini"
    odd.write_text("")
    with pytest.raises(ConfigError, match="unsupported config file type"):
        load_config(odd)


def test_bad_enum_value_lists_the_allowed_ones(tmp_path):
    msg = stage_error(tmp_path, "    lb_policy: rr\n", "$.stages[0].lb_policy")
    assert msg.endswith(
        ": Expected one of 'least_loaded', 'random', 'round_robin', got str 'rr'"
    ), msg
    path = write(tmp_path, "p.yaml", one_stage_yaml().replace("name: t", "admission: queue"))
    msg = config_error(path, "$.admission")
    assert msg.endswith(": Expected one of 'reject', 'wait', got str 'queue'"), msg


def test_explain_validation_error_finds_enums_through_containers():
    import enum
    from typing import Literal

    import msgspec

    from omni_trio.config.reading import explain_validation_error

    class Color(enum.Enum):
        RED = "red"
        BLUE = "blue"

    class Inner(msgspec.Struct):
        mode: Literal["a", "b"] | None = None

    class Outer(msgspec.Struct):
        inners: list[Inner] = []
        by_name: dict[str, Literal[1, 2]] = {}
        pair: tuple[int, Color] = (0, Color.RED)

    def explain(data):
        with pytest.raises(msgspec.ValidationError) as info:
            msgspec.convert(data, Outer)
        return explain_validation_error(info.value, data, Outer)

    assert explain({"inners": [{}, {"mode": "c"}]}) == (
        "Expected one of 'a', 'b', got str 'c'",
        "$.inners[1].mode",
    )
    # msgspec does not name the dict key: its reason keeps the value
    assert explain({"by_name": {"x": 3}}) == (
        "Invalid enum value 3; expected one of 1, 2",
        "$.by_name[...]",
    )
    assert explain({"pair": [0, "green"]}) == (
        "Expected one of 'red', 'blue', got str 'green'",
        "$.pair[1]",
    )
    # without the schema, msgspec's own reason (with the value) as before
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert({"pair": [0, "green"]}, Outer)
    assert explain_validation_error(info.value, {"pair": [0, "green"]}) == (
        "Invalid enum value 'green', got str 'green'",
        "$.pair[1]",
    )


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        (
            "nan.yaml",
            one_stage_yaml("    stage_init_timeout: .nan\n"),
            "$.stages[0].stage_init_timeout",
        ),
        (
            "inf.toml",
            'shutdown_timeout = inf\n[[stages]]\nid = "a"\nfinal_output = true\n',
            "$.shutdown_timeout",
        ),
        (
            "inf.json",
            '{"stages": [{"id": "a", "final_output": true}], "init_timeout": Infinity}',
            "$.init_timeout",
        ),
        (
            "opt.yaml",
            one_stage_yaml("    options: {latency_s: .inf}\n"),
            "$.stages[0].options.latency_s",
        ),
    ],
)
def test_non_finite_numbers_rejected(tmp_path, name, text, where):
    assert "numbers must be finite" in config_error(write(tmp_path, name, text), where)


def test_non_utf8_file(tmp_path):
    bad = write(tmp_path, "latin1.yaml", "name: caf\u00e9\nstages: []\n".encode("latin-1"))
    msg = config_error(bad, "$")
    assert "not UTF-8" in msg and "line 1, column 10" in msg


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.yaml", "a: " + "[" * 100_000 + "]" * 100_000 + "\n"),
        ("deep.json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        ("deep.toml", "a = " + "[" * 100_000 + "]" * 100_000 + "\n"),
        ("deep70.yaml", "a: " + "[" * 70 + "]" * 70 + "\n"),
        ("deep70.json", '{"a": ' + "[" * 70 + "]" * 70 + "}"),
    ],
)
def test_deep_nesting_is_a_config_error(tmp_path, name, text):
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    assert "nested" in str(info.value) or "nesting" in str(info.value)


def test_duplicate_keys(tmp_path):
    bad = write(tmp_path, "dup.yaml", one_stage_yaml("    replicas: 1\n    replicas: 2\n"))
    assert "duplicate key 'replicas' (line 6, column 5)" in config_error(
        bad, "$.stages[0].replicas"
    )
    bad = write(tmp_path, "dup.json", '{"name": "a", "name": "b", "stages": []}')
    assert "duplicate key 'name'" in config_error(bad, "$.name")
    # a YAML merge key is not a duplicate: the explicit key overrides the merged one
    ok = write(
        tmp_path,
        "merge.yaml",
        "base: &b {id: a, final_output: false}\nstages:\n  - <<: *b\n    final_output: true\n",
    )
    with pytest.raises(ConfigError, match=r"\$\.base: Object contains unknown field"):  # not a dup
        load_config(ok)


def test_yaml_alias_bomb_and_recursive_alias(tmp_path):
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    lines.append("stages: [*i]")
    bomb = write(tmp_path, "bomb.yaml", "\n".join(lines) + "\n")
    with pytest.raises(
        ConfigError, match=r"bomb\.yaml: \$\.\w.*: expands to more than .*\(line \d+, column \d+\)"
    ):
        load_config(bomb)
    loop = write(tmp_path, "loop.yaml", "a: &a [*a]\nstages: []\n")
    assert "refers to a node that contains it" in config_error(loop, "$.a[0]")
