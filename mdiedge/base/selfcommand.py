"""The command line that runs this very mdiedge in a new process: the same interpreter and the same
package directory, whatever the working directory.

``python -m mdiedge`` would put the working directory first on ``sys.path``: started from a clone's
root, a worker would import the uncompiled source tree instead of the installed package its starter
runs (the pure-Python twins, many times slower), and after a ``git pull`` other code than its
starter's. ``-c`` without the working directory on ``sys.path``, and the package's own directory on
it, imports what this process imported, on every Python from 3.8 (``-P`` is 3.11's)."""
from __future__ import annotations

import os
import sys
from typing import List, Sequence

PROGRAM = "mdiedge"  # the name usage lines and errors give the child


def package_root() -> str:
    here = os.path.dirname(os.path.abspath(__file__))  # .../mdiedge/base
    return os.path.dirname(os.path.dirname(here))


def _boot_source(root: str) -> str:
    """``-c`` code that drops the working directory ``-c`` puts first on ``sys.path``, puts
    ``root`` first unless it is on the path already (site-packages stays behind the
    standard library), and runs the command line."""
    return ("import sys\n"
            "if sys.path and sys.path[0] == '': del sys.path[0]\n"
            "if %r not in sys.path: sys.path.insert(0, %r)\n"
            "sys.argv[0] = %r\n"
            "from mdiedge.__main__ import main\n"
            "main()" % (root, root, PROGRAM))


def mdiedge_command(args: Sequence[str]) -> List[str]:
    """``[python, ..., *args]``: ``mdiedge ARGS`` run by this interpreter on this package."""
    return [sys.executable, "-c", _boot_source(package_root())] + list(args)
