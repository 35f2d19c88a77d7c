"""``mdiedge config check|init``."""
from __future__ import annotations

import typer

from .app import app, one_line_errors

config_app = typer.Typer(help="Config files.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(config_app, name="config")


@config_app.command("check")
@one_line_errors
def config_check(file: str = typer.Argument(..., help="The TOML file to validate.")) -> None:
    """Validate a config file; one line naming the file and key on error."""
    from ..base.settings import check_config

    typer.echo(check_config(file))


@config_app.command("init")
@one_line_errors
def config_init(kind: str = typer.Argument(..., help="worker, starter or ring.")) -> None:
    """Print a commented config skeleton of KIND: redirect it into a file and edit it."""
    from ..serving.units import skeleton

    typer.echo(skeleton(kind), nl=False)

