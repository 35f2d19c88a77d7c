"""The command line a test runs ``mdiedge`` with: this interpreter on the package the tests
import (:func:`mdiedge.base.selfcommand.mdiedge_command`), as the ``mdiedge`` console script
runs the installed package; ``python -m mdiedge`` from a clone's root would import the source
tree instead (without its compiled modules)."""
from mdiedge.base.selfcommand import mdiedge_command

MDIEDGE = mdiedge_command([])
