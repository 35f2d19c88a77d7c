"""The command line a test runs ``mdiedge`` with: this interpreter on the package the tests
import (:func:`mdiedge.base.selfcommand.mdiedge_command`), as the ``mdiedge`` console script
runs the installed package; ``python -m mdiedge`` from a clone's root would import the source
tree instead (without its compiled modules)."""
import os
from pathlib import Path
from typing import Dict, Tuple

import mdiedge
from mdiedge.base.selfcommand import mdiedge_command

MDIEDGE = mdiedge_command([])


def package_child() -> Tuple[str, Dict[str, str]]:
    """The working folder and environment of a ``python -c`` child that imports the package
    these tests import: ``-c`` puts the working folder first on the path, so a child started
    in a clone's root would import its source tree (without compiled modules in CI)."""
    parent = str(Path(mdiedge.__file__).resolve().parents[1])
    return parent, dict(os.environ, PYTHONPATH=parent)
