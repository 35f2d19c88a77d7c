"""What the command line shows on a terminal: the generation progress bar (tokens/s) and the
ring's status table. ``mdiedge.cli`` owns the commands; rich is imported only when drawn."""
from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress", "print_status"]


class Progress:
    """What a generation shows on stderr when it is a terminal: a spinner naming the phase
    (loading, starting nodes, prefill), then a bar with tokens/s. When the tokens stream to a
    terminal stdout (``streaming``), the display stops for good at the first token, so it
    never draws over the text; stdout is never redirected."""

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

    def advance(self, done: int, rate: float) -> None:
        if self.bar is not None and self.streaming:
            self.stop()  # the text now owns the terminal
        elif self.bar is not None:
            self.bar.update(self.task, completed=done, rate=f"{rate:.1f} tok/s",
                            description="generating")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __exit__(self, *exc: object) -> None:
        self.stop()


def print_status(nodes: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..model import expertstats

    def mb(n: Any) -> str:
        return "-" if n is None else f"{n / 2 ** 20:.1f}"

    table = Table(title="mdiedge ring")
    columns = ("node", "role", "address", "state", "model", "hash", "layers", "device", "RSS MB",
               "weights MB", "KV MB", "slots", "messages", "tokens", "busy", "rtt ms", "uptime s",
               "version")
    for column in columns:
        table.add_column(column)
    for n in nodes:
        layers = n.get("layers")
        table.add_row(
            n.get("name", "?"), n.get("role", "?"), n.get("address", "?"), n.get("state", "?"),
            str(n.get("model") or "-"), (n.get("hash") or "-")[:12],
            f"{layers[0]}-{layers[1]}" if layers else "-", str(n.get("device") or "-"),
            mb(n.get("rss_bytes")), mb(n.get("weight_bytes")), mb(n.get("kv_bytes")),
            str(n.get("slots_in_use", "-")), str(n.get("messages", "-")),
            str(n.get("tokens", "-")), f"{n['busy_fraction']:.2f}" if "busy_fraction" in n else "-",
            str(n.get("link_rtt_ms") or "-"), str(n.get("uptime_s", "-")), str(n.get("version", "-")))
    console = Console()
    if not console.is_terminal:
        console = Console(width=240)  # a log or a pipe: do not truncate the columns
    console.print(table)
    load = expertstats.merge(n.get("expert_load") or {} for n in nodes)
    if load:
        console.print("expert load since loading:")
        for line in expertstats.lines(load):
            console.print("  " + line)
