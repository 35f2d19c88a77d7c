"""What ``mdiedge bench`` shows: its table, a row on stdout as soon as each configuration is
measured (the header first), and on stderr what it is measuring while it waits."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Sequence, TextIO, Tuple

COLUMNS = ("nodes", "samples/msg", "tok/s", "decode tok/s", "limit tok/s", "share",
           "busy fraction per node",
           "hop µs",
           "peak RSS MB per node", "RSS − (weights+KV) MB")
RANGE_COLUMN = "decode min–max"  # after "decode tok/s" when each configuration runs repeatedly
# characters per node of the per-node columns (busy "0.93", RSS "1234", excess "-12")
_PER_NODE = {"busy fraction per node": 5, "peak RSS MB per node": 6, "RSS − (weights+KV) MB": 6}


def columns(repeat: int = 1) -> Tuple[str, ...]:
    """The table's columns: with ``repeat`` > 1, the decode tokens/s of the slowest and the
    fastest run beside the median run's."""
    if repeat <= 1:
        return COLUMNS
    at = COLUMNS.index("decode tok/s") + 1
    return COLUMNS[:at] + (RANGE_COLUMN,) + COLUMNS[at:]


def row_cells(result: Dict[str, Any]) -> List[str]:
    """One configuration's figures as the table's cells (a repeated one's with its range)."""
    cells = _cells(result)
    if "runs" in result:
        rates = [run["decode_tokens_per_s"] for run in result["runs"]]
        cells.insert(COLUMNS.index("decode tok/s") + 1, f"{min(rates):.1f}–{max(rates):.1f}")
    return cells


def _cells(result: Dict[str, Any]) -> List[str]:
    hop = "-" if result["hop_overhead_us"] is None else f"{result['hop_overhead_us']:.0f}"
    excess = [(rss - wk) / 2 ** 20
              for rss, wk in zip(result["peak_rss_bytes"], result["weight_kv_bytes"])]
    limit = result.get("roofline_tokens_per_s")
    return [str(result["nodes"]), str(result["micro_batch"]), f"{result['tokens_per_s']:.1f}",
            f"{result['decode_tokens_per_s']:.1f}", "-" if limit is None else f"{limit:.1f}",
            "-" if limit is None else f"{100 * result['roofline_share']:.0f}%",
            " ".join(f"{b:.2f}" for b in result["busy_fraction"]), hop,
            " ".join(f"{x / 2 ** 20:.0f}" for x in result["peak_rss_bytes"]),
            " ".join(f"{x:.0f}" for x in excess)]


def column_widths(max_nodes: int, repeat: int = 1) -> List[int]:
    """Widths fixed before the first row: each header, or the per-node figures of the
    largest ring, whichever is wider."""
    return [max(len(name), _PER_NODE.get(name, 0) * max_nodes - 1) for name in columns(repeat)]


def format_line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(cell.rjust(width) for cell, width in zip(cells, widths))


class TableWriter:
    """The table, line by line on ``out`` (stdout), each line flushed as it is written."""

    def __init__(self, title: str, max_nodes: int, out: Any = None, repeat: int = 1) -> None:
        self.title, self._out = title, out
        self.columns, self.widths = columns(repeat), column_widths(max_nodes, repeat)

    @property
    def out(self) -> TextIO:
        return self._out if self._out is not None else sys.stdout

    def _line(self, text: str) -> None:
        self.out.write(text.rstrip() + "\n")
        self.out.flush()

    def header(self) -> None:
        self._line(self.title)
        self._line(format_line(self.columns, self.widths))
        self._line(format_line(["-" * w for w in self.widths], self.widths))

    def row(self, result: Dict[str, Any]) -> None:
        self._line(format_line(row_cells(result), self.widths))

    def footer(self, results: Sequence[Dict[str, Any]]) -> None:
        """The experts' load of every configuration that has one (mixture-of-experts models)."""
        from ..model import expertstats

        for r in results:
            if r.get("expert_load"):
                self._line(f"expert load, {r['nodes']} node(s), {r['micro_batch']} sample(s) "
                           f"per message:")
                for line in expertstats.lines(r["expert_load"]):
                    self._line("  " + line)


@contextmanager
def measuring_on_stderr(what: str) -> Iterator[None]:
    """A spinner naming ``what`` on a terminal stderr, gone before anything else is printed;
    elsewhere (a log, a pipe) one line."""
    if not sys.stderr.isatty():
        sys.stderr.write(f"bench: {what}\n")
        sys.stderr.flush()
        yield
        return
    from rich.console import Console

    with Console(file=sys.stderr).status(what):
        yield
