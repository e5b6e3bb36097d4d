"""Reading a recipe file: bytes -> UTF-8 text -> ``${VAR}`` -> YAML, with the limits a small file deserves.

A recipe is a few dozen lines, so anything far beyond that is refused with a message
rather than processed: at most ``MAX_BYTES`` of file, ``MAX_DEPTH`` levels of nesting and
``MAX_NODES`` values once every alias is expanded (a YAML "billion laughs" file is a few
hundred bytes that expand to billions of values). A key written twice in one mapping, an
anchor that contains its own alias, bytes that are not UTF-8 and control characters are
refused too, each as one ``RecipeError`` naming the file and the line.

Example::

    data, lines = parse(read_text("recipe.yaml"), "recipe.yaml")
    lines[("optimizer", "learning_rate")]   # -> the line the key is on
"""

from __future__ import annotations

import os
import re

import yaml

__all__ = ["RecipeError", "MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "read_text", "interpolate", "parse", "parse_value"]

MAX_BYTES = 1 << 20  # 1 MiB: the shipped recipes are about 1 KiB
MAX_DEPTH = 50  # the shipped recipes nest 4 levels deep
MAX_NODES = 100_000  # values after alias expansion; the shipped recipes have about 60
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_MERGE_TAG = "tag:yaml.org,2002:merge"


class RecipeError(Exception):
    """A recipe problem: ``file:line: key.path: what is wrong``."""

    def __init__(self, file: str, line, key: str, message: str):
        self.file, self.line, self.key, self.message = file, line, key, message
        location = f"{file}:{line}" if line else file
        super().__init__(f"{location}: {key}: {message}" if key else f"{location}: {message}")


def format_key(key: tuple) -> str:
    """``("callbacks", 0, "patience")`` -> ``"callbacks[0].patience"``."""
    out = ""
    for part in key:
        is_index = isinstance(part, int) and not isinstance(part, bool)
        out += f"[{part}]" if is_index else (f".{part}" if out else str(part))
    return out


# --- bytes to text ---------------------------------------------------------------------------------


def read_text(path: str) -> str:
    """The recipe's text: at most ``MAX_BYTES``, valid UTF-8, no NUL or other control characters."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_BYTES + 1)
    except OSError as error:
        raise RecipeError(path, None, "", f"cannot read the recipe ({error.strerror or error})") from None
    if len(raw) > MAX_BYTES:
        raise RecipeError(
            path, None, "", f"larger than {MAX_BYTES // 1024} KiB: a recipe is a short YAML file (is this one?)"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line, column = _position(raw, error.start, b"\n")
        raise RecipeError(
            f"{path}:{line}:{column}",
            None,
            "",
            f"not UTF-8 text: byte 0x{raw[error.start]:02x} ({error.reason}); save the recipe as UTF-8",
        ) from None


def check_characters(text: str, path: str) -> None:
    """Refuses NUL and the other characters YAML does not allow, naming the line and column."""
    match = yaml.reader.Reader.NON_PRINTABLE.search(text)
    if match is None:
        return
    line, column = _position(text, match.start(), "\n")
    char = match.group()
    what = "a NUL byte (\\x00): a recipe is text, not a binary file" if char == "\x00" else None
    what = what or f"the control character U+{ord(char):04X} is not allowed in YAML: remove it"
    raise RecipeError(f"{path}:{line}:{column}", None, "", what)


def _position(data, offset: int, newline) -> tuple:
    """1-based ``(line, column)`` of ``offset`` in ``data`` (str or bytes)."""
    line = data.count(newline, 0, offset) + 1
    return line, offset - (data.rfind(newline, 0, offset) + 1) + 1


# --- ${VAR} -----------------------------------------------------------------------------------------


def interpolate(text: str, path: str) -> str:
    """Replaces ``${VAR}`` and ``${VAR:-default}`` from the environment, outside comments."""

    def replace(match, line_number):
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if value is None:
            if default is None:
                raise RecipeError(
                    path,
                    line_number,
                    "",
                    f"environment variable ${{{name}}} is not set (write ${{{name}:-default}} to give a default)",
                )
            value = default
        return value

    out = []
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        cut = _comment_start(line)
        out.append(_ENV.sub(lambda m, n=number: replace(m, n), line[:cut]) + line[cut:])
    return "".join(out)


def _comment_start(line: str) -> int:
    """Where a YAML comment starts on ``line`` (``#`` at the start or after a space, outside quotes)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1] in " \t"):
            return index
    return len(line)


# --- YAML -------------------------------------------------------------------------------------------


class _Refused(Exception):
    """A limit or rule of ``_RecipeLoader`` broken at ``mark`` (a yaml Mark), under ``key``."""

    def __init__(self, mark, key: tuple, message: str):
        super().__init__(message)
        self.mark, self.key, self.message = mark, key, message


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys, non-scalar keys, recursive anchors, deep
    nesting and alias expansion beyond ``MAX_NODES`` while it composes the document.

    The size of a node is counted as if every alias were written out in full (computed once per
    node, so counting costs no more than composing); that is the size anything walking the
    loaded data would see.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._path: list = []  # the key path of the node being composed
        self._depth = 0  # nodes being composed, keys included
        self._open_anchors: list = []  # anchors of the collections being composed
        self._sizes: dict = {}  # id(node) -> (values when expanded, depth when expanded)

    def compose_node(self, parent, index):
        if isinstance(parent, yaml.SequenceNode):
            part = index
        elif isinstance(parent, yaml.MappingNode) and isinstance(index, yaml.ScalarNode):
            part = index.value
        else:
            part = None  # the root, or a mapping's key itself: it sits at its mapping's path
        if part is not None:
            self._path.append(part)
        self._depth += 1
        try:
            return self._compose_counted(parent, index)
        finally:
            self._depth -= 1
            if part is not None:
                self._path.pop()

    def _compose_counted(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) and event.anchor in self._open_anchors:
            raise _Refused(
                event.start_mark,
                tuple(self._path),
                f"the alias *{event.anchor} sits inside the collection its anchor &{event.anchor} names, which "
                "would make a value that contains itself: copy the values instead",
            )
        if self._depth > MAX_DEPTH:
            raise _Refused(event.start_mark, tuple(self._path), f"nested more than {MAX_DEPTH} levels deep")
        anchor = getattr(event, "anchor", None)
        collection = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if collection and anchor is not None:
            self._open_anchors.append(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            if collection and anchor is not None:
                self._open_anchors.pop()
        self._count(node, event.start_mark)
        return node

    def _count(self, node, mark) -> None:
        """Records the node's expanded size and height; refuses it beyond the limits."""
        known = self._sizes.get(id(node))  # set for an alias: its node was composed already
        if known is None:
            if isinstance(node, yaml.ScalarNode):
                children = []
            elif isinstance(node, yaml.SequenceNode):
                children = node.value
            else:
                children = [child for pair in node.value for child in pair]
            counted = [self._sizes[id(child)] for child in children]
            known = (1 + sum(size for size, _ in counted), 1 + max((height for _, height in counted), default=0))
            self._sizes[id(node)] = known
        size, height = known
        if size > MAX_NODES:
            raise _Refused(
                mark,
                tuple(self._path),
                f"this value expands to more than {MAX_NODES:,} values (aliases counted in full): "
                "a recipe is small, refusing it",
            )
        if self._depth + height - 1 > MAX_DEPTH:
            raise _Refused(
                mark, tuple(self._path), f"nested more than {MAX_DEPTH} levels deep once its aliases are expanded"
            )

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen: dict = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                what = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
                raise _Refused(key_node.start_mark, tuple(self._path), f"a key must be a plain name, not a {what}")
            if key_node.tag == _MERGE_TAG:
                continue
            identity = self._key_identity(key_node)
            line = key_node.start_mark.line + 1
            if identity in seen:
                raise _Refused(
                    key_node.start_mark,
                    tuple(self._path) + (key_node.value,),
                    f"duplicate key {key_node.value!r}: it is on line {seen[identity]} and again on line {line} "
                    "(YAML would keep only the last one): keep one",
                )
            seen[identity] = line
        return node

    def _key_identity(self, key_node):
        """The key as the built dict will hold it (``yes``, ``true`` and ``1`` are one key), else its text."""
        try:
            key = self.construct_object(key_node)
            hash(key)
        except Exception:  # noqa: BLE001 - an unconstructible key is reported by the constructor later
            return ("text", key_node.tag, key_node.value)
        return ("value", key)


def parse(text: str, path: str) -> tuple:
    """``(data, lines)``: the YAML document in ``text`` and ``{key path: line}`` for every key and item."""
    loader = _RecipeLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except _Refused as refused:
        key = refused.key if len(refused.key) <= 8 else refused.key[:8]  # a path 50 levels deep says little
        shown = format_key(key) + ("..." if len(key) < len(refused.key) else "")
        raise RecipeError(path, refused.mark.line + 1, shown, refused.message) from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        raise RecipeError(where, None, "", f"YAML syntax error: {error.problem or error}") from None
    except yaml.YAMLError as error:  # e.g. a reader error without a mark
        raise RecipeError(path, None, "", f"YAML error: {str(error).splitlines()[0]}") from None
    finally:
        loader.dispose()
    lines: dict = {}
    if root is not None:
        _record_lines(root, (), lines)
    return data, lines


def parse_value(raw: str, path: str, key: str):
    """A ``--set`` value read as YAML, under the same limits as a file."""
    if not raw.strip():
        return ""
    try:
        check_characters(raw, path)
        data, _ = parse(raw, path)
    except RecipeError as error:
        shown = repr(raw) if len(raw) <= 60 else repr(raw[:57]) + "..."
        raise RecipeError(path, None, "--set " + key, f"cannot parse the value {shown}: {error.message}") from None
    return data


def _record_lines(node, key: tuple, lines: dict) -> None:
    # Bounded: the loader refused anything deeper than MAX_DEPTH or larger than MAX_NODES.
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = key + (key_node.value,)
            lines[child] = key_node.start_mark.line + 1  # a key merged in (<<) and then set: the last one
            _record_lines(value_node, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = key + (index,)
            lines[child] = item.start_mark.line + 1
            _record_lines(item, child, lines)
