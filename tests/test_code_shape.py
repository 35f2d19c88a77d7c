"""Code shape of the package: no function over 60 lines, no class over 300, no file over 600.

A function or class is counted from its ``def``/``class`` line (decorators excluded) to its
last line, nested ones included in their parent and counted again on their own. No torch
needed."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "mdiedge"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
MAX_FILE_LINES = 600

Definition = Tuple[str, str, int]  # where ("mdiedge/x.py:12"), name, lines


def sources() -> List[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def definitions(path: Path, kinds: Tuple[type, ...]) -> Iterator[Definition]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, kinds):
            end = getattr(node, "end_lineno", None) or node.lineno
            yield f"{relative(path)}:{node.lineno}", node.name, end - node.lineno + 1


def too_long(kinds: Tuple[type, ...], limit: int) -> List[str]:
    return [f"{place} {name}: {lines} lines" for path in sources()
            for place, name, lines in definitions(path, kinds) if lines > limit]


def test_the_package_is_found() -> None:
    assert (PACKAGE / "__init__.py").is_file() and len(sources()) > 10


def test_functions_are_short() -> None:
    long = too_long((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_classes_are_short() -> None:
    long = too_long((ast.ClassDef,), MAX_CLASS_LINES)
    assert not long, f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(long)


def test_files_are_short() -> None:
    counts = [(relative(path), len(path.read_text(encoding="utf-8").splitlines()))
              for path in sources()]
    long = [f"{name}: {n} lines" for name, n in counts if n > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)
