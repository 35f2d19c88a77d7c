"""Sealed data links: every frame after the handshake authenticated and encrypted.

``derive`` expands the link's handshake key (the ring secret bound to the set-up) with the
handshake's two fresh nonces, by HKDF-SHA256, into one key per direction, so no two links,
directions or set-ups share a key. Each direction seals with AES-256-GCM under its key, the nonce
being the frame's number on that direction (a 64-bit counter from 0, never sent: both ends count),
the header and sample table as associated data (readable, so lengths are bounds-checked before
allocating) and the payload encrypted; the tag follows the payload. A frame altered, replayed,
reordered or after a dropped one fails its tag: an ``IntegrityError``, and the link closes.

The AEAD runs in C (``cryptography``); sealing writes ciphertext and tag into one new buffer,
opening decrypts into the destination given (possibly the received bytes themselves)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ._framingconstants import TAG_SIZE, byte_view
from ..base.errors import FrameError, IntegrityError

AEAD = AESGCM  # faster than ChaCha20-Poly1305 wherever the CPU has AES instructions
KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12
MAX_FRAMES = 2 ** 64  # the counter's range: a direction seals at most this many frames
_INFO = b"mdiedge sealed link v1"
_INTO = hasattr(AEAD, "encrypt_into")  # cryptography >= 45: no copy of the result


@dataclass(frozen=True)
class LinkKeys:
    """One end's sealing and opening keys."""

    send: bytes
    receive: bytes

    def sealer(self) -> "Sealer":
        return Sealer(self.send)

    def opener(self) -> "Opener":
        return Opener(self.receive)


def derive(key: bytes, challenge: bytes, answer: bytes, connector: bool) -> LinkKeys:
    """One end's keys after a handshake under ``key`` exchanged ``challenge`` and ``answer``."""
    okm = HKDF(hashes.SHA256(), 2 * KEY_BYTES, salt=challenge + answer, info=_INFO).derive(key)
    to_acceptor, to_connector = okm[:KEY_BYTES], okm[KEY_BYTES:]
    if connector:
        return LinkKeys(send=to_acceptor, receive=to_connector)
    return LinkKeys(send=to_connector, receive=to_acceptor)


def _flat(buffer: Any, writable: bool) -> Any:
    """A numpy array as a uint8 view (no copy, the cheapest), anything else as a flat byte view."""
    if isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous and buffer.ndim:
        return buffer if buffer.dtype == np.uint8 else buffer.view(np.uint8)
    return byte_view(buffer, writable)


def _nonce(counter: int) -> bytes:
    if counter >= MAX_FRAMES:
        raise FrameError(f"frame counter {counter} exhausted: open a new link")
    return counter.to_bytes(NONCE_BYTES, "little")


class Sealer:
    """Seals one direction's frames in wire order."""

    def __init__(self, key: bytes) -> None:
        self._aead = AEAD(key)
        self.frames = 0

    def seal(self, header: bytes, payload: Optional[Any]) -> np.ndarray:
        """Ciphertext of ``payload`` (or None) then the tag over ``header`` (as sent) and it: what
        follows the header on the wire."""
        nonce = _nonce(self.frames)
        data = b"" if payload is None else _flat(payload, writable=False)
        size = data.nbytes if isinstance(data, np.ndarray) else len(data)
        self.frames += 1
        if not _INTO:
            return np.frombuffer(self._aead.encrypt(nonce, bytes(data), header), np.uint8)
        sealed = np.empty(size + TAG_SIZE, dtype=np.uint8)
        self._aead.encrypt_into(nonce, data, header, sealed)
        return sealed


class Opener:
    """Opens one direction's frames in arrival order."""

    def __init__(self, key: bytes) -> None:
        self._aead = AEAD(key)
        self.frames = 0

    def open_into(self, header: bytes, sealed: Any, out: Optional[Any]) -> None:
        """Check the tag at the end of ``sealed`` and decrypt into ``out`` (its size; may be
        ``sealed``'s own memory; None: no payload). IntegrityError naming the frame when the tag
        fails."""
        nonce = _nonce(self.frames)
        sealed = _flat(sealed, writable=False)
        out = bytearray() if out is None else _flat(out, writable=True)
        try:
            if not _INTO:
                plain = self._aead.decrypt(nonce, bytes(sealed), header)
                if plain:
                    out[:] = plain
            else:
                self._aead.decrypt_into(nonce, sealed, header, out)
        except InvalidTag:
            raise IntegrityError(f"sealed frame {self.frames} failed authentication: altered, "
                                 f"replayed or reordered on the way, or one before it was "
                                 f"dropped") from None
        self.frames += 1
