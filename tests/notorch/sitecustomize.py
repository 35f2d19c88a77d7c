"""Run by every Python process whose PYTHONPATH starts with this folder (tests/torchfree.py
puts it there), a local ring's workers included, as the process starts:
- MDIEDGE_REPORT_TORCH=DIR: writes DIR/<pid>.start (its command line), and DIR/<pid>.torch
  (its command line and the stack) the moment it looks for torch;
- MDIEDGE_BLOCK_TORCH=1: looking for torch fails as where torch is not installed.
The test venv has no sitecustomize of its own for this one to shadow (the tests check it)."""
import os
import sys
import traceback

_REPORT = os.environ.get("MDIEDGE_REPORT_TORCH", "")
_BLOCK = os.environ.get("MDIEDGE_BLOCK_TORCH", "") == "1"


def _write(suffix, text):
    with open(os.path.join(_REPORT, "%d.%s" % (os.getpid(), suffix)), "w") as f:
        f.write(" ".join(sys.argv) + "\n" + text)


class TorchWatch:
    """First on sys.meta_path: sees every search for torch (an ``import torch`` anywhere,
    caught or not); reports it, and refuses it where torch is blocked."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "torch" and not name.startswith("torch."):
            return None
        if _REPORT:
            _write("torch", "".join(traceback.format_stack()[:-1]))
        if _BLOCK:
            raise ModuleNotFoundError("No module named 'torch' (blocked by the test)",
                                      name="torch")
        return None

    @staticmethod
    def invalidate_caches():
        pass


if _REPORT or _BLOCK:
    sys.modules.pop("torch", None)
    sys.meta_path.insert(0, TorchWatch)
if _REPORT:
    _write("start", "")
