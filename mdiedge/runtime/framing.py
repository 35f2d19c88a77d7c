"""Tensor frames of the data plane, on top of the compiled framing module or its twin.

One frame carries one message between neighbour nodes: a header and, for ACTIVATION, PING and the
like, one C-contiguous array sent straight from its memory and received straight into a fresh (or
caller-given) numpy array, no intermediate copy. Arrays received are numpy, bfloat16 as uint16
words: no torch here. Wire format: ``_framingconstants.py``.

A malformed, oversized or truncated frame raises ``FrameError`` and leaves the stream position
unknown: the caller must close the link (``links`` does).

A float32 array may travel encoded (``fp16``, blockwise ``int8``: ``mdiedge.base.codecs``), through
one buffer of the encoded size each way. A sealed link (``seal``) passes its ``Sealer`` to sends and
``Opener`` to receives: payload encrypted, a tag after it, checked before anything of the frame is
returned (IntegrityError); a frame sealed otherwise than agreed is a FrameError.

``impl`` / ``codec_impl`` force one implementation (tests run both); default ``FRAMING.select()`` /
``CODEC.select()``."""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from ..base import dtypes
from ..base.arrays import BF16_WORDS, to_numpy
from ..base.codecs import NONE, encoded_size
from ..base.accel import Twins
from ..base.errors import FrameError
from . import _framingconstants, _pycodec, _pyframing

_framing_failed: Optional[ImportError] = None
try:
    from . import _cframing
except ImportError as e:  # not built, or built from other sources: the twin serves
    _cframing, _framing_failed = None, e  # type: ignore[assignment]
_codec_failed: Optional[ImportError] = None
try:
    from . import _ccodec
except ImportError as e:  # not built, or built from other sources: the twin serves
    _ccodec, _codec_failed = None, e  # type: ignore[assignment]

FRAMING = Twins(_pyframing, _cframing, _framing_failed)
CODEC = Twins(_pycodec, _ccodec, _codec_failed)
_impl: ModuleType = FRAMING.select()
_codec_impl: ModuleType = CODEC.select()

MAGIC: bytes = _impl.MAGIC
VERSION: int = _impl.VERSION
HEADER_SIZE: int = _impl.HEADER_SIZE
MAX_SAMPLES: int = _impl.MAX_SAMPLES
MAX_POSITION: int = _impl.MAX_POSITION
MAX_EXIT_DEPTH: int = _impl.MAX_EXIT_DEPTH
ACTIVATION: int = _impl.ACTIVATION
RELEASE: int = _impl.RELEASE
PING: int = _impl.PING
SHUTDOWN: int = _impl.SHUTDOWN
FLAG_PREFILL: int = _impl.FLAG_PREFILL
FLAG_SEALED: int = _impl.FLAG_SEALED
TAG_SIZE: int = _impl.TAG_SIZE
CODEC_SHIFT: int = _impl.CODEC_SHIFT
FLAG_REWIND: int = _framingconstants.FLAG_REWIND  # flags that only the frame's readers read
FLAG_ALL_ROWS: int = _framingconstants.FLAG_ALL_ROWS
codec_of = _impl.codec_of
ITEMSIZE: Dict[int, int] = _impl.ITEMSIZE
FrameHeader = _impl.FrameHeader

BFLOAT16 = dtypes.BY_NAME["bfloat16"].code
# the numpy dtype each frame dtype code is received as (bfloat16: its uint16 words)
DTYPES: Dict[int, np.dtype] = {d.code: BF16_WORDS if d.code == BFLOAT16 else np.dtype(d.name)
                               for d in dtypes.TABLE}
DTYPE_CODES: Dict[np.dtype, int] = {dtype: code for code, dtype in DTYPES.items()}
CONTROL_DTYPE = DTYPE_CODES[np.dtype(np.uint8)]  # the dtype field of frames with no array


def dtype_code(dtype: Any) -> int:
    """The frame code of a numpy dtype (uint16: bfloat16 words) or a torch dtype (by name)."""
    name = str(dtype)
    if name.startswith("torch."):
        found = dtypes.BY_NAME.get(name[len("torch."):])
        code = None if found is None else found.code
    else:
        try:
            code = DTYPE_CODES.get(np.dtype(dtype))
        except TypeError:
            code = None
    if code is None:
        raise FrameError(f"dtype {dtype} cannot be framed; use one of "
                         f"{', '.join(d.name for d in dtypes.TABLE)}")
    return code


def numpy_dtype(code: int) -> np.dtype:
    """The numpy dtype a frame of ``code`` is received as; FrameError for an unknown one."""
    return DTYPES[dtypes.by_code(code).code]


def tensor_bytes(array: Any) -> np.ndarray:
    """The flat uint8 view of an array's memory: the bytes the framing modules send or fill."""
    return to_numpy(array).reshape(-1).view(np.uint8)


def send_tensor(sock: Any, msg_type: int, sample_ids: Sequence[int], positions: Sequence[int],
                tensor: Any, flags: int = 0, seq: int = 0,
                impl: Optional[ModuleType] = None, codec: int = NONE,
                codec_impl: Optional[ModuleType] = None, exit_depth: int = 0,
                eligible: Sequence[bool] = (), sealer: Optional[Any] = None) -> int:
    """Send one frame carrying ``tensor`` (1 to 4 dims; n_tokens is ``shape[1]`` for 2+ dims, else
    1); the bytes sent. A float32 array goes encoded with ``codec``. ``exit_depth`` and ``eligible``
    (a flag per sample, or empty) only on an ACTIVATION without FLAG_PREFILL."""
    impl = impl or _impl
    if len(tensor.shape) == 0:
        raise FrameError("a 0-dim tensor cannot be framed (ndim 0 means no payload); "
                         "reshape it to (1,)")
    code = dtype_code(tensor.dtype)
    array = to_numpy(tensor)
    shape = tuple(array.shape)
    payload = tensor_bytes(array)
    if codec != NONE and array.dtype == np.float32:
        encoded = np.empty(encoded_size(codec, array.size), dtype=np.uint8)
        (codec_impl or _codec_impl).encode(codec, payload, encoded)
        payload, flags = encoded, flags | (codec << CODEC_SHIFT)
    if sealer is not None:
        flags |= FLAG_SEALED
    header = impl.pack_header(msg_type, flags, code, sample_ids, positions,
                              shape[1] if len(shape) >= 2 else 1, shape, seq, exit_depth,
                              eligible)
    if sealer is not None:
        payload = sealer.seal(header, payload)
    impl.send_all(sock, header, payload)
    return len(header) + payload.nbytes


def send_control(sock: Any, msg_type: int, sample_ids: Sequence[int] = (),
                 positions: Sequence[int] = (), seq: int = 0,
                 impl: Optional[ModuleType] = None, exit_depth: int = 0,
                 eligible: Sequence[bool] = (), sealer: Optional[Any] = None) -> int:
    """Send one frame with no tensor (RELEASE, PING, SHUTDOWN); its bytes. ``exit_depth``,
    ``eligible``, ``sealer`` as for ``send_tensor``."""
    impl = impl or _impl
    header = impl.pack_header(msg_type, 0 if sealer is None else FLAG_SEALED, CONTROL_DTYPE,
                              sample_ids, positions, 0, (), seq, exit_depth, eligible)
    tag = None if sealer is None else sealer.seal(header, None)
    impl.send_all(sock, header, tag)
    return len(header) + (0 if tag is None else TAG_SIZE)


def _allocate(shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The array for a validated header; a failed allocation is the frame's fault."""
    try:
        return np.empty(shape, dtype=dtype)
    except (ValueError, MemoryError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FrameError(f"cannot allocate the frame's {shape} {dtype} array: {reason}") from None


def reader(sock: Any, impl: Optional[ModuleType] = None, capacity: Optional[int] = None,
           busy_poll_us: int = 0) -> Any:
    """A buffered ``FrameReader`` for every frame of a link: a small frame takes one system call
    (``capacity`` bytes, default ``READ_BUFFER``; 0: read nothing past each frame); it polls
    ``busy_poll_us`` before sleeping."""
    impl = impl or _impl
    return impl.FrameReader(sock, impl.READ_BUFFER if capacity is None else capacity,
                            busy_poll_us)


def recv_frame(source: Any, max_payload: int, out: Optional[np.ndarray] = None,
               impl: Optional[ModuleType] = None, codec_impl: Optional[ModuleType] = None,
               opener: Optional[Any] = None) -> Tuple[Any, Optional[np.ndarray]]:
    """One frame from ``source`` (a link's ``reader``, or a socket): its validated header and numpy
    array (None without one).

    The array is allocated only once the header is validated (payload at most ``max_payload``),
    unless ``out`` is given: a C-contiguous writable array of the frame's shape and dtype (else
    FrameError). Any FrameError leaves the stream at an unknown position: close the link.
    ``opener``: the frame must be sealed, and nothing is returned before its tag verified."""
    impl = impl or _impl
    if hasattr(source, "recv_header"):
        header, fill = source.recv_header(max_payload), source.recv_into
    else:  # a socket: one receive per part, nothing past the frame
        header = impl.recv_frame_header(source, max_payload)
        fill = functools.partial(impl.recv_exact_into, source)
    if bool(header.flags & FLAG_SEALED) != (opener is not None):
        raise FrameError(f"a{' sealed' if opener is None else 'n unsealed'} frame on a link "
                         f"that agreed on {'sealed' if opener is not None else 'plain'} frames")
    if not header.shape:
        if opener is not None:
            tag = bytearray(TAG_SIZE)
            fill(tag)
            opener.open_into(header.wire, tag, None)
        return header, None
    dtype = numpy_dtype(header.dtype)
    if out is not None and not _fits(out, header.shape, dtype):
        raise FrameError(f"out array {tuple(out.shape)} {getattr(out, 'dtype', None)} does "
                         f"not fit the frame's {header.shape} {dtype} payload")
    codec = impl.codec_of(header.flags)
    if opener is not None:
        return header, _open(header, dtype, out, fill, opener, codec, codec_impl)
    tensor = _allocate(header.shape, dtype) if out is None else out
    if codec == NONE:
        fill(tensor_bytes(tensor))
    else:
        encoded = np.empty(header.payload_len, dtype=np.uint8)
        fill(encoded)
        (codec_impl or _codec_impl).decode(codec, encoded, tensor_bytes(tensor))
    return header, tensor


def _fits(out: Any, shape: Tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether ``out`` is a numpy array a frame of ``shape`` and ``dtype`` may fill."""
    return isinstance(out, np.ndarray) and tuple(out.shape) == shape and \
        out.dtype == dtype and out.flags.c_contiguous and out.flags.writeable


def _open(header: Any, dtype: np.dtype, out: Optional[np.ndarray], fill: Any,
          opener: Any, codec: int, codec_impl: Optional[ModuleType]) -> np.ndarray:
    """A sealed frame's payload and tag received into one buffer, the tag checked, the payload
    decrypted straight into the array (an encoded one decoded after)."""
    size = header.payload_len
    try:
        sealed = np.empty(size + TAG_SIZE, dtype=np.uint8)
    except MemoryError:
        raise FrameError(f"cannot allocate the frame's {size + TAG_SIZE} sealed bytes") from None
    fill(sealed)
    tensor = _allocate(header.shape, dtype) if out is None else out
    if codec == NONE:
        opener.open_into(header.wire, sealed, tensor_bytes(tensor))
    else:
        opener.open_into(header.wire, sealed, sealed[:size])
        (codec_impl or _codec_impl).decode(codec, sealed[:size], tensor_bytes(tensor))
    return tensor


def frame_bytes(header: Any) -> int:
    """Bytes a received frame took on the wire: header, sample table, payload, tag."""
    tag = TAG_SIZE if header.flags & FLAG_SEALED else 0
    return HEADER_SIZE + 8 * len(header.sample_ids) + header.payload_len + tag
