"""Reading a recipe file (recipes/loader.py): what is not a sound small YAML file is one line,
``file:line[:column]: [key.path:] problem``, exit status 2, never a traceback, in bounded time and memory.

Each of these used to print a Python traceback (invalid UTF-8, NUL, deep nesting, a recursive anchor),
run for tens of seconds into a MemoryError (an alias bomb) or be accepted silently (a duplicate key).
"""

from __future__ import annotations

import re
import textwrap

import pytest

from replicafit import cli, recipes
from replicafit.recipes.loader import MAX_BYTES, MAX_DEPTH, MAX_NODES, parse

GOOD = "model: mlp\ndata: digits\n"


def validate(capsys, path, *argv):
    status = cli.main(["validate", str(path), *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def one_error(capsys, path, *argv) -> str:
    """Validates ``path``; asserts exit status 2 and one line without a traceback; returns the line."""
    status, out, err = validate(capsys, path, *argv)
    assert "Traceback" not in err
    assert (status, out) == (2, ""), err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {path}:"), lines[0]
    return lines[0]


def write_bytes(tmp_path, data: bytes):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(data)
    return path


# --- bytes and characters ------------------------------------------------------------------------
def test_invalid_utf8_names_line_and_column(tmp_path, capsys):
    path = write_bytes(tmp_path, GOOD.encode() + b"fit:\n  epochs: 1  # caf\xe9\n")
    line = one_error(capsys, path)
    assert re.match(rf"^error: {re.escape(str(path))}:4:19: not UTF-8 text: byte 0xe9 ", line), line
    assert "save the recipe as UTF-8" in line


def test_utf8_text_is_fine(tmp_path, capsys):
    path = write_bytes(tmp_path, "# café, naïve, 数字\n".encode() + GOOD.encode())
    assert validate(capsys, path)[0] == 0


def test_nul_byte(tmp_path, capsys):
    path = write_bytes(tmp_path, GOOD.encode() + b"fit:\n  epochs: 1\x00\n")
    line = one_error(capsys, path)
    assert re.match(rf"^error: {re.escape(str(path))}:4:12: a NUL byte", line), line


def test_control_character(tmp_path, capsys):
    path = write_bytes(tmp_path, GOOD.encode() + b"fit: {epochs: \x07}\n")
    line = one_error(capsys, path)
    assert f"{path}:3:" in line and "U+0007" in line


def test_file_far_larger_than_a_recipe(tmp_path, capsys):
    path = write_bytes(tmp_path, GOOD.encode() + b"#" * (MAX_BYTES + 10) + b"\n")
    assert "a recipe is a short YAML file" in one_error(capsys, path)


# --- nesting, anchors and aliases ----------------------------------------------------------------
@pytest.mark.parametrize("style", ["flow", "block"])
def test_deep_nesting(tmp_path, capsys, style):
    if style == "flow":
        text = GOOD + "fit: " + "[" * 5000 + "]" * 5000 + "\n"
    else:
        text = GOOD + "".join("  " * depth + f"k{depth}:\n" for depth in range(300)) + "  " * 300 + "end: 1\n"
    path = write_bytes(tmp_path, text.encode())
    assert f"nested more than {MAX_DEPTH} levels deep" in one_error(capsys, path)


def test_nesting_up_to_the_limit_is_fine():
    """MAX_DEPTH counts every level from the document's mapping down to the innermost value."""
    lists = MAX_DEPTH - 2  # the top mapping, these lists, the number
    data, lines = parse("a: " + "[" * lists + "1" + "]" * lists + "\n", "x.yaml")
    depth, value = 0, data["a"]
    while isinstance(value, list):
        depth, value = depth + 1, value[0]
    assert (depth, value, lines[("a",)]) == (lists, 1, 1)
    with pytest.raises(recipes.RecipeError, match=f"nested more than {MAX_DEPTH} levels deep"):
        parse("a: " + "[" * (lists + 1) + "1" + "]" * (lists + 1) + "\n", "x.yaml")


@pytest.mark.parametrize(
    "text,key",
    [
        ("data: digits\nmodel:\n  type: mlp\n  hidden: &h [128, *h]\n", "model.hidden[1]"),
        ("data: digits\nmodel: &m\n  type: mlp\n  again: *m\n", "model.again"),
        (
            "data: digits\nmodel: mlp\ncallbacks: &c\n  - {type: early_stopping, patience: *c}\n",
            "callbacks[0].patience",
        ),
    ],
    ids=["list", "mapping", "nested"],
)
def test_recursive_anchor(tmp_path, capsys, text, key):
    path = write_bytes(tmp_path, text.encode())
    line = one_error(capsys, path)
    assert re.match(rf"^error: {re.escape(str(path))}:4: {re.escape(key)}: the alias \*\w ", line), line
    assert "contains itself" in line


def billion_laughs(levels: int = 9) -> str:
    """A few hundred bytes whose aliases expand to 10**levels values."""
    lines = ["lol0: &lol0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for level in range(1, levels):
        lines.append(f"lol{level}: &lol{level} [" + ", ".join([f"*lol{level - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(30)  # the loader used to spend 27 s on this, then raise MemoryError under a 3 GiB cap
def test_alias_bomb_is_refused_quickly(tmp_path, capsys):
    path = write_bytes(tmp_path, (GOOD + billion_laughs()).encode())
    line = one_error(capsys, path)
    assert f"expands to more than {MAX_NODES:,} values" in line
    assert re.match(rf"^error: {re.escape(str(path))}:\d+: lol\d: ", line), line


@pytest.mark.timeout(30)
def test_alias_bomb_in_a_set_value(tmp_path, capsys):
    path = write_bytes(tmp_path, GOOD.encode())
    bomb = "[" + billion_laughs(7).replace("\n", ", ").replace("lol0: ", "").rstrip(", ") + "]"
    bomb = re.sub(r"lol\d+: ", "", bomb)
    status, out, err = validate(capsys, path, "--set", f"fit.x={bomb}")
    assert (status, out) == (2, "") and "Traceback" not in err
    assert "--set fit.x: cannot parse the value" in err and "expands to more than" in err


def test_aliases_and_merge_keys_within_bounds_still_work(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(
        textwrap.dedent(
            """
            data: digits
            model:
              type: mlp
              hidden: &sizes [16, 8]
            optimizer:
              <<: &sgd {type: sgd, learning_rate: 0.1, momentum: 0.9}
              learning_rate: 0.05
            metrics: [accuracy]
            callbacks:
              - {type: early_stopping, patience: 2}
            fit: {epochs: 1}
            """
        ).lstrip()
    )
    recipe = recipes.load(path)
    assert recipe.data["optimizer"] == {"type": "sgd", "learning_rate": 0.05, "momentum": 0.9}
    assert recipe.data["model"]["hidden"] == [16, 8]
    assert recipe.line(("optimizer", "learning_rate")) == 7  # the key written last, which wins
    recipes.validate(recipe)


def test_an_alias_is_counted_in_full(tmp_path, capsys):
    """A value shared through an anchor counts as many times as it is used: that is what a reader of the
    loaded data walks."""
    each = MAX_NODES // 4
    text = GOOD + f"big: &big [{', '.join(['1'] * each)}]\nfit: {{x: [*big, *big, *big, *big, *big]}}\n"
    path = write_bytes(tmp_path, text.encode())
    assert "expands to more than" in one_error(capsys, path)


# --- keys ---------------------------------------------------------------------------------------
def test_duplicate_section_reports_both_lines(tmp_path, capsys):
    path = write_bytes(tmp_path, b"data: digits\nmodel: mlp\nloss: mse\nmodel: cnn\n")
    line = one_error(capsys, path)
    assert line == (
        f"error: {path}:4: model: duplicate key 'model': it is on line 2 and again on line 4 "
        "(YAML would keep only the last one): keep one"
    )


def test_duplicate_nested_key(tmp_path, capsys):
    path = write_bytes(
        tmp_path,
        b"data: digits\nmodel: mlp\noptimizer:\n  type: sgd\n  learning_rate: 0.1\n  momentum: 0.9\n"
        b"  learning_rate: 0.5\n",
    )
    line = one_error(capsys, path)
    assert line.startswith(f"error: {path}:7: optimizer.learning_rate: duplicate key 'learning_rate'")
    assert "on line 5 and again on line 7" in line


def test_duplicate_key_in_a_flow_mapping_and_in_a_list_item(tmp_path, capsys):
    path = write_bytes(tmp_path, b"data: digits\nmodel: {type: mlp, type: cnn}\n")
    assert "model.type: duplicate key 'type': it is on line 2 and again on line 2" in one_error(capsys, path)
    path = write_bytes(
        tmp_path, b"data: digits\nmodel: mlp\ncallbacks:\n  - type: early_stopping\n    type: csv_logger\n"
    )
    assert f"{path}:5: callbacks[0].type: duplicate key" in one_error(capsys, path)


def test_same_key_written_two_ways_is_a_duplicate(tmp_path, capsys):
    path = write_bytes(tmp_path, b"data: digits\nmodel: mlp\nfit:\n  shuffle: 1\n  1: 2\n  0x1: 3\n")
    assert "duplicate key '0x1': it is on line 5 and again on line 6" in one_error(capsys, path)


def test_a_key_that_is_a_list(tmp_path, capsys):
    path = write_bytes(tmp_path, b"data: digits\nmodel: mlp\nfit:\n  ? [epochs, batch_size]\n  : 3\n")
    assert "a key must be a plain name, not a list" in one_error(capsys, path)
