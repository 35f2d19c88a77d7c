"""One source per fact, checked on the package's sources with ``ast`` (no torch): every
exception class is defined in ``mdiedge/base/errors.py`` and derives from ``MdiedgeError``;
every time limit (a module-level ``*_S``/``*_US`` name) and every port is defined in
``mdiedge/base/defaults.py``; ``busy_fraction`` is computed by one function. Each checker
also runs on a synthetic source, so that it is seen to fail."""
from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Tuple

REPO = Path(__file__).resolve().parent.parent
ERRORS = "mdiedge/base/errors.py"
DEFAULTS = "mdiedge/base/defaults.py"
BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)}


def package_sources() -> Dict[str, str]:
    return {p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8")
            for p in sorted((REPO / "mdiedge").rglob("*.py"))}


def _base_name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(
        node, ast.Attribute) else ""


def _classes(sources: Mapping[str, str]) -> Iterator[Tuple[str, int, str, List[str]]]:
    """(path, line, name, names of its bases) of every class, nested ones included."""
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text, filename=path)):
            if isinstance(node, ast.ClassDef):
                yield path, node.lineno, node.name, [_base_name(b) for b in node.bases]


def exception_classes(sources: Mapping[str, str]) -> List[Tuple[str, int, str, List[str]]]:
    """The classes that derive from an exception: a built-in one, one of another library
    (a base named ``...Error``/``...Exception``), or one of these classes (by name)."""
    classes = list(_classes(sources))
    known = set(BUILTIN_EXCEPTIONS)
    while True:
        found = {name for _, _, name, bases in classes
                 if any(b in known or b.endswith(("Error", "Exception")) for b in bases)}
        if found <= known:
            return [c for c in classes if c[2] in found]
        known |= found


def misplaced_exceptions(sources: Mapping[str, str]) -> List[str]:
    problems = []
    for path, line, name, bases in exception_classes(sources):
        if path != ERRORS:
            problems.append(f"{path}:{line} class {name}({', '.join(bases)}) is an exception "
                            f"outside {ERRORS}")
    hierarchy = {"MdiedgeError"}
    for path, line, name, bases in exception_classes(sources):
        if path == ERRORS and name != "MdiedgeError":
            if not hierarchy & set(bases):
                problems.append(f"{path}:{line} class {name} does not derive from MdiedgeError")
            hierarchy.add(name)
    return problems


def test_exceptions_are_defined_once_in_the_hierarchy() -> None:
    problems = misplaced_exceptions(package_sources())
    assert not problems, "\n".join(problems)


def test_checker_finds_exceptions_outside_errors() -> None:
    sources = {ERRORS: "class MdiedgeError(Exception):\n    pass\n"
                       "class RingError(MdiedgeError):\n    pass\n"
                       "class Stray(ValueError):\n    pass\n",
               "mdiedge/runtime/x.py": "from ..base.errors import RingError\n"
                                       "class Conflict(RingError):\n    pass\n"
                                       "class Deeper(Conflict):\n    pass\n"
                                       "class Plain:\n    pass\n",
               "mdiedge/ops/y.py": "import jinja2\ndef f():\n"
                                   "    class _Local(jinja2.TemplateError):\n        pass\n"}
    assert misplaced_exceptions(sources) == [
        "mdiedge/runtime/x.py:2 class Conflict(RingError) is an exception outside "
        "mdiedge/base/errors.py",
        "mdiedge/runtime/x.py:4 class Deeper(Conflict) is an exception outside "
        "mdiedge/base/errors.py",
        "mdiedge/ops/y.py:3 class _Local(TemplateError) is an exception outside "
        "mdiedge/base/errors.py",
        "mdiedge/base/errors.py:5 class Stray does not derive from MdiedgeError"]


FACT_NAME = re.compile(r"^[A-Z][A-Z0-9_]*(_S|_US)$|^([A-Z0-9_]+_)?PORTS?(_[A-Z0-9_]+)?$")


def _assigned_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _assigned_names(element)


def facts_outside_defaults(sources: Mapping[str, str]) -> List[str]:
    """Module-level (or class-level) constants named as time limits (``*_S``, ``*_US``) or
    ports (``*PORT*``) assigned anywhere but ``mdiedge/base/defaults.py``."""
    problems = []
    for path, text in sources.items():
        if path == DEFAULTS:
            continue
        tree = ast.parse(text, filename=path)
        scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for scope in scopes:
            for node in scope.body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                    if isinstance(node, ast.AnnAssign) and node.value is not None else []
                for name in (n for t in targets for n in _assigned_names(t)):
                    if FACT_NAME.match(name):
                        problems.append(f"{path}:{node.lineno} {name} is defined outside "
                                        f"{DEFAULTS}")
    return problems


def test_time_limits_and_ports_are_defined_in_defaults() -> None:
    problems = facts_outside_defaults(package_sources())
    assert not problems, "\n".join(problems)


def test_checker_finds_time_limits_and_ports_outside_defaults() -> None:
    sources = {DEFAULTS: "RING_TIMEOUT_S = 60.0\nAPI_PORT = 8000\n",
               "mdiedge/runtime/links.py": "from ..base.defaults import RING_TIMEOUT_S\n"
                                           "POLL_S, IDLE_POLL_S = 0.01, 0.2\n"
                                           "BUSY_US: int = 5\nclass C:\n    WAIT_S = 1\n"
                                           "def f():\n    LOCAL_S = 2\n",
               "mdiedge/cli/serve.py": "API_PORT = 8000\nSUPPORTED_MODEL_TYPES = ()\n"
                                       "REPORT = 1\n"}
    assert facts_outside_defaults(sources) == [
        "mdiedge/runtime/links.py:2 POLL_S is defined outside mdiedge/base/defaults.py",
        "mdiedge/runtime/links.py:2 IDLE_POLL_S is defined outside mdiedge/base/defaults.py",
        "mdiedge/runtime/links.py:3 BUSY_US is defined outside mdiedge/base/defaults.py",
        "mdiedge/runtime/links.py:5 WAIT_S is defined outside mdiedge/base/defaults.py",
        "mdiedge/cli/serve.py:1 API_PORT is defined outside mdiedge/base/defaults.py"]
