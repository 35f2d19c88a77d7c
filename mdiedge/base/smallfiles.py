"""The small files a person writes for mdiedge (config files, the ring's secret, the API key), read
with limits: a regular file only (a FIFO, a device such as /dev/zero or a socket is refused at once,
never waited on or read forever), of at most a stated size (``MAX_CONFIG_BYTES``,
``MAX_SECRET_BYTES``); and a secret is text a person can write down. Every refusal is one
ConfigError naming the file and the reason."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, Optional

from .defaults import MAX_SECRET_BYTES
from .errors import ConfigError
from .valuechecks import MIN_SECRET_BYTES

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def kind_of(info: os.stat_result) -> str:
    """What a file that is not a regular one is, in words."""
    return next((name for test, name in _KINDS if test(info.st_mode)), "not a file")


def read_small_file(path: Path, limit: int, shown: str,
                    check: Optional[Callable[[os.stat_result], None]] = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; ``shown`` names it
    in the errors; ``check``: more rules on its status (who may read it). Opened without
    blocking, so a FIFO is refused rather than waited on; the status checked is the opened
    file's. OSError (not found, not permitted) is the caller's to word."""
    fd = os.open(str(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(21, "Is a directory", str(path))
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{shown}: not a regular file ({kind_of(info)})")
        if check is not None:
            check(info)
        data = b""
        while info.st_size <= limit and len(data) <= limit:  # a file may grow as it is read
            more = os.read(fd, limit + 1 - len(data))
            if not more:
                break
            data += more
    finally:
        os.close(fd)
    if info.st_size > limit or len(data) > limit:
        raise ConfigError(f"{shown}: too large ({max(info.st_size, len(data))} bytes; "
                          f"at most {limit})")
    return data


def check_secret(secret: bytes, where: str) -> bytes:
    """``secret`` if it is a ring secret: ``MIN_SECRET_BYTES`` to ``MAX_SECRET_BYTES`` bytes of
    printable UTF-8 text (hex, as ``mdiedge config init`` writes, is); else one ConfigError
    naming ``where`` and the reason (never the secret)."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where}: expected a secret of at least {MIN_SECRET_BYTES} bytes, "
                          f"got {len(secret)} bytes")
    if len(secret) > MAX_SECRET_BYTES:
        raise ConfigError(f"{where}: expected a secret of at most {MAX_SECRET_BYTES} bytes, "
                          f"got {len(secret)} bytes")
    flaw = unprintable(secret)
    if flaw is not None:
        raise ConfigError(f"{where}: the secret is not printable text ({flaw}; expected "
                          f"letters, digits and punctuation, e.g. hex, as `mdiedge config "
                          f"init` writes)")
    return secret


def unprintable(data: bytes) -> Optional[str]:
    """Where ``data`` is not UTF-8 text of printable characters (a control character, NUL
    among them), or None."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 at byte {e.start}"
    at = next((i for i, c in enumerate(text) if not c.isprintable()), None)
    return None if at is None else \
        f"a control character at byte {len(text[:at].encode('utf-8'))}"
