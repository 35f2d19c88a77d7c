"""What the command line shows on a terminal: the generation progress bar (tokens/s) and the
ring's status table. ``mdiedge.cli`` owns the commands; rich is imported only when drawn."""
from __future__ import annotations

import io
import os
import sys
from typing import Any, Callable, Dict, List, Optional

from ..base.defaults import SHOWN_SETUP_S
from ..base.humanize import block_range, plural

__all__ = ["Progress", "end_line", "print_status", "refused", "starter_nodes", "timing_line",
           "write_text"]

_line_open = False  # the last text write_text wrote ended mid-line


def write_text(text: str) -> None:
    """Flushed."""
    global _line_open
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
        _line_open = not text.endswith("\n")


def end_line() -> None:
    """Before an error line, end the terminal line the generated text left the cursor on; a file or
    pipe keeps the text as generated."""
    global _line_open
    if _line_open and sys.stdout.isatty():
        write_text("\n")
    _line_open = False


def timing_line(timing: Dict[str, Any], extra: str = "") -> str:
    """``[7 tokens in 0.61 s, 11.5 tok/s; set-up 3.07 s]`` then ``extra`` (the drawn seed), from
    ``--json``'s ``timing``."""
    setup = float(timing.get("setup_s") or 0.0)
    seconds = float(timing.get("generation_s", timing.get("total_s", 0.0)))
    line = (f"[{plural(int(timing['new_tokens']), 'token')} in {seconds:.2f} s, "
            f"{float(timing['tokens_per_s']):.1f} tok/s")
    line += f"; set-up {setup:.2f} s" if setup >= SHOWN_SETUP_S else ""
    return line + (f", {extra}]" if extra else "]")


class Progress:
    """On a terminal stderr: a spinner naming the phase, then a bar with tokens/s. With tokens
    streaming to a terminal stdout (``streaming``) it stops for good at the first token, never
    drawing over the text."""

    def __init__(self, total: int, enabled: bool, streaming: bool = False) -> None:
        self.total, self.enabled, self.bar = total, enabled and sys.stderr.isatty(), None
        self.streaming = streaming and sys.stdout.isatty()
        self.task: Any = None

    def __enter__(self) -> "Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn
            from rich.progress import Progress as Bar
            from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

            self.bar = Bar(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                           MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                           TimeElapsedColumn(), console=Console(file=sys.stderr),
                           transient=True, redirect_stdout=False, redirect_stderr=False)
            self.bar.start()
            self.task = self.bar.add_task("loading", total=self.total, rate="")
        return self

    def phase(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=text)

    def advance(self, done: int, rate: float, description: str = "generating",
                total: Optional[int] = None) -> None:
        """``total``: a new one."""
        if self.bar is not None and self.streaming:
            self.stop()  # the text now owns the terminal
        elif self.bar is not None:
            self.bar.update(self.task, completed=done, rate=f"{rate:.1f} tok/s",
                            description=description, total=total)

    def write(self, text: str) -> None:
        """On the bar's terminal, above the bar, redrawn below."""
        if self.bar is None or not _same_terminal():
            write_text(text)
            return
        console = self.bar.console
        console.file = sys.stdout  # the bar's terminal: it clears the bar, writes, redraws
        try:
            console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        finally:
            console.file = sys.stderr

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _same_terminal() -> bool:
    try:
        return sys.stdout.isatty() and os.path.samestat(os.fstat(sys.stdout.fileno()),
                                                        os.fstat(sys.stderr.fileno()))
    except (OSError, ValueError):
        return False


# (header, value of a node's status) in the order of the wide table; DEFAULT: shown without
# --wide, in the order they are dropped last-first when the terminal is too narrow
def _mb(n: Any) -> str:
    return "-" if n is None else f"{n / 2 ** 20:.1f}"


def _out(node: Dict[str, Any]) -> Dict[str, Any]:
    return (node.get("links") or {}).get("out") or {}


COLUMNS: Dict[str, Callable[[Dict[str, Any]], str]] = {
    "node": lambda n: str(n.get("name", "?")),
    "role": lambda n: str(n.get("role", "?")),
    "address": lambda n: str(n.get("address", "?")),
    "state": lambda n: shown_state(n),
    "model": lambda n: str(n.get("model") or "-"),
    "hash": lambda n: (n.get("hash") or "-")[:12],
    "layers": lambda n: block_range(n.get("layers")),
    "device": lambda n: str(n.get("device") or "-"),
    "threads": lambda n: str(n.get("threads") or "-"),
    "RSS MB": lambda n: _mb(n.get("rss_bytes")),
    "weights MB": lambda n: _mb(n.get("weight_bytes")),
    "KV MB": lambda n: _mb(n.get("kv_bytes")),
    "slots": lambda n: str(n.get("slots_in_use", "-")),
    "messages": lambda n: str(n.get("messages", "-")),
    "tokens": lambda n: str(n.get("tokens", "-")),
    "busy": lambda n: f"{n['busy_fraction']:.2f}" if "busy_fraction" in n else "-",
    "rtt ms": lambda n: str(n.get("link_rtt_ms") or "-"),
    "link out": lambda n: str(_out(n).get("codec", "-")),  # the link to the next node
    "out frames": lambda n: str(_out(n).get("frames", "-")),
    "out KB": lambda n: f"{_out(n)['bytes'] / 1024:.1f}" if "bytes" in _out(n) else "-",
    "uptime s": lambda n: str(n.get("uptime_s", "-")),
    "recoveries": lambda n: str(n.get("recoveries", "-")) if n.get("role") == "starter" else "-",
    "version": lambda n: str(n.get("version", "-")),
    "code": lambda n: code_summary(n.get("code")),
    "OpenMP waits": lambda n: str(_code(n).get("openmp_waits", "-")),
    "cpu dot": lambda n: str(_code(n).get("cpu_dot", "-")),
    "decode": lambda n: decode_summary(n.get("decode")),
}
IDENTITY = ("node", "role", "address", "state")
DEFAULT = ("node", "state", "role", "address", "layers", "busy", "slots", "device", "threads",
           "RSS MB", "KV MB", "rtt ms")


def _code(node: Dict[str, Any]) -> Dict[str, Any]:
    code = node.get("code")
    return code if isinstance(code, dict) else {}


def decode_summary(route: Any) -> str:
    """``step`` where blocks and head both decode in the compiled step, else each part's route;
    ``-`` where unknown."""
    if not isinstance(route, dict):
        return "-"
    parts = {p: str(route[p]) for p in ("blocks", "head") if p in route}
    if not parts:
        return "-"
    if set(parts.values()) == {"step"}:
        return "step"
    return ", ".join(f"{p} {how}" for p, how in parts.items())


def code_summary(code: Any) -> str:
    """``compiled``, ``twins: step, quant`` (``quant (stale build)`` where its compiled module
    was built from other sources), or ``-`` where a node does not say."""
    modules = code.get("modules") if isinstance(code, dict) else None
    if not modules or not isinstance(modules, dict):
        return "-"
    twins = sorted(name + (" (stale build)" if "stale" in str(how) else "")
                   for name, how in modules.items() if how != "compiled")
    return "twins: " + ", ".join(twins) if twins else "compiled"


def shown_state(node: Dict[str, Any]) -> str:
    """A worker is ``busy`` while its links are up, generating or not: the table says ``linked``."""
    state = str(node.get("state", "?"))
    return "linked" if node.get("role") == "worker" and state == "busy" else state


def _table(nodes: List[Dict[str, Any]], columns: List[str]) -> Any:
    from rich.table import Table

    table = Table(title="mdiedge ring")
    for column in COLUMNS:
        if column in columns:
            table.add_column(column, no_wrap=True)
    for n in nodes:
        unread = n.get("state") in ("down", "unauthorized")  # its numbers are not known
        table.add_row(*("-" if unread and column not in IDENTITY else value(n)
                        for column, value in COLUMNS.items() if column in columns))
    return table


def _fitting(nodes: List[Dict[str, Any]], columns: List[str], width: int) -> List[str]:
    """The first of ``columns`` whose table fits ``width`` (at least 3)."""
    from rich.console import Console

    while len(columns) > 3:
        probe = Console(width=1000, file=io.StringIO(), color_system=None)
        probe.print(_table(nodes, columns))
        if max(len(line) for line in probe.file.getvalue().splitlines()) <= width:
            break
        columns = columns[:-1]
    return columns


def print_status(nodes: List[Dict[str, Any]], wide: bool = False) -> None:
    """Fitted to the terminal unless ``wide``; a line per node not up saying why; the experts' load.
    """
    from rich.console import Console

    from ..model import expertstats

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=240)  # a log or a pipe: do not truncate the columns
    columns = list(COLUMNS) if wide else _fitting(nodes, list(DEFAULT), console.width)
    if wide:
        console = Console(width=max(console.width, 1000), file=console.file, soft_wrap=True)
    console.print(_table(nodes, columns), crop=False)
    hidden = len(DEFAULT) - len(columns)
    if hidden > 0:
        console.print(f"({hidden} columns hidden at this width: --wide shows them all)",
                      markup=False, highlight=False)
    for n in nodes:
        if n.get("error"):
            console.print(f"{n.get('name', '?')}: {shown_state(n)}: {n['error']}", markup=False,
                          highlight=False, soft_wrap=True)
        if code_summary(n.get("code")).startswith("twins"):
            console.print(f"{n.get('name', '?')}: runs the pure-Python {code_summary(n['code'])}"
                          f" (many times slower), from {_code(n).get('package', '?')}",
                          markup=False, highlight=False, soft_wrap=True)
        reason = n.get("decode", {}).get("reason") if isinstance(n.get("decode"), dict) else None
        if reason:
            console.print(f"{n.get('name', '?')}: decodes in torch ({reason})", markup=False,
                          highlight=False, soft_wrap=True)
        if n.get("setup"):
            console.print(f"{n.get('name', '?')}: setting up the ring: waiting for "
                          f"{n['setup']}", markup=False, highlight=False, soft_wrap=True)
        if n.get("role") == "starter" and n.get("recoveries"):
            console.print(f"{n.get('name', '?')}: "
                          f"{plural(n['recoveries'], 'recovery', 'recoveries')} from lost "
                          f"workers since it started", markup=False, highlight=False)
    load = expertstats.merge(n.get("expert_load") or {} for n in nodes)
    if load:
        console.print("expert load since loading:")
        for line in expertstats.lines(load):
            console.print("  " + line)


def starter_nodes(url: str, given: str, auth: Any, api_key: Callable[[], Optional[str]]
                  ) -> List[Dict[str, Any]]:
    """From a starter's control plane, else its OpenAI API (a URL ending /v1 is its base;
    ``api_key()``); else the starter alone, ``down`` or (HTTP 401) ``unauthorized``, the reason in
    ``error``."""
    from ..base.errors import MdiedgeError
    from ..runtime.control import call, get_json, round_trip_ms

    try:
        return call(url, "GET", "/status", timeout=10, node="starter", auth=auth)["nodes"]
    except MdiedgeError as e:
        error = e
    if getattr(error, "status", None) in (401, 404) and round_trip_ms(url) is None:
        base = url[:-len("/v1")] if url.endswith("/v1") else url
        key = api_key()
        try:
            return get_json(base, "/status", {"Authorization": f"Bearer {key}"} if key else {},
                            10, f"starter ({base})")["nodes"]
        except MdiedgeError as e:
            error = e
    state = "unauthorized" if getattr(error, "status", None) == 401 else "down"
    return [{"role": "starter", "name": "starter", "address": given, "state": state,
             "error": str(error)}]


def refused(node: Dict[str, Any]) -> Dict[str, Any]:
    if node.get("state") == "down" and "refused (401)" in str(node.get("error")):
        node["state"] = "unauthorized"
    return node
