"""Import direction: every module under mdiedge/ imports only from its own layer or below, no
modules import each other in a cycle, and layers 0 (base) and 2 (runtime) do not import torch
when they are imported.

Read with ``ast`` (nothing is imported): module-level and function-level imports, absolute and
relative (``from . import x``, ``from ..pkg import y``), ``if TYPE_CHECKING:`` imports, and
dynamic loads: ``importlib.import_module("literal")`` / ``__import__("literal")`` are edges like
imports, and a dynamic load whose module is not one literal absolute name (built at run time,
relative to a package, passed on as a variable) is an error, since the graph cannot see where it
goes. Each import resolves to its target module: ``from pkg import name`` is the module
``pkg.name`` when that file exists, else ``pkg``. An import of a package is an edge to its
``__init__`` only, not to the packages above it that Python initialises on the way.

The checker is a pure function of a table (``LAYERS``) and the sources; test_checker_* run it on
synthetic packages so that it is seen to fail.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent

# (pattern, layer): "pkg.sub.*" is the subpackage pkg.sub and every module below it; any other
# pattern is one module. The most specific pattern wins; a module that none matches is an error.
LAYERS: Tuple[Tuple[str, int], ...] = (
    ("mdiedge", 0),              # __init__.py: the version only
    ("mdiedge.base.*", 0),       # errors, defaults, dtypes, nodes, accel, settings, ringfile
    ("mdiedge.model.*", 1),      # config, layers, transformer, moe, checkpoint, tokenizer, ...
    ("mdiedge.runtime.*", 2),    # scheduler, stages, generation, framing, links, ring, control
    ("mdiedge.placement.*", 3),  # partition, balance
    ("mdiedge.roles.*", 4),      # starter, worker, membership, local rings of workers
    ("mdiedge.engine.*", 5),     # engine, opening, local, ring
    ("mdiedge.serving.*", 6),    # api, service, units, sdnotify
    ("mdiedge.tools.*", 6),      # bench, profile, roofline, quality, earlyexit, relay, configdoc
    ("mdiedge.cli.*", 7),
    ("mdiedge.__main__", 7),
)

# Layers whose modules may import torch only inside functions (or under TYPE_CHECKING): base,
# and the runtime, which a CPU node runs without torch (tests/test_numpy_runtime.py checks
# that importing it pulls no torch in through the model layer either).
NO_TORCH_AT_IMPORT: Tuple[int, ...] = (0, 2)
HEAVY = ("torch",)


class Source(NamedTuple):
    path: str          # for messages, e.g. "mdiedge/base/ringfile.py"
    text: str
    is_package: bool   # an __init__.py


class Import(NamedTuple):
    importer: str      # dotted module name
    target: str        # dotted module name (resolved)
    line: int
    in_function: bool  # runs when the function runs, not when the module is imported
    type_checking: bool  # under ``if TYPE_CHECKING:``: never runs


def _matches(pattern: str, name: str) -> int:
    """Specificity of ``pattern`` for ``name`` (dots + 1), or 0 when it does not match."""
    if pattern.endswith(".*"):
        package = pattern[:-2]
        if name == package or name.startswith(package + "."):
            return package.count(".") + 1
        return 0
    return pattern.count(".") + 2 if name == pattern else 0  # one module beats its package


def layer_of(name: str, layers: Sequence[Tuple[str, int]]) -> Optional[int]:
    best, found = 0, None
    for pattern, layer in layers:
        score = _matches(pattern, name)
        if score > best:
            best, found = score, layer
    return found


def _roots(layers: Sequence[Tuple[str, int]]) -> Set[str]:
    return {pattern.split(".")[0] for pattern, _ in layers}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


DYNAMIC_LOADERS = ("import_module", "__import__")


def _dynamic_load(node: ast.Call) -> Optional[Tuple[Optional[str], str]]:
    """For ``importlib.import_module(...)`` / ``import_module(...)`` / ``__import__(...)``:
    (the module when it is one literal absolute name, else None; the loader's name). None for
    any other call."""
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(
        func, ast.Attribute) else ""
    if name not in DYNAMIC_LOADERS:
        return None
    arg = node.args[0] if node.args else next(
        (k.value for k in node.keywords if k.arg == "name"), None)
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
            and arg.value and not arg.value.startswith("."):
        return arg.value, name
    return None, name


class _Collector(ast.NodeVisitor):
    def __init__(self, name: str, source: Source, modules: Iterable[str]) -> None:
        self.name, self.source, self.modules = name, source, set(modules)
        self.package = name if source.is_package else name.rpartition(".")[0]
        self.imports: List[Import] = []
        self.problems: List[str] = []
        self.depth = 0  # functions entered
        self.guarded = 0  # TYPE_CHECKING blocks entered

    def _add(self, target: str, line: int) -> None:
        self.imports.append(Import(self.name, target, line, self.depth > 0, self.guarded > 0))

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self.guarded += 1
        for child in node.body:
            self.visit(child)
        self.guarded -= 1
        for child in node.orelse:  # the else branch runs
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".") if self.package else []
            if node.level - 1 >= len(parts):
                self.problems.append(f"{self.source.path}:{node.lineno} relative import beyond "
                                     f"the top-level package")
                return
            base = ".".join(parts[:len(parts) - (node.level - 1)])
            if node.module:
                base = f"{base}.{node.module}"
        else:
            base = node.module or ""
        targets = []
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            target = candidate if alias.name != "*" and candidate in self.modules else base
            if target not in targets:
                targets.append(target)
        for target in targets:
            self._add(target, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        load = _dynamic_load(node)
        if load is not None and load[0] is not None:
            self._add(load[0], node.lineno)
        elif load is not None:
            self.problems.append(f"{self.source.path}:{node.lineno} {load[1]}() of a name that is "
                                 f"not one literal absolute module name: the import graph cannot "
                                 f"see it (import the module by its name)")
        self.generic_visit(node)


def collect_imports(name: str, source: Source, modules: Iterable[str]
                    ) -> Tuple[List[Import], List[str]]:
    """The imports of one module (resolved against ``modules``, the known dotted names), and
    problems found reading it."""
    try:
        tree = ast.parse(source.text, filename=source.path)
    except SyntaxError as e:
        return [], [f"{source.path}:{e.lineno} does not parse: {e.msg}"]
    collector = _Collector(name, source, modules)
    collector.visit(tree)
    return collector.imports, collector.problems


def _where(imp: Import) -> str:
    if imp.type_checking:
        return " [under TYPE_CHECKING]"
    return " [in a function]" if imp.in_function else ""


def _describe(imp: Import, sources: Mapping[str, Source], note: str = "") -> str:
    """``path:line imports target`` + ``note`` + where it runs."""
    return f"{sources[imp.importer].path}:{imp.line} imports {imp.target}{note}{_where(imp)}"


def _cycles(edges: Mapping[str, Mapping[str, Import]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, {})):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def _shortest_cycle(component: List[str], edges: Mapping[str, Mapping[str, Import]]
                    ) -> List[Import]:
    """One shortest cycle through the first module of a strongly connected component."""
    start, members = component[0], set(component)
    previous: Dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt, imp in sorted(edges.get(node, {}).items()):
                if nxt not in members or nxt in previous:
                    continue
                previous[nxt] = imp
                if nxt == start:
                    path = [imp]
                    while path[-1].importer != start:
                        path.append(previous[path[-1].importer])
                    return path[::-1]
                following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def check(sources: Mapping[str, Source], layers: Sequence[Tuple[str, int]] = LAYERS,
          no_torch_at_import: Sequence[int] = NO_TORCH_AT_IMPORT) -> List[str]:
    """Every problem in ``sources`` (dotted module name -> Source): modules the layer table
    does not place, upward imports, import cycles, heavy imports at import time in the layers
    that must not have them. An empty list is a pass."""
    problems: List[str] = []
    roots = _roots(layers)
    edges: Dict[str, Dict[str, Import]] = {}
    for name in sorted(sources):
        source = sources[name]
        own = layer_of(name, layers)
        if own is None:
            problems.append(f"{source.path}: module {name} is in no layer of the table")
        imports, found = collect_imports(name, source, sources)
        problems.extend(found)
        for imp in imports:
            top = imp.target.split(".")[0]
            if top in HEAVY and own in no_torch_at_import and not imp.in_function \
                    and not imp.type_checking:
                problems.append(f"{source.path}:{imp.line} imports {imp.target} at import time "
                                f"(layer {own} must import {top} only inside functions)")
            if top not in roots:
                continue
            target_layer = layer_of(imp.target, layers)
            if target_layer is None:
                problems.append(f"{_describe(imp, sources)}, which is in no layer of the table")
            elif own is not None and target_layer > own:
                problems.append(_describe(imp, sources, f" (layer {target_layer} > {own})"))
            if imp.target != name and imp.target in sources:
                previous = edges.setdefault(name, {}).get(imp.target)
                if previous is None or imp.line < previous.line:
                    edges[name][imp.target] = imp
    for component in _cycles(edges):
        steps = " -> ".join(_describe(imp, sources) for imp in _shortest_cycle(component, edges))
        problems.append(f"import cycle among {', '.join(component)}: {steps}")
    return problems


def load_sources(root: Path, package: str = "mdiedge") -> Dict[str, Source]:
    """Every module of ``package`` under ``root`` (the folder that holds the package)."""
    sources = {}
    for path in sorted((root / package).rglob("*.py")):
        relative = path.relative_to(root)
        parts = list(relative.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        sources[".".join(parts)] = Source(relative.as_posix(), path.read_text(encoding="utf-8"),
                                          is_package)
    return sources


# -- the package itself

def test_imports_go_down_the_layers_without_cycles() -> None:
    sources = load_sources(REPO)
    assert "mdiedge.base.errors" in sources and "mdiedge.cli" in sources
    problems = check(sources)
    table = "\n".join(f"  {pattern:<20} layer {layer}" for pattern, layer in LAYERS)
    assert not problems, (f"{len(problems)} import-layering problem(s):\n"
                          + "\n".join(problems)
                          + "\nimports must go down the layers (tests/test_layers.py LAYERS):\n"
                          + table)


# -- the checker on synthetic packages

SYNTHETIC_LAYERS = (("pkg", 0), ("pkg.low.*", 0), ("pkg.mid.*", 1), ("pkg.top", 2))


def synthetic(files: Mapping[str, str]) -> Dict[str, Source]:
    """{"pkg/low/a.py": source} -> sources; __init__.py files are added where missing."""
    texts = dict(files)
    for path in list(files):
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            texts.setdefault("/".join(parts[:i]) + "/__init__.py", "")
    sources = {}
    for path, text in texts.items():
        parts = path[:-3].split("/")
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        sources[".".join(parts)] = Source(path, text, is_package)
    return sources


CASES = [
    ("downward, absolute and relative",
     {"pkg/low/a.py": "import os\nfrom . import b\nfrom .b import thing\n",
      "pkg/low/b.py": "thing = 1\n",
      "pkg/mid/c.py": "import pkg.low.a\nfrom ..low import b\nfrom .. import __version__\n",
      "pkg/top.py": "from pkg.mid import c\nfrom .mid.c import x\nfrom .low.a import *\n"},
     []),
    ("upward at module level",
     {"pkg/low/a.py": "import json\n\nfrom pkg.mid import c\n", "pkg/mid/c.py": ""},
     ["pkg/low/a.py:3 imports pkg.mid.c (layer 1 > 0)"]),
    ("upward inside a function, relative",
     {"pkg/low/a.py": "def f():\n    from ..mid.c import g\n    return g\n",
      "pkg/mid/c.py": "def g(): pass\n"},
     ["pkg/low/a.py:2 imports pkg.mid.c (layer 1 > 0) [in a function]"]),
    ("upward under TYPE_CHECKING, and its else branch",
     {"pkg/mid/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from .. import top\nelse:\n    import pkg.top as top\n",
      "pkg/top.py": ""},
     ["pkg/mid/c.py:3 imports pkg.top (layer 2 > 1) [under TYPE_CHECKING]",
      "pkg/mid/c.py:5 imports pkg.top (layer 2 > 1)"]),
    ("from a package, a subpackage or a name defined in it",
     {"pkg/low/a.py": "from .. import mid\nfrom ..mid import VALUE\n",
      "pkg/mid/__init__.py": "VALUE = 1\n"},
     ["pkg/low/a.py:1 imports pkg.mid (layer 1 > 0)",
      "pkg/low/a.py:2 imports pkg.mid (layer 1 > 0)"]),
    ("a literal import_module",
     {"pkg/low/a.py": "import importlib\nM = importlib.import_module('pkg.top')\n",
      "pkg/top.py": ""},
     ["pkg/low/a.py:2 imports pkg.top (layer 2 > 0)"]),
    ("a literal __import__ closes a cycle",
     {"pkg/mid/c.py": "from . import d\n",
      "pkg/mid/d.py": "def f():\n    return __import__(name='pkg.mid.c')\n"},
     ["import cycle among pkg.mid.c, pkg.mid.d: pkg/mid/c.py:1 imports pkg.mid.d -> "
      "pkg/mid/d.py:2 imports pkg.mid.c [in a function]"]),
    ("dynamic loads of names built at run time, relative or passed on",
     {"pkg/low/a.py": "import importlib\nTABLE = {'x': 'pkg.top'}\n"
                      "def f(n):\n    return importlib.import_module(TABLE[n])\n"
                      "def g(n):\n    return importlib.import_module(f'pkg.{n}')\n"
                      "def h():\n    return importlib.import_module('.b', __package__)\n"
                      "def i(n):\n    return __import__(n)\n",
      "pkg/low/b.py": "from importlib import import_module\nM = import_module(name='pkg.' + 'x')\n",
      "pkg/top.py": ""},
     [f"pkg/low/a.py:{line} {loader}() of a name that is not one literal absolute module name: "
      f"the import graph cannot see it (import the module by its name)"
      for line, loader in ((4, "import_module"), (6, "import_module"), (8, "import_module"),
                           (10, "__import__"))]
     + ["pkg/low/b.py:2 import_module() of a name that is not one literal absolute module "
        "name: the import graph cannot see it (import the module by its name)"]),
    ("a cycle inside one layer, closed by a function-level import",
     {"pkg/mid/c.py": "from .d import y\nx = 1\n",
      "pkg/mid/d.py": "from . import e\ny = 2\n",
      "pkg/mid/e.py": "def f():\n    from .c import x\n    return x\n"},
     ["import cycle among pkg.mid.c, pkg.mid.d, pkg.mid.e: pkg/mid/c.py:1 imports pkg.mid.d"
      " -> pkg/mid/d.py:1 imports pkg.mid.e -> pkg/mid/e.py:2 imports pkg.mid.c [in a function]"]),
    ("torch at import time in layer 0, and only there",
     {"pkg/low/a.py": "import torch.nn as nn\nfrom typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    import torch\n",
      "pkg/low/b.py": "def f():\n    import torch\n    return torch\n",
      "pkg/low/c.py": "class C:\n    from torch import Tensor\n",
      "pkg/mid/d.py": "import torch\n"},
     ["pkg/low/a.py:1 imports torch.nn at import time (layer 0 must import torch only inside "
      "functions)",
      "pkg/low/c.py:2 imports torch at import time (layer 0 must import torch only inside "
      "functions)"]),
    ("modules outside the table",
     {"pkg/extra.py": "", "pkg/low/a.py": "def f():\n    import pkg.extra\n"},
     ["pkg/extra.py: module pkg.extra is in no layer of the table",
      "pkg/low/a.py:2 imports pkg.extra [in a function], which is in no layer of the table"]),
    ("relative import beyond the top",
     {"pkg/low/a.py": "from ... import nothing\n"},
     ["pkg/low/a.py:1 relative import beyond the top-level package"]),
]


@pytest.mark.parametrize("files, expected", [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_checker_on_synthetic_packages(files: Mapping[str, str], expected: List[str]) -> None:
    assert check(synthetic(files), SYNTHETIC_LAYERS) == expected


@pytest.mark.parametrize("name, layer", [
    ("mdiedge", 0), ("mdiedge.base", 0), ("mdiedge.base.ringfile", 0), ("mdiedge.model.moe", 1),
    ("mdiedge.runtime._cframing", 2), ("mdiedge.placement.balance", 3),
    ("mdiedge.roles.starter", 4), ("mdiedge.engine.ring", 5), ("mdiedge.serving.sdnotify", 6),
    ("mdiedge.tools.bench", 6), ("mdiedge.cli", 7), ("mdiedge.__main__", 7), ("mdiedge.elsewhere", None),
    ("mdiedge.basement", None),
])
def test_layer_table(name: str, layer: Optional[int]) -> None:
    assert layer_of(name, LAYERS) == layer


def test_checker_reports_the_real_layer_numbers() -> None:
    sources = synthetic({
        "mdiedge/base/ringfile.py": "def f():\n    from ..roles.starter import W\n",
        "mdiedge/roles/starter.py": "W = 1\n"})
    assert check(sources) == [
        "mdiedge/base/ringfile.py:2 imports mdiedge.roles.starter (layer 4 > 0) [in a function]"]
