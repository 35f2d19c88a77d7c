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

import pytest

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


def _computed(value: ast.expr, names: Mapping[str, List[ast.expr]], depth: int = 0) -> bool:
    """Whether ``value`` is made only of ``busy_fraction(...)`` calls (in lists, sums of lists,
    conditionals, names assigned such values) and zeros."""
    if depth > 8:
        return False
    again = lambda v: _computed(v, names, depth + 1)  # noqa: E731
    if isinstance(value, ast.Call):
        return _base_name(value.func) == "busy_fraction"
    if isinstance(value, ast.Constant):
        return value.value == 0
    if isinstance(value, ast.List):
        return all(again(e) for e in value.elts)
    if isinstance(value, ast.ListComp):
        return again(value.elt)
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        return again(value.left) and again(value.right)
    if isinstance(value, ast.IfExp):
        return again(value.body) and again(value.orelse)
    if isinstance(value, ast.Name):
        return bool(names.get(value.id)) and all(again(v) for v in names[value.id])
    return False


def busy_fractions_not_from_the_function(sources: Mapping[str, str]) -> List[str]:
    """Every value given to ``busy_fraction`` (a keyword, an attribute, a dict key) that is not
    computed by the function ``busy_fraction`` of ``mdiedge/runtime/protocol.py``."""
    problems = []
    for path, text in sources.items():
        tree = ast.parse(text, filename=path)
        for scope in [tree] + [n for n in ast.walk(tree)
                               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            names: Dict[str, List[ast.expr]] = {}
            given: List[Tuple[int, ast.expr]] = []
            for node in ast.walk(scope):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            names.setdefault(target.id, []).append(node.value)
                        elif isinstance(target, ast.Attribute) and target.attr == "busy_fraction":
                            given.append((node.lineno, node.value))
                elif isinstance(node, ast.keyword) and node.arg == "busy_fraction":
                    given.append((node.value.lineno, node.value))
                elif isinstance(node, ast.Dict):
                    given.extend((v.lineno, v) for k, v in zip(node.keys, node.values)
                                 if isinstance(k, ast.Constant) and k.value == "busy_fraction")
            problems.extend(f"{path}:{line} busy_fraction is not computed by busy_fraction()"
                            for line, value in given if not _computed(value, names))
    return sorted(set(problems))


def test_busy_fraction_has_one_meaning() -> None:
    problems = busy_fractions_not_from_the_function(package_sources())
    assert not problems, "\n".join(problems)


def test_checker_finds_busy_fractions_computed_elsewhere() -> None:
    sources = {"mdiedge/roles/worker.py":
               "def status(s, c, wall):\n"
               "    s.busy_fraction = busy_fraction(c.compute_s, wall)\n"
               "    s.busy_fraction = round(c.compute_s / wall, 4) if wall > 0 else 0.0\n"
               "    busy = [busy_fraction(1, 2)] + [busy_fraction(a, 2) for a in c]\n"
               "    other = [c.compute_s / wall]\n"
               "    return {'busy_fraction': busy}, {'busy_fraction': other}, \\\n"
               "        NodeStatus(busy_fraction=0.0), NodeStatus(busy_fraction=c.cpu / 2)\n"}
    assert busy_fractions_not_from_the_function(sources) == [
        "mdiedge/roles/worker.py:3 busy_fraction is not computed by busy_fraction()",
        "mdiedge/roles/worker.py:6 busy_fraction is not computed by busy_fraction()",
        "mdiedge/roles/worker.py:7 busy_fraction is not computed by busy_fraction()"]


@pytest.mark.parametrize("compute_s, elapsed_s, fraction", [
    (0.0, 0.0, 0.0), (1.0, 0.0, 0.0), (1.0, -1.0, 0.0),  # no time yet (or a clock step)
    (0.5, 2.0, 0.25), (1.0, 3.0, 0.3333), (2.0, 2.0, 1.0),
    (2.1, 2.0, 1.0),  # two clocks: never more than all of the time
    (-0.1, 1.0, 0.0),
])
def test_busy_fraction(compute_s: float, elapsed_s: float, fraction: float) -> None:
    from mdiedge.runtime.protocol import busy_fraction

    assert busy_fraction(compute_s, elapsed_s) == fraction
