"""The README's config-key tables: every key of the settings schema, with what it takes, its
default and its meaning (from the ``mdiedge config init`` skeletons), and current."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Set

import pytest

from mdiedge.base import settings
from mdiedge.base.errors import ConfigError
from mdiedge.tools import configdoc

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_keys() -> Dict[str, Set[str]]:
    """The keys in each table of the README's config block, as its rows show them."""
    text = README.read_text(encoding="utf-8")
    block = text[text.index(configdoc.BEGIN):text.index(configdoc.END)]
    found: Dict[str, Set[str]] = {}
    table = ""
    for line in block.splitlines():
        heading = re.match(r"^`(\[\[?[a-z]+\]\]?)`:", line)
        row = re.match(r"^\| `([a-z_]+)` \|", line)
        if heading:
            table = heading.group(1)
        elif row:
            found.setdefault(table, set()).add(row.group(1))
    return found


@pytest.mark.parametrize("table, schema", [
    ("[worker]", settings.WORKER_SCHEMA), ("[starter]", settings.STARTER_SCHEMA),
    ("[[workers]]", settings.WORKERS_SCHEMA)])
def test_every_schema_key_is_in_the_readme(table: str, schema: Dict[str, object]) -> None:
    shown = readme_keys().get(table, set())
    assert set(schema) - shown == set(), f"keys missing from README's {table} table"
    assert shown - set(schema) == set(), f"README's {table} table shows keys the schema lacks"


def test_the_readme_tables_are_current() -> None:
    text = README.read_text(encoding="utf-8")
    block = text[text.index(configdoc.BEGIN):text.index(configdoc.END) + len(configdoc.END)]
    assert block == configdoc.markdown(), \
        "README config keys are stale: run python -m mdiedge.tools.configdoc --write README.md"


def test_meanings_are_the_first_sentence_above_each_key() -> None:
    skeleton = """\
# a file comment
[worker]
# Name shown in logs. More detail here.
name = "w1"
# A commented-out key, e.g. this
# one spanning lines.
# model = "/m"

# after a blank line the comment starts anew
# Only this counts.
threads = 0
plain = 1
[[workers]]
# The worker's host.
host = "h"
"""
    assert configdoc.meanings(skeleton) == {
        "[worker]": {"name": "Name shown in logs.",
                     "model": "A commented-out key, e.g. this one spanning lines.",
                     "threads": "after a blank line the comment starts anew Only this counts.",
                     "plain": ""},
        "[[workers]]": {"host": "The worker's host."}}


def test_a_key_the_skeleton_does_not_explain_fails() -> None:
    schema = {key: settings.WORKER_SCHEMA[key] for key in ("name", "threads")}
    with pytest.raises(ConfigError, match=r"^\[worker\] threads: no comment explains it"):
        configdoc.rows("[worker]", schema, settings.WorkerSettings,
                       '[worker]\n# The name.\nname = "w"\nthreads = 0\n')


@pytest.mark.parametrize("table, key, shown", [
    ("[worker]", "control_port", "`7700`"), ("[worker]", "insecure", "`false`"),
    ("[worker]", "log_level", '`"info"`'), ("[worker]", "model", "unset"),
    ("[starter]", "max_payload", "`67108864` (64.00 MiB)"), ("[starter]", "timeout_s", "`60`"),
    ("[[workers]]", "host", "required"), ("[[workers]]", "name", "`w1`, `w2`, ... in ring order")])
def test_defaults(table: str, key: str, shown: str) -> None:
    cls = {t: c for t, _, c, _, _ in configdoc.TABLES}[table]
    assert configdoc.default(table, key, cls) == shown


def test_expected_is_the_validators_own_words() -> None:
    assert configdoc.expected(settings.WORKER_SCHEMA["control_port"]) == "an integer 0..65535"
    assert configdoc.expected(settings.WORKER_SCHEMA["secret"]) == \
        f"a secret of at least {settings.MIN_SECRET_BYTES} bytes"
    with pytest.raises(ConfigError, match="accepts an empty string"):
        configdoc.expected(str)


def test_write_replaces_only_the_block(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text(f"intro\n{configdoc.BEGIN}\nold\n{configdoc.END}\noutro\n")
    assert configdoc.main(["--write", str(path)]) == 0
    assert path.read_text() == f"intro\n{configdoc.markdown()}\noutro\n"
    with pytest.raises(ConfigError, match="no config keys block"):
        configdoc.replace_block("no markers", "x")
