"""The docs say what the code does: docs/config.md is the schema's current rendering, the
README's example is examples/readme_example.py, the README's CLI flags and cache variable
exist, and the LICENSE matches the package metadata."""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from omni_trio.cli.args import build_parser
from omni_trio.models.tiny import default_cache_dir

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_config_md", ROOT / "docs" / "gen_config_md.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()


# -- docs/config.md ------------------------------------------------------------------------


def test_config_md_is_current() -> None:
    expected = gen.render(gen.load_schema())
    actual = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert actual == expected, "docs/config.md is out of date: run `make docs`"


def test_config_md_has_every_key_of_every_object() -> None:
    schema = gen.load_schema()
    text = gen.render(schema)
    sections = dict(
        (m.group(1), m.group(2))
        for m in re.finditer(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    )
    defs = schema["$defs"]
    assert set(sections) == set(defs)
    for name, definition in defs.items():
        for key in definition.get("properties", {}):
            assert f"| `{key}` |" in sections[name], f"{name}.{key} is missing from config.md"


SAMPLE_SCHEMA: dict[str, Any] = {
    "$ref": "#/$defs/Top",
    "$defs": {
        "Top": {
            "type": "object",
            "description": "The ``top`` object.",
            "properties": {
                "parts": {"type": "array", "items": {"$ref": "#/$defs/Part"}, "minItems": 1},
                "retries": {
                    "type": "integer",
                    "minimum": 1,
                    "default": 3,
                    "description": "how often a ``request`` is retried | at most",
                },
                "timeout": {
                    "anyOf": [{"type": "number", "exclusiveMinimum": 0, "description": "secs"}]
                    + [{"type": "null"}],
                    "default": None,
                },
            },
            "required": ["parts"],
            "additionalProperties": False,
        },
        "Part": {
            "type": "object",
            "properties": {
                "kind": {
                    "type": "string",
                    "anyOf": [{"enum": ["a", "b"]}, {"pattern": "^x:"}],
                    "default": "a",
                },
                "options": {"type": "object", "default": {}},
            },
            "allOf": [
                {
                    "if": {"properties": {"kind": {"const": "a"}}},
                    "then": {"properties": {"options": {"$ref": "#/$defs/AOptions"}}},
                }
            ],
        },
        "AOptions": {"type": "object", "properties": {"size": {"type": "integer"}}},
        "Unused": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}


def test_render_follows_the_schema() -> None:
    text = gen.render(SAMPLE_SCHEMA)
    assert text.startswith(gen.HEADER)
    # reading order: the root, then what it references, depth first; the rest after
    headings = re.findall(r"^## (\S+)", text, re.M)
    assert headings == ["Top", "Part", "AOptions", "Unused"]
    assert "The `top` object." in text
    assert "| `parts` | list[[Part](#part)] (>= 1 items) | **required** |  |" in text
    assert (
        "| `retries` | integer (>= 1) | `3` | how often a `request` is retried \\| at most |"
        in (text)
    )
    # an optional value's description sits on its non-null alternative
    assert "| `timeout` | number (> 0) \\| null | `null` | secs |" in text
    # a bare pattern alternative has the outer type
    assert '| `kind` | `"a"` \\| `"b"` \\| string (matches `^x:`) | `"a"` |  |' in text
    assert '- `kind: "a"`: `options` is [AOptions](#aoptions)' in text
    assert text.count("Other keys are rejected.") == 1  # Top only


def test_render_changes_with_the_schema() -> None:
    schema = copy.deepcopy(SAMPLE_SCHEMA)
    schema["$defs"]["Top"]["properties"]["added"] = {"type": "boolean", "default": True}
    assert gen.render(schema) != gen.render(SAMPLE_SCHEMA)
    assert "| `added` | boolean | `true` |  |" in gen.render(schema)


def test_generator_check_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "config.md"
    out.write_text("stale\n")
    assert gen.main(["--check", "--output", str(out)]) == 1
    assert gen.main(["--output", str(out)]) == 0
    assert gen.main(["--check", "--output", str(out)]) == 0
    assert out.read_text() == gen.render(gen.load_schema())
    assert "out of date" in capsys.readouterr().err


# -- README --------------------------------------------------------------------------------


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_readme_example_is_the_example_script() -> None:
    script = (ROOT / "examples" / "readme_example.py").read_text(encoding="utf-8")
    blocks = [b for b in _python_blocks(README) if b.startswith("# examples/readme_example.py")]
    assert len(blocks) == 1, "README needs one python block starting '# examples/readme_example.py'"
    assert blocks[0] == script


def _options(command: str) -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert command in sub.choices, f"README: omni-trio has no command {command!r}"
    subparser: argparse.ArgumentParser = sub.choices[command]
    return set(subparser._option_string_actions) | set(parser._option_string_actions)


def test_readme_cli_commands_and_flags_exist() -> None:
    shell = "\n".join(re.findall(r"^```sh\n(.*?)^```", README, re.S | re.M))
    inline = "\n".join(re.findall(r"`([^`\n]+)`", README))
    used = re.findall(r"\bomni-trio ((?:--)?[a-z][a-z-]*)([^\n]*)", shell + "\n" + inline)
    assert {cmd for cmd, _ in used} >= {"run", "serve", "validate", "schema", "--version"}
    top_level = set(build_parser()._option_string_actions)
    for cmd, rest in used:
        if cmd.startswith("--"):
            assert cmd in top_level, f"README: omni-trio has no {cmd}"
            continue
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest.split("#")[0]):
            assert flag in _options(cmd), f"README: `omni-trio {cmd}` has no {flag}"


def test_readme_names_the_model_cache_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert "OMNI_TRIO_CACHE" in README and "~/.cache/omni-trio" in README
    monkeypatch.setenv("OMNI_TRIO_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("OMNI_TRIO_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "omni-trio"


def test_readme_links_resolve() -> None:
    for target in re.findall(r"\]\((?!https?:|#)([^)#]+)", README):
        assert (ROOT / target).exists(), f"README links to missing {target}"


def test_readme_layout_names_existing_modules() -> None:
    section = README[README.index("## Layout") : README.index("## License")]
    names = set(re.findall(r"`([\w.]+\.py|[\w/]+/)`", section))
    package = ROOT / "omni_trio"
    existing = {f.name for f in package.rglob("*.py")} | {
        d.name + "/" for d in [*package.rglob("*"), *ROOT.iterdir()] if d.is_dir()
    }
    last = {n: n if n.endswith(".py") else n.rstrip("/").rpartition("/")[2] + "/" for n in names}
    missing = [n for n in names if last[n] not in existing and not (ROOT / n).exists()]
    assert names, "the Layout section names no module"
    assert missing == [], f"README's Layout names missing modules: {sorted(missing)}"


def undocumented_modules(root: Path, readme: str) -> list[str]:
    """The package's modules named neither in their package's docstring nor in the README.
    Pure (reads files)."""
    missing = []
    for path in sorted((root / "omni_trio").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        init = ast.parse((path.parent / "__init__.py").read_text())
        doc = ast.get_docstring(init) or ""
        named = re.compile(rf"(?<!\w){re.escape(path.stem)}(?!\w)")
        if not named.search(doc) and f"{path.stem}.py" not in readme:
            missing.append(str(path.relative_to(root)))
    return missing


def test_every_module_is_named_in_its_package_docstring_or_the_readme() -> None:
    assert undocumented_modules(ROOT, README) == []


def test_a_new_module_nobody_names_is_caught(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "omni_trio", tmp_path / "omni_trio")
    assert undocumented_modules(tmp_path, README) == []
    (tmp_path / "omni_trio" / "stages" / "hidden_room.py").write_text('"""Unnamed."""\n')
    assert undocumented_modules(tmp_path, README) == ["omni_trio/stages/hidden_room.py"]


# -- license and ignores -------------------------------------------------------------------


def test_license_matches_metadata() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert not any(c.startswith("License ::") for c in project.get("classifiers", ()))


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout"
)
@pytest.mark.parametrize(
    "path",
    [
        "demo-output/prompt-1.wav",
        "omni-output/prompt-1.wav",
        "omni-trio.log",
        "benchmarks/results/orchestrator.json",
    ],
)
def test_run_outputs_are_ignored(path: str) -> None:
    proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
    assert proc.returncode == 0, f"{path} is not git-ignored"
