"""``mdiedge config check|init``."""
from __future__ import annotations

from typing import Optional

import typer

from .app import app, one_line_errors
from .usage import ArgumentsCommand, CommandGroup

config_app = typer.Typer(cls=CommandGroup, help="Config files.", no_args_is_help=True,
                         rich_markup_mode=None)
app.add_typer(config_app, name="config")


@config_app.command("check", cls=ArgumentsCommand)
@one_line_errors
def config_check(file: str = typer.Argument(..., metavar="FILE",
                                            help="The TOML file to validate.")) -> None:
    """Validate a config file (its models and secret files are there; a ring names a
    secret); one line naming the file and key on error."""
    from ..base.settings import check_config
    from ..model.hub import resolve_model

    typer.echo(check_config(file, find_model=resolve_model))


@config_app.command("init", cls=ArgumentsCommand)
@one_line_errors
def config_init(
    kind: str = typer.Argument(..., metavar="KIND", help="worker, starter or ring."),
    name: str = typer.Option("w1", help="The worker's name; wN takes the N-th pair of ports "
                             "from 7700 (w2: 7702 and 7703), as the starter's and the ring's "
                             "skeletons name them."),
    secret_file: Optional[str] = typer.Option(None, help="The ring secret file the skeleton "
                                              "names, made (mode 0600) if missing (default: "
                                              "~/.config/mdiedge/secret)."),
) -> None:
    """Print a commented config skeleton of KIND that runs as written on this machine (its
    ring secret file made if missing; where, on stderr); redirect it into a file."""
    from pathlib import Path

    from ..base.defaults import default_cache_dir, default_secret_file
    from ..serving.skeletons import create_secret_file, skeleton

    secret = Path(secret_file).expanduser().absolute() if secret_file else default_secret_file()
    text = skeleton(kind, str(secret), str(default_cache_dir()), name)
    if create_secret_file(secret):
        typer.echo(f"mdiedge: wrote a new ring secret to {secret} (mode 0600)", err=True)
    else:
        typer.echo(f"mdiedge: the skeleton names the ring secret in {secret} (kept as it was)",
                   err=True)
    typer.echo(text, nl=False)
