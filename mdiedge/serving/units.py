"""systemd units for mdiedge nodes, and ``mdiedge install-units``.

The checkout's ``systemd/`` files are the source (installed as ``mdiedge/_systemd``). Configs are
never overwritten, units only with ``force``. As root: ``sudo "$(command -v mdiedge)"
install-units``, then ``systemctl daemon-reload``.

The units run mdiedge as a dynamic user: the executable and its environment must be readable by any
user (a venv under a 0700 home is not). They need systemd >= 240 (the worker's ``$STATE_DIRECTORY``;
the starter's 236, for ``StandardInput=file:``, which hands it the root-only secret file)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..base.errors import ConfigError
from .skeletons import configs_for_units

UNIT_NAMES = ("mdiedge-worker.service", "mdiedge-worker@.service", "mdiedge-starter.service")
DEFAULT_UNIT_DIR = Path("/etc/systemd/system")
DEFAULT_CONFIG_DIR = Path("/etc/mdiedge")
SOURCE_EXECUTABLE = "/usr/local/bin/mdiedge"  # what the unit files in systemd/ name


_EXEC_START = re.compile(r"^(ExecStart=[-@:+!]*)(\S+)(.*)$", re.MULTILINE)
_CONFIGURATION_DIRECTORY = re.compile(r"^ConfigurationDirectory=.*\n", re.MULTILINE)


def unit_source_dir() -> Path:
    """The installed copy, else the checkout's ``systemd/``."""
    here = Path(__file__).resolve().parent.parent  # the mdiedge package
    candidates = (here / "_systemd", here.parent / "systemd")
    for folder in candidates:
        if all((folder / name).is_file() for name in UNIT_NAMES):
            return folder
    raise FileNotFoundError(
        "mdiedge's systemd unit files are missing (looked in %s)"
        % ", ".join(str(c) for c in candidates))


def _quote_exec(path: str) -> str:
    """Specifiers escaped, quoted when it holds whitespace, quotes or backslashes."""
    if "$" in path or any(c in path for c in "\n\r\0"):
        # systemd does not unescape "$$" in the executable's path
        raise ConfigError(f"cannot put {path!r} on an ExecStart= line")
    word = path.replace("%", "%%")
    if re.search(r'[\s"\'\\]', word):
        word = '"%s"' % word.replace("\\", "\\\\").replace('"', '\\"')
    return word


def _config_folder(config_dir: "os.PathLike[str] | str") -> str:
    """An absolute path that needs no quoting or escaping in any directive."""
    folder = os.path.normpath(str(config_dir))
    if not os.path.isabs(folder):
        raise ConfigError(f"the config folder must be an absolute path, not {str(config_dir)!r}")
    if re.search(r'[\s"\'\\$%;]', folder):
        raise ConfigError(f"the units cannot name the config folder {folder!r}: choose one "
                          f"without whitespace, quotes, backslashes, '$', '%' or ';'")
    return folder


def carry_config_dir(text: str, config_dir: "os.PathLike[str] | str") -> str:
    """``config_dir`` wherever ``text`` names /etc/mdiedge; ``ConfigurationDirectory=`` dropped
    outside /etc, which it cannot name."""
    folder = _config_folder(config_dir)
    text = text.replace(f"{DEFAULT_CONFIG_DIR}/", f"{folder}/")
    if folder.startswith("/etc/"):
        return _CONFIGURATION_DIRECTORY.sub(
            f"ConfigurationDirectory={folder[len('/etc/'):]}\n", text)
    return _CONFIGURATION_DIRECTORY.sub("", text)


def render_unit(name: str, executable: str,
                config_dir: "os.PathLike[str] | str" = DEFAULT_CONFIG_DIR,
                args: Sequence[str] = ()) -> str:
    """``args`` before the subcommand (``-m mdiedge`` for a Python); configs and secret in
    ``config_dir``."""
    if name not in UNIT_NAMES:
        raise ConfigError(f"unknown unit {name!r} (known: {', '.join(UNIT_NAMES)})")
    if not os.path.isabs(executable):
        raise ConfigError(f"ExecStart= needs an absolute path, not {executable!r}")
    text = carry_config_dir((unit_source_dir() / name).read_text(encoding="utf-8"), config_dir)
    exec_words = " ".join([_quote_exec(executable)] + [_quote_exec(a) for a in args])
    rendered, count = _EXEC_START.subn(
        lambda m: m.group(1) + exec_words + m.group(3), text)
    if count != 1:
        raise ValueError(f"{name}: expected one ExecStart= line, found {count}")
    return rendered


def default_command(python: str = sys.executable) -> Tuple[str, ...]:
    """The console script beside ``python``, else ``python -m mdiedge``, after checking ``python``
    imports mdiedge with neither $PYTHONPATH nor a user site (a unit has neither)."""
    if not python or not os.path.isabs(python):
        raise ConfigError(f"cannot tell this Python's path (sys.executable is {python!r}): "
                          f"pass the mdiedge executable")
    script = Path(python).parent / "mdiedge"
    if script.is_file() and os.access(script, os.X_OK):
        return (str(script),)
    probe = subprocess.run([python, "-I", "-c", "import mdiedge"], cwd="/", timeout=120,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if probe.returncode != 0:
        raise ConfigError(f"{python} finds mdiedge only through $PYTHONPATH or a user site, "
                          f"which a unit does not have: install mdiedge into it (pip install "
                          f"...) or pass the mdiedge executable")
    return (python, "-m", "mdiedge")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except PermissionError as e:
        raise PermissionError(e.errno, e.strerror, str(path.parent)) from None


def _on_disk(root: Optional[Path], path: Path) -> Path:
    return path if root is None else Path(root) / path.relative_to(path.anchor)


def _write_new(folder: Path, files: Sequence[Tuple[str, str]], replace: bool) -> List[Path]:
    """Existing files skipped unless ``replace``; the files written."""
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    written = []
    for name, text in files:
        target = folder / name
        if target.exists() and not replace:
            continue
        _write(target, text)
        written.append(target)
    return written


def install_units(dest: "os.PathLike[str] | str" = DEFAULT_UNIT_DIR,
                  executable: Optional[str] = None,
                  config_dir: "os.PathLike[str] | str" = DEFAULT_CONFIG_DIR,
                  force: bool = False, root: "os.PathLike[str] | str | None" = None
                  ) -> List[Path]:
    """The three units into ``dest``, the config skeletons into ``config_dir``; the files written.
    ``root``: paths as the installed system sees them, written under it (an image, a test)."""
    command = default_command() if executable is None else (executable,)
    base = None if root is None else Path(root)
    dest, config_dir = Path(dest), Path(config_dir)
    if base is None:
        dest, config_dir = Path(os.path.abspath(dest)), Path(os.path.abspath(config_dir))
    units = [(name, render_unit(name, command[0], config_dir, command[1:]))
             for name in UNIT_NAMES]
    if not dest.is_absolute():
        raise ConfigError(f"the unit folder must be an absolute path, not {str(dest)!r}")
    configs = [(name, carry_config_dir(text, config_dir))
               for name, text in configs_for_units().items()]
    return (_write_new(_on_disk(base, dest), units, force)
            + _write_new(_on_disk(base, config_dir), configs, False))


if __name__ == "__main__":
    sys.exit('mdiedge: error: the installer is `mdiedge install-units` (as root: '
             'sudo "$(command -v mdiedge)" install-units)')
