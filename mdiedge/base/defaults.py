"""Where the shipped default model lives, in a source checkout and in an installed package."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError

DEFAULT_MODEL = "nanollama"


def default_model_path() -> Path:
    """``$MDIEDGE_MODEL``, else the packaged copy of ``models/nanollama``, else the checkout's."""
    env = os.environ.get("MDIEDGE_MODEL")
    if env:
        return Path(env).expanduser()
    here = Path(__file__).resolve().parent.parent  # the mdiedge package
    for candidate in (here / "_models" / DEFAULT_MODEL, here.parent / "models" / DEFAULT_MODEL):
        if (candidate / "config.json").exists():
            return candidate
    raise CheckpointError(f"default model {DEFAULT_MODEL!r} not found (looked in "
                          f"{here / '_models'} and {here.parent / 'models'}); pass --model DIR")
