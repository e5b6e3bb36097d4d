"""The checker behind ``test_layering.py``: the packages' layers and privacy, read from the source.

Rules (each a way one part of the library could lean on another's inside):

1. **Layers.** A module imports its own package and the packages below it only: ``strategies`` is the
   lowest; ``data`` and ``optimizers`` stand on it (neither on the other); then ``trainer``, ``recipes``,
   ``cli``. Lazy imports inside functions count, and so do ``importlib.import_module`` calls with a literal
   name and reads of a higher package through the root (``replicafit.data``). The root package itself
   (``import replicafit``, which Python loads before any of its modules) may be imported anywhere; its
   torch-free helpers (``replicafit.lifeline``) sit below every layer. A ``__main__`` module is a program's
   entry point, never imported by the library: it may import anything.
2. **Privacy.** A module does not import another package's ``_``-prefixed names or modules, and does not
   read another package's objects' ``_`` attributes (``obj._read()``, ``getattr(obj, "_x")``), torch's and
   other libraries' included. An attribute counts as the module's own package's where that package
   defines the name (a ``def``, ``self._x = ...``, a class attribute). A class attribute may not imitate
   another package's private attribute (``_distribute_strategy = None`` to pass that package's check). A
   line that must read a private anyway says why, on the line: ``# private: <at least three words>``.
3. **Probes.** A module does not probe another package's objects with ``getattr(obj, "name", default)`` or
   ``hasattr`` for an attribute that package defines (``getattr(optimizer, "use_ema", False)``): the
   attribute is there to read, or it is a capability the lower layer declares. Names that objects from
   outside replicafit carry too (``EXTERNAL_PROTOCOL``: a tensor's ``shape``, a model's ``config``) are
   duck typing on a user's object, not probes.

Run ``python tests/layering.py [package ...]`` to list what breaks a rule now.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# package -> its layer. "base" is the root package's torch-free helpers, below every layer; "root" is the root's
# own __init__ and __main__, above every layer (it re-exports their everyday names).
PACKAGES = {"base": -1, "strategies": 0, "data": 1, "optimizers": 1, "trainer": 2, "recipes": 3, "cli": 4, "root": 5}
SOURCE = {
    "strategies": ROOT / "strategies",
    "data": ROOT / "data",
    "optimizers": ROOT / "optimizers",
    "trainer": ROOT / "trainer",
    "recipes": ROOT / "recipes",
    "cli": ROOT / "cli",
    "root": ROOT / "src" / "replicafit",
    "base": ROOT / "src" / "replicafit",
}
ROOT_MODULES = ("__init__.py", "__main__.py")  # the root package's own; its other modules are "base"

# Attribute names that objects from outside replicafit carry too (tensors, modules, data loaders, samplers,
# Hugging Face models and outputs, a user's factory or callback): a probe of one is duck typing.
EXTERNAL_PROTOCOL = frozenset({
    "shape", "dtype", "device", "name", "values", "weight", "weights", "forward", "config", "loss", "task", "seed",
    "dataset", "sampler", "batch_sampler", "generator", "in_order", "anchor", "best",
})  # fmt: skip

# namedtuple's documented methods start with "_" so as not to clash with field names: public API.
PUBLIC_UNDERSCORE = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})

REASON = re.compile(r"#\s*private:\s*(\S+\s+){2,}\S+")  # "# private: " and at least three words


@functools.lru_cache(maxsize=1)
def torch_privates() -> frozenset:
    """Private attributes of the torch objects the library reaches into (a ``DataLoader`` and its iterator, a
    tensor's version counter, ``torch.compile``'s wrapper): a read of one always says why, even where a
    package of ours has an attribute of the same name (``self._iterator``)."""
    import torch

    loader = torch.utils.data.DataLoader([0, 1], batch_size=1)
    names = set(vars(loader)) | set(dir(type(iter(loader)))) | {"_version", "_orig_mod"}
    return frozenset(n for n in names if _is_private(n))


@dataclasses.dataclass(frozen=True)
class Violation:
    path: str
    line: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.text}"


def package_of_module(name: str) -> str | None:
    """The package (``strategies``, ...) of a dotted module name; ``None`` outside replicafit."""
    parts = name.split(".")
    if parts[0] != "replicafit":
        return None
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return "root"
    return parts[1] if parts[1] in PACKAGES and parts[1] not in ("root", "base") else "base"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORE


def _python_files(package: str) -> list:
    base = SOURCE[package]
    if package in ("root", "base"):  # the root's own files only: its subpackages live in other folders
        return sorted(p for p in base.glob("*.py") if (p.name in ROOT_MODULES) == (package == "root"))
    return sorted(p for p in base.rglob("*.py") if "__pycache__" not in p.parts) if base.exists() else []


def _module_name(package: str, path: pathlib.Path) -> str:
    parts = list(path.relative_to(SOURCE[package]).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    prefix = ["replicafit"] if package in ("root", "base") else ["replicafit", package]
    return ".".join(prefix + parts)


@dataclasses.dataclass
class Definitions:
    """The names a package defines: ``strong`` (``def``/class names, ``self._x``/``cls._x`` assignments, module
    globals, arguments, ``setattr``, ``__slots__``), ``class_body`` (class attributes), ``public`` (the public
    attributes of its classes: what a probe asks for)."""

    strong: set = dataclasses.field(default_factory=set)
    class_body: dict = dataclasses.field(default_factory=dict)  # name -> [(path, line)]
    public: set = dataclasses.field(default_factory=set)

    @property
    def private(self) -> set:
        return {n for n in self.strong | set(self.class_body) if _is_private(n)}


def definitions(modules: list) -> Definitions:
    found = Definitions()
    for path, tree, lines in modules:
        for node in tree.body:  # module globals
            for target in _assigned(node):
                if isinstance(target, ast.Name):
                    found.strong.add(target.id)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.strong.add(node.name)
                if not isinstance(node, ast.ClassDef):
                    found.strong.update(a.arg for a in node.args.args + node.args.kwonlyargs)
            elif isinstance(node, ast.Call) and _call_name(node) == "setattr" and len(node.args) >= 2:
                if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                    found.strong.add(node.args[1].value)
            for target in _assigned(node):
                for item in ast.walk(target):
                    if not isinstance(item, ast.Attribute):
                        continue
                    mine = isinstance(item.value, ast.Name) and item.value.id in ("self", "cls")
                    if mine:
                        found.public.add(item.attr)
                    # Any object's attribute the package sets defines it (its own mark on a tensor), except where
                    # the line says it writes another's private (a torch loader's iterator).
                    if mine or not _has_reason(lines, node.lineno):
                        found.strong.add(item.attr)
                if isinstance(target, ast.Name) and target.id == "__slots__":
                    for item in ast.walk(node.value):
                        if isinstance(item, ast.Constant) and isinstance(item.value, str):
                            found.strong.add(item.value)
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found.public.add(statement.name)
                    for target in _assigned(statement):
                        if isinstance(target, ast.Name):
                            found.class_body.setdefault(target.id, []).append((path, statement.lineno))
                            found.public.add(target.id)
    found.public = {n for n in found.public if not n.startswith("_")}
    return found


def _assigned(node) -> list:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _comment_start(line: str) -> int | None:
    """Where the comment of a line of Python starts (a ``#`` outside string literals), or ``None``."""
    quote = None
    index = 0
    while index < len(line):
        char = line[index]
        if quote:
            if char == "\\":
                index += 2
                continue
            if line.startswith(quote, index):
                index += len(quote)
                quote = None
                continue
        elif char == "#":
            return index
        elif char in "'\"":
            quote = line[index : index + 3] if line[index : index + 3] in ('"""', "'''") else char
            index += len(quote)
            continue
        index += 1
    return None


def _has_reason(lines: list, lineno: int) -> bool:
    line = lines[lineno - 1]
    index = _comment_start(line)
    return index is not None and REASON.match(line[index:]) is not None


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _allowed(own: str, other: str | None) -> bool:
    if other is None or other == own or own == "root":
        return True
    return PACKAGES[other] < PACKAGES[own]


class _ModuleCheck(ast.NodeVisitor):
    def __init__(self, package, module, is_package, path, lines, own: Definitions, probed: dict, torch_names=()):
        self.torch_names = torch_names
        self.package, self.module, self.is_package = package, module, is_package
        self.path, self.lines = path, lines
        self.own_private, self.probed = own.private, probed
        self.entry_point = module.endswith(".__main__")
        self.root_names: set = set()  # local names bound to the root package (import replicafit)
        self.found: list = []

    def report(self, node, rule: str, exemptible: bool = True) -> None:
        if exemptible and _has_reason(self.lines, node.lineno):
            return
        self.found.append(Violation(self.path, node.lineno, rule, self.lines[node.lineno - 1].strip()))

    def _layer(self, node, target: str) -> None:
        if self.entry_point:
            return
        other = package_of_module(target)
        if target == "replicafit":  # the root package itself: loaded before any of its modules
            return
        if not _allowed(self.package, other):
            self.report(node, f"imports {target} (layer {other} is not below {self.package})", exemptible=False)

    def visit_Import(self, node):
        for alias in node.names:
            self._layer(node, alias.name)
            if alias.name == "replicafit":
                self.root_names.add(alias.asname or "replicafit")
            if package_of_module(alias.name) != self.package and any(_is_private(p) for p in alias.name.split(".")):
                self.report(node, f"imports the private module {alias.name}")
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        target = _resolve_from(self.module, self.is_package, node)
        if target == "replicafit":  # from replicafit import optimizers: the subpackages named
            for alias in node.names:
                self._layer(node, f"replicafit.{alias.name}")
                if _is_private(alias.name):
                    self.report(node, f"imports the root's private name {alias.name}")
            self.generic_visit(node)
            return
        self._layer(node, target)
        other = package_of_module(target)
        if other != self.package:
            names = [a.name for a in node.names if _is_private(a.name)]
            if names or any(_is_private(part) for part in target.split(".")):
                self.report(node, f"imports private names of {target}: {names or target}")
        self.generic_visit(node)

    def visit_Attribute(self, node):
        value = node.value
        if isinstance(value, ast.Name) and value.id in self.root_names and node.attr in PACKAGES:
            self._layer(node, f"replicafit.{node.attr}")  # a layer reached through the root's lazy attributes
        if _is_private(node.attr) and not (isinstance(value, ast.Name) and value.id in ("self", "cls")):
            is_super = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"
            if not is_super and node.attr in self.torch_names:
                self.report(node, f"reads {node.attr}, a private attribute of torch's objects")
            elif not is_super and node.attr not in self.own_private:
                self.report(node, f"reads {node.attr}, a private attribute {self.package} does not define")
        self.generic_visit(node)

    def visit_Call(self, node):
        name = _call_name(node)
        if isinstance(node.func, ast.Name) and name in ("getattr", "hasattr", "setattr", "delattr"):
            literal = len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
            if literal and isinstance(node.args[1].value, str):
                attr, target = node.args[1].value, node.args[0]
                mine = isinstance(target, ast.Name) and target.id in ("self", "cls")
                if _is_private(attr) and not mine and attr in self.torch_names:
                    self.report(node, f"{name}() of {attr!r}, a private attribute of torch's objects")
                elif _is_private(attr) and not mine and attr not in self.own_private:
                    self.report(node, f"{name}() of {attr!r}, a private attribute {self.package} does not define")
                probe = (name == "getattr" and len(node.args) == 3) or name == "hasattr"
                if probe and not mine and attr in self.probed:
                    owners = ", ".join(sorted(self.probed[attr]))
                    self.report(node, f"probes {attr!r} with {name}(), an attribute of {owners}: declare or read it")
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            if isinstance(node.args[0].value, str):
                self._layer(node, node.args[0].value)
        self.generic_visit(node)


@functools.cache
def _parsed(package: str) -> tuple:
    """``(path, code, tree)`` of every module of ``package`` (read once per process: the tests call ``check``
    many times)."""
    return tuple((str(p.relative_to(ROOT)), p.read_text(), ast.parse(p.read_text(), str(p))) for p in
                 _python_files(package))  # fmt: skip


@functools.cache
def _definitions(package: str) -> Definitions:
    return definitions([(path, tree, code.splitlines()) for path, code, tree in _parsed(package)])


def check(packages=None, sources: dict | None = None) -> list:
    """Every violation in ``packages`` (default: all). ``sources``: ``{(package, module name): code}`` checked
    as if they were modules of those packages too (the test's examples), their definitions included."""
    packages = list(packages or PACKAGES)
    torch_names = torch_privates()
    trees = {package: _parsed(package) for package in PACKAGES}
    extra = {}
    for (package, module), code in (sources or {}).items():
        extra.setdefault(package, []).append((module, f"<{module}>", code, ast.parse(code)))
    defined = {}
    for package, items in trees.items():
        if package not in extra:
            defined[package] = _definitions(package)
            continue
        modules = [(path, tree, code.splitlines()) for path, code, tree in items]
        modules += [(shown, tree, code.splitlines()) for _, shown, code, tree in extra[package]]
        defined[package] = definitions(modules)
    found: list = []
    for package in packages:
        own = defined[package]
        probed: dict = {}
        for other, names in ((o, d.public) for o, d in defined.items() if o not in (package, "root", "base")):
            for name in names - own.public - EXTERNAL_PROTOCOL:  # a name this package's objects have too: its own
                probed.setdefault(name, set()).add(other)
        modules = [(_module_name(package, ROOT / path), path.endswith("__init__.py"), path, code, tree)
                   for path, code, tree in trees[package]]  # fmt: skip
        modules += [(module, False, shown, code, tree) for module, shown, code, tree in extra.get(package, [])]
        texts = {path: code.splitlines() for _, _, path, code, _ in modules}
        for module, is_package, path, _code, tree in modules:
            visitor = _ModuleCheck(package, module, is_package, path, texts[path], own, probed, torch_names)
            visitor.visit(tree)
            found.extend(visitor.found)
        # A class attribute that imitates another package's private attribute (defined there, nowhere here else).
        others = set().union(*(d.private for o, d in defined.items() if o != package))
        for name, places in own.class_body.items():
            if _is_private(name) and name not in own.strong and name in others:
                for path, line in places:
                    lines = texts.get(path) or []
                    if lines and not _has_reason(lines, line):
                        rule = f"class attribute {name} imitates another package's private attribute"
                        found.append(Violation(path, line, rule, lines[line - 1].strip()))
    return found


if __name__ == "__main__":
    violations = check(sys.argv[1:] or None)
    for violation in violations:
        print(violation)
    print(f"{len(violations)} violations")
