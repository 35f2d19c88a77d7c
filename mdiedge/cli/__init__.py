"""The ``mdiedge`` command line: thin typer commands; errors become one line and an exit code.

torch is imported only inside commands, so ``mdiedge --help`` answers fast. Each module below
registers its commands on :data:`app`; ``console`` writes what a terminal shows (progress, timing
lines, the status table). The top layer: it may import any package, none imports it."""
from __future__ import annotations

# registered in the order ``mdiedge --help`` lists them
from . import generate, chat, serve, nodes, status, bench, perplexity, earlyexit, config  # noqa: I001
from . import install
from .app import app, run_app

# imported for their commands, which they register on ``app``
COMMAND_MODULES = (generate, chat, serve, nodes, status, bench, perplexity, earlyexit, config,
                   install)

__all__ = ["app", "main"]


def main() -> None:
    run_app()


if __name__ == "__main__":
    main()
