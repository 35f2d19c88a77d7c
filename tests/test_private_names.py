"""No package of mdiedge reaches for another package's private names (read with ``ast``).

The packages are the floors of tests/test_layers.py: cli, tools, serving, engine, roles,
placement, runtime, model, base (the top-level ``mdiedge`` and ``mdiedge.__main__`` are one
more). A name is private when it starts with one underscore (dunders such as ``__version__``
are not). Inside its own package a private name is free to use (the compiled twins ``_c*``,
``_py*`` and their ``_*constants`` are imported that way); from another package it is a problem:

- an import whose module path or imported name has a private part (``from ..roles.starter
  import _ring_rows``, ``import mdiedge.model._cstep``);
- an attribute ``obj._name`` (obj not ``self``, ``cls`` or ``super()``) where ``_name`` is
  defined in another package (assigned, a ``def`` or a ``class``, at module level, in a class
  or on ``self``) -- ``starter._setup_lock`` in the engine, ``transformer._step`` in the tools;
  a name defined only outside mdiedge (``os._exit``) is not ours to judge.

And above the engine (serving, tools, cli) nothing walks into an engine's parts -- its starter
(``engine.starter.x``), a ring's tail, a scheduler's pipeline or stages: the engine's public
methods say what such a caller may have.

The checker is a pure function of the sources; test_checker_* run it on synthetic packages so
that it is seen to fail.
"""
from __future__ import annotations

import ast
from typing import Dict, List, Mapping, Optional, Sequence, Set

import pytest

from test_layers import REPO, Source, load_sources, synthetic

PACKAGES = ("cli", "tools", "serving", "engine", "roles", "placement", "runtime", "model",
            "base")
ABOVE_THE_ENGINE = ("serving", "tools", "cli")
ENGINE_PARTS = ("tail", "pipeline", "stages")  # reached through an engine or its scheduler


def package_of(module: str) -> str:
    """``mdiedge.roles.starter`` -> ``roles``; the top-level modules -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in PACKAGES) else ""


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own attributes."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
        and node.func.id == "super"


def _defined(tree: ast.AST) -> Set[str]:
    """The private names a module defines: assigned, ``def``, ``class``, or set on self."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and _is_own(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if is_private(name)}


def _imported(node: ast.AST, module: str, is_package: bool) -> List[List[str]]:
    """The dotted paths (as parts) an import names: ``from a.b import c`` -> [a, b, c]."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".") for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = package[:len(package) - (node.level - 1)]
    else:
        base = []
    base = base + (node.module.split(".") if node.module else [])
    return [base + [alias.name] for alias in node.names if alias.name != "*"]


def _engine_part(node: ast.Attribute) -> Optional[str]:
    """``x.starter.y``, ``x.tail``, ``x.pipeline``, ``x.stages``: the part reached, or None."""
    if node.attr in ENGINE_PARTS and not _is_own(node.value):
        return node.attr
    if isinstance(node.value, ast.Attribute) and node.value.attr == "starter" \
            and not _is_own(node.value.value):
        return "starter"
    return None


def _dotted(node: ast.expr) -> str:
    """``a.b[0].c`` -> ``a.b.c`` (what is not a name or an attribute drops out)."""
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}".lstrip(".")
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    return node.id if isinstance(node, ast.Name) else ""


def _module_problems(name: str, source: Source, tree: ast.AST,
                     owners: Mapping[str, Set[str]]) -> List[str]:
    own = package_of(name)
    problems = []
    for node in sorted(ast.walk(tree), key=lambda n: (getattr(n, "lineno", 0),
                                                      getattr(n, "col_offset", 0))):
        where = f"{source.path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for parts in _imported(node, name, source.is_package):
                target = ".".join(parts)
                if parts[0] != "mdiedge" or package_of(target) == own:
                    continue
                private = [part for part in parts[1:] if is_private(part)]
                if private:
                    problems.append(f"{where} imports {target}: {private[0]} is private to "
                                    f"mdiedge.{package_of(target) or '(top)'}")
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and not _is_own(
                node.value):
            others = sorted(p for p, names in owners.items() if node.attr in names and p != own)
            if others:
                problems.append(f"{where} reaches for {node.attr}, private to mdiedge."
                                f"{others[0] or '(top)'}")
        if own in ABOVE_THE_ENGINE and isinstance(node, ast.Attribute):
            part = _engine_part(node)
            if part is not None:
                problems.append(f"{where} walks into an engine's {part} ({_dotted(node)}): "
                                f"ask the engine by a public method")
    return problems


def check(sources: Mapping[str, Source]) -> List[str]:
    """Every reach for another package's private names in ``sources`` (dotted module name ->
    Source), and every walk into an engine's parts from above it. An empty list is a pass."""
    trees = {name: ast.parse(source.text, filename=source.path)
             for name, source in sources.items()}
    owners: Dict[str, Set[str]] = {}
    for name, tree in trees.items():
        owners.setdefault(package_of(name), set()).update(_defined(tree))
    problems: List[str] = []
    for name in sorted(sources):
        problems.extend(_module_problems(name, sources[name], trees[name], owners))
    return problems


def test_no_package_reaches_for_another_packages_private_names() -> None:
    sources = load_sources(REPO)
    assert "mdiedge.roles.starter" in sources and "mdiedge.tools.bench" in sources
    problems = check(sources)
    assert not problems, (f"{len(problems)} reach(es) past a package's public names:\n"
                          + "\n".join(problems)
                          + "\ngive the owner a public name or method for what is needed")


# -- the checker on synthetic packages

def _mdiedge(files: Mapping[str, str]) -> Dict[str, Source]:
    return synthetic({f"mdiedge/{path}": text for path, text in files.items()})


CASES = [
    ("own package and public names",
     {"roles/starter.py": "def _rows(): pass\nclass S:\n    def __init__(self):\n"
                          "        self._lock = 1\n    def f(self):\n        return self._lock\n",
      "roles/local.py": "from .starter import _rows\nfrom . import _cstep\n"
                        "def g(s):\n    return s._lock\n",
      "engine/ring.py": "import os\nfrom .. import __version__\nfrom ..roles.starter import S\n"
                        "def h(s):\n    os._exit(0)\n    return super()._x, s.rows()\n",
      "tools/bench.py": "def b(settings):\n    return settings.starter\n"},
     []),
    ("private names imported from another package",
     {"roles/starter.py": "def _rows(): pass\n", "model/_cstep.py": "",
      "engine/ring.py": "from ..roles.starter import _rows\n",
      "tools/quality.py": "def f():\n    from mdiedge.model import _cstep\n"
                          "    import mdiedge.model._cstep\n"},
     ["mdiedge/engine/ring.py:1 imports mdiedge.roles.starter._rows: _rows is private to "
      "mdiedge.roles",
      "mdiedge/tools/quality.py:2 imports mdiedge.model._cstep: _cstep is private to "
      "mdiedge.model",
      "mdiedge/tools/quality.py:3 imports mdiedge.model._cstep: _cstep is private to "
      "mdiedge.model"]),
    ("private attributes of another package's objects and modules",
     {"roles/starter.py": "class S:\n    def __init__(self):\n        self._lock = 1\n",
      "model/transformer.py": "_step = 1\n",
      "engine/ring.py": "class R:\n    def __init__(self, s):\n        self._lock = s._lock\n",
      "tools/profile.py": "from ..model import transformer\nX = transformer._step\n"},
     ["mdiedge/engine/ring.py:3 reaches for _lock, private to mdiedge.roles",
      "mdiedge/tools/profile.py:2 reaches for _step, private to mdiedge.model"]),
    ("an engine's parts walked into from above it",
     {"tools/bench.py": "def f(engine, scheduler):\n    engine.starter.tail.ping(1)\n"
                        "    engine.starter.node_status()\n"
                        "    return scheduler.pipeline.stages[0]\n",
      "engine/ring.py": "def g(engine):\n    return engine.starter.tail\n"},
     [f"mdiedge/tools/bench.py:{line} walks into an engine's {part} ({chain}): ask the engine "
      f"by a public method" for line, part, chain in (
          (2, "tail", "engine.starter.tail"), (3, "starter", "engine.starter.node_status"),
          (4, "stages", "scheduler.pipeline.stages"), (4, "pipeline", "scheduler.pipeline"))]),
]


@pytest.mark.parametrize("files, expected", [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_checker_on_synthetic_packages(files: Mapping[str, str], expected: Sequence[str]
                                       ) -> None:
    assert check(_mdiedge(files)) == expected


@pytest.mark.parametrize("module, package", [
    ("mdiedge", ""), ("mdiedge.__main__", ""), ("mdiedge.cli", "cli"),
    ("mdiedge.roles.starter", "roles"), ("mdiedge.serving.api.app", "serving")])
def test_package_of(module: str, package: str) -> None:
    assert package_of(module) == package
