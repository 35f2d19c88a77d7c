"""The one codec table of the data plane's activation compression: names, the codes a frame
header and a link handshake carry, encoded sizes, and the per-link ``Compression`` (a codec
for prefill frames and one for decode frames). No torch here; the codecs themselves are
``mdiedge/runtime/_pycodec.py`` and its compiled twin ``ext/_ccodec.pyx``.

Codecs apply to float32 payloads (a tensor of another dtype is sent as it is, codec ``none``):

- ``none`` (0): the raw float32 bytes, bit for bit.
- ``fp16`` (1): IEEE half precision, round to nearest even; NaN stays NaN, +-inf stays +-inf,
  a finite value beyond +-65504 saturates to +-65504 (it never becomes inf).
- ``int8`` (2): blocks of ``BLOCK`` (32) consecutive values (the last one may be shorter):
  the payload is every block's fp16 scale ``d`` (little-endian), then one int8 per value.
  ``d`` is the block's largest finite magnitude over ``INT8_MAX`` (126), rounded to fp16
  (at most 65504: larger values saturate to +-126 * 65504); a finite value is
  ``q = round(x / d)`` in -126..126 and decodes to ``q * d``. Non-finite values are coded
  exactly: 127 is +inf, -127 is -inf, -128 is NaN (and they do not enter the scale).
  The error of a finite value within range is at most ``int8_error_bound(absmax)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from .errors import ConfigError

NONE, FP16, INT8 = 0, 1, 2
CODES: Dict[str, int] = {"none": NONE, "fp16": FP16, "int8": INT8}
NAMES: Dict[int, str] = {code: name for name, code in CODES.items()}
BLOCK = 32
INT8_MAX = 126  # finite values; the codes 127, -127, -128 are +inf, -inf, NaN
INT8_POS_INF, INT8_NEG_INF, INT8_NAN = 127, -127, -128
FP16_MAX = 65504.0
INT8_LIMIT = INT8_MAX * FP16_MAX  # finite magnitudes beyond this saturate


def encoded_size(codec: int, n: int) -> int:
    if codec == NONE:
        return 4 * n
    if codec == FP16:
        return 2 * n
    if codec == INT8:
        return n + 2 * ((n + BLOCK - 1) // BLOCK)
    raise ConfigError(f"unknown codec code {codec!r}; known: {sorted(NAMES)}")


def int8_error_bound(absmax: float) -> float:
    """The largest |x - decode(encode(x))| of a finite value in a block whose largest finite
    magnitude is ``absmax`` (at most ``INT8_LIMIT``): half a step, the scale's fp16 rounding
    (2**-11 relative, clamped at 126 steps) and, for a scale below fp16's normal range
    (absmax < 126 * 2**-14), its absolute rounding of 2**-25 over 126 steps."""
    return absmax / (2 * INT8_MAX) * (1 + 2 ** -10) + absmax * 2 ** -11 + INT8_MAX * 2 ** -24


@dataclass(frozen=True)
class Compression:
    """A link's codecs: ``prefill`` for prompt frames, ``decode`` for one-token frames.
    Spelled ``CODEC`` (both) or ``PREFILL:DECODE``, e.g. ``int8:fp16``."""

    prefill: str = "none"
    decode: str = "none"

    @classmethod
    def parse(cls, text: str, where: str = "compression") -> "Compression":
        parts = text.split(":") if isinstance(text, str) else []
        if not 1 <= len(parts) <= 2 or any(p not in CODES for p in parts):
            raise ConfigError(f"{where} {text!r} is not a codec: use one of "
                              f"{', '.join(CODES)}, or PREFILL:DECODE (e.g. int8:fp16)")
        return cls(parts[0], parts[-1])

    def __str__(self) -> str:
        return self.prefill if self.prefill == self.decode else f"{self.prefill}:{self.decode}"

    def code(self, prefill: bool) -> int:
        return CODES[self.prefill if prefill else self.decode]

    @property
    def wire(self) -> bytes:
        """The two bytes a handshake carries: prefill code, decode code."""
        return bytes((CODES[self.prefill], CODES[self.decode]))

    @classmethod
    def from_wire(cls, raw: bytes) -> "Compression":
        if len(raw) != 2 or any(b not in NAMES for b in raw):
            raise ConfigError(f"unknown link codecs {raw.hex()!r} in a handshake")
        return cls(NAMES[raw[0]], NAMES[raw[1]])


NO_COMPRESSION = Compression()
COMPRESSION_NAMES: Tuple[str, ...] = tuple(CODES) + tuple(
    f"{a}:{b}" for a in CODES for b in CODES if a != b)


def check_encoded(codec: int, n: int, size: int) -> None:
    """FrameError unless ``size`` bytes are exactly ``n`` values encoded with ``codec``."""
    from .errors import FrameError

    if codec not in (FP16, INT8):
        raise FrameError(f"codec code {codec!r} is not fp16 ({FP16}) or int8 ({INT8})")
    expected = encoded_size(codec, n)
    if size != expected:
        raise FrameError(f"codec {NAMES[codec]}: {n} values take {expected} bytes, got {size}")
