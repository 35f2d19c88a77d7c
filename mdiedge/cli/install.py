"""``mdiedge install-units``: the systemd units and config skeletons, for this install."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from ..serving.units import DEFAULT_CONFIG_DIR, DEFAULT_UNIT_DIR
from .app import app, fail, one_line_errors

AS_ROOT = 'sudo "$(command -v mdiedge)" install-units'


@app.command("install-units")
@one_line_errors
def install_units_command(
    config_dir: Path = typer.Option(DEFAULT_CONFIG_DIR, help="Config folder: the skeletons go "
                                    "here and the units read their configs and the ring "
                                    "secret from here."),
    dest: Path = typer.Option(DEFAULT_UNIT_DIR, help="Unit folder."),
    root: Optional[Path] = typer.Option(None, help="Write everything under this folder (an "
                                        "image being built); the files still name the paths "
                                        "as the installed system sees them."),
    executable: Optional[str] = typer.Option(None, help="Absolute path of the mdiedge the "
                                             "units run (default: this install's)."),
    force: bool = typer.Option(False, help="Replace existing unit files (configs never are)."),
) -> None:
    """Install the worker and starter systemd units, running this install of mdiedge, and
    commented configs. As root: sudo "$(command -v mdiedge)" install-units"""
    from ..serving.units import install_units

    try:
        written = install_units(dest, executable, config_dir, force, root)
    except PermissionError as e:
        raise fail(f"{e.filename}: permission denied; run it as root: {AS_ROOT}") from None
    for path in written:
        typer.echo(f"wrote {path}")
    typer.echo("\n".join(_next_steps(written, config_dir)))


def _next_steps(written: List[Path], config_dir: Path) -> List[str]:
    """What is left to do after an installation that wrote ``written``."""
    if not written:
        return ["nothing to do (the units exist: --force replaces them; configs are never "
                "replaced)"]
    secret = Path(os.path.abspath(config_dir)) / "secret"
    return [f"next: put the ring secret (one line, the same on every node) into {secret},",
            "      mode 0600, owned by root, and edit the configs; then",
            "      systemctl daemon-reload && systemctl enable --now mdiedge-worker",
            "      (or mdiedge-worker@NAME, mdiedge-starter)"]
