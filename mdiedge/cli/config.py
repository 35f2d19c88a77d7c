"""``mdiedge config check|init``."""
from __future__ import annotations

import typer

from .app import app, one_line_errors, usage_errors
from .usage import ArgumentsCommand, CommandGroup

config_app = typer.Typer(cls=CommandGroup, help="Config files.", no_args_is_help=True,
                         rich_markup_mode=None)
app.add_typer(config_app, name="config")


@config_app.command("check", cls=ArgumentsCommand)
@one_line_errors
def config_check(file: str = typer.Argument(..., metavar="FILE",
                                            help="The TOML file to validate.")) -> None:
    """Validate a config file; one line naming the file and key on error."""
    from ..base.settings import check_config

    typer.echo(check_config(file))


@config_app.command("init", cls=ArgumentsCommand)
@one_line_errors
def config_init(kind: str = typer.Argument(..., metavar="KIND",
                                           help="worker, starter or ring.")) -> None:
    """Print a commented config skeleton of KIND: redirect it into a file and edit it."""
    from ..serving.units import skeleton

    with usage_errors():  # a KIND that is none of them
        text = skeleton(kind)
    typer.echo(text, nl=False)

