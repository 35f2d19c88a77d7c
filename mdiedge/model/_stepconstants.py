"""What both implementations of the compiled decode step (``ext/_cstep.pyx`` and
``mdiedge/model/_pystep.py``) accept: ``block(weights, x, out, slots, positions, threads)`` runs one
decoder block (dense, or with a mixture of experts: ``Experts``) for ``x`` (rows, dim), one new
token per row, row ``r`` in KV slot ``slots[r]`` at position ``positions[r]``, writes the block's
output to ``out`` (rows, dim) and the rows' keys and values into the cache; ``blocks(plan(weights),
x, out, …)`` runs consecutive blocks in one call, ``plan`` made once for them; ``logits(norm, eps,
head, x, out, threads)`` writes the final RMSNorm and the head product of ``x`` (rows, dim) to
``out`` (rows, vocab) in one call (``logits_usable``, ``check_logits``). Everything is C-contiguous
float32 on the CPU (numpy arrays or torch tensors), 1 <= rows <= ``STEP_ROWS``, except that each
of a block's four matrices (qkv, wo, gate_up, down) and the head may instead be a
``QuantMatrix``: uint8 blocks of a kernel type (``mdiedge.model.quant``), multiplied by the
quantized product
(``ext/quant.h``; its twin ``mdiedge/model/_pyquant.py``); a block's matrix may also be a
``StackedMatrix`` of up to ``MAX_PARTS`` of them, each of its own type; ``usable`` says whether a
call qualifies and ``check`` raises ``ValueError`` quoting what does not. ``PREFERRED`` (each
module's own) says whether the model should decode through it rather than through its own torch
operations."""
from __future__ import annotations

import math
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..base import defaults
from ..base.errors import QuantError
from ._matvecconstants import MAX_ROWS
from .arrays import contiguous_cpu, device_of, grad_enabled, ndim
from .arrays import plain as _plain
from .qtypes import KERNEL_TYPES, TYPES, qtype_of


_TENSORS = ("attn_norm", "qkv", "wo", "mlp_norm", "gate_up", "down", "k", "v", "cos", "sin")
_MATRICES = ("qkv", "wo", "gate_up", "down")  # float32, QuantMatrix or StackedMatrix
_OPTIONAL = ("qkv_bias", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")  # or None
_SETTINGS = ("activation", "attn_scale", "window", "qk_pairs", "experts")
ACTIVATIONS = ("silu", "gelu_tanh")  # in ext/step.h's order (ST_SILU, ST_GELU_TANH)
MAX_PARTS = 3  # of a StackedMatrix: ext/step.h's ST_PARTS
MAX_PAIRED_HEAD_DIM = 512  # of a block with qk_pairs: ext/step.h's ST_MAX_HEAD_DIM
QUANT_CODES = {name: TYPES[name].kernel for name in KERNEL_TYPES}  # ext/quant.h's enum values
STEP_ROWS = defaults.STEP_ROWS  # rows one call takes (many samples' decode rows)


def plain(t: Any) -> bool:
    return _plain(t)


class QuantMatrix:
    """(out, in) held as ``data``, uint8 (out, row_bytes) contiguous on the CPU, in kernel type
    ``qtype`` (``code``: its ext/quant.h enum value); ValueError quoting what does not fit.
    ``x8``: the same rows also in the compiled kernels' x8 layout (``_cquant.pack_x8``: groups
    of 8 rows interleaved, uint8 (out / 8, group bytes)), which the q8 mode multiplies where it
    can; None where not packed. ``data`` stays the reference every other reader takes."""

    __slots__ = ("data", "qtype", "code", "shape", "x8")

    def __init__(self, data: Any, qtype: str, x8: Any = None) -> None:
        try:
            t = qtype_of(qtype)
        except QuantError as e:
            raise ValueError(str(e)) from None
        if t.name not in QUANT_CODES:
            raise ValueError(f"no quantized kernel for {t.name}: the step runs "
                             f"{', '.join(QUANT_CODES)}")
        if not (contiguous_cpu(data, "uint8") and ndim(data) == 2
                and data.shape[1] % t.block_bytes == 0 and data.shape[1] > 0):
            raise ValueError(f"{t.name} matrix {tuple(getattr(data, 'shape', ()))} "
                             f"{getattr(data, 'dtype', type(data).__name__)} is not contiguous "
                             f"uint8 CPU rows of whole {t.block_bytes}-byte blocks")
        if x8 is not None and not (contiguous_cpu(x8, "uint8") and ndim(x8) == 2
                                   and x8.shape[0] * 8 == data.shape[0]):
            raise ValueError(f"x8 layout {tuple(getattr(x8, 'shape', ()))} of a {t.name} matrix "
                             f"of {data.shape[0]} rows is not contiguous uint8 rows, one per 8")
        for name, value in (("data", data), ("qtype", t.name), ("code", QUANT_CODES[t.name]),
                            ("shape", (data.shape[0], data.shape[1] // t.block_bytes * t.block)),
                            ("x8", x8)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"QuantMatrix is frozen ({name})")

    @property
    def requires_grad(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"QuantMatrix({self.qtype}, {self.shape})"


class StackedMatrix:
    """1..``MAX_PARTS`` ``QuantMatrix`` parts of one input width read as one matrix of their rows
    stacked (Q, K, V or gate, up), each of its own type, nothing copied."""

    __slots__ = ("parts", "shape")

    def __init__(self, parts: Sequence[Any]) -> None:
        parts = tuple(parts)
        if not 1 <= len(parts) <= MAX_PARTS or not all(isinstance(p, QuantMatrix)
                                                       for p in parts):
            raise ValueError(f"a stacked matrix of {len(parts)} parts "
                             f"({', '.join(type(p).__name__ for p in parts)}): needs 1.."
                             f"{MAX_PARTS} QuantMatrix parts")
        widths = sorted({p.shape[1] for p in parts})
        if len(widths) != 1:
            raise ValueError(f"parts of input widths {widths} cannot be stacked")
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "shape", (sum(p.shape[0] for p in parts), widths[0]))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"StackedMatrix is frozen ({name})")

    @property
    def requires_grad(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"StackedMatrix({', '.join(map(repr, self.parts))})"


def _matrix_of(name: str, t: Any, shape: Tuple[int, ...]) -> None:
    """ValueError quoting ``name`` unless plain float32, a ``QuantMatrix`` or a ``StackedMatrix`` of
    ``shape``."""
    if not (isinstance(t, (QuantMatrix, StackedMatrix))
            or plain(t)):
        raise ValueError(f"{name} is not a contiguous float32 CPU tensor or a "
                         "Quant/StackedMatrix")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} {tuple(t.shape)} is not {shape}")


class Experts:
    """A block's mixture-of-experts feed-forward: ``router`` (n_experts, dim), each expert's fused
    ``gate_up`` (2 hidden, dim) and ``down`` (dim, hidden), float32 or quantized; ``top_k`` per row,
    renormalized where ``renormalize``; ``counts`` None or a contiguous int64 CPU tensor
    (n_experts,) the step adds routed rows to. Checked when made, frozen after."""

    __slots__ = ("router", "gate_up", "down", "top_k", "renormalize", "counts", "n_experts",
                 "dim", "hidden")

    def __init__(self, router: Any, gate_up: Sequence[Any], down: Sequence[Any], top_k: int,
                 renormalize: bool, counts: Any = None) -> None:
        n_experts, dim = tuple(getattr(router, "shape", (0, 0)))[:2]
        gate_up, down = tuple(gate_up), tuple(down)
        if not n_experts or len(gate_up) != n_experts or len(down) != n_experts:
            raise ValueError(f"a router of {n_experts} experts with {len(gate_up)} gate_up and "
                             f"{len(down)} down matrices")
        hidden = gate_up[0].shape[0] // 2
        _matrix_of("router", router, (n_experts, dim))
        for e in range(n_experts):
            _matrix_of(f"expert {e} gate_up", gate_up[e], (2 * hidden, dim))
            _matrix_of(f"expert {e} down", down[e], (dim, hidden))
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 < top_k <= n_experts:
            raise ValueError(f"top_k {top_k!r} is not in 1..{n_experts}")
        if counts is not None and not (
                contiguous_cpu(counts, "int64") and tuple(counts.shape) == (n_experts,)):
            raise ValueError(f"expert counts {tuple(getattr(counts, 'shape', ()))} are not "
                             f"contiguous int64 CPU ({n_experts},)")
        for name, value in (("router", router), ("gate_up", gate_up), ("down", down),
                            ("top_k", top_k), ("renormalize", bool(renormalize)),
                            ("counts", counts), ("n_experts", n_experts), ("dim", dim),
                            ("hidden", hidden)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Experts is frozen ({name})")

    def matrices(self) -> Tuple[Any, ...]:
        return (self.router,) + self.gate_up + self.down

    def wants_grad(self) -> bool:
        return any(getattr(m, "requires_grad", False) for m in self.matrices())


def _acceptable(name: str, t: Any) -> bool:
    if isinstance(t, (QuantMatrix, StackedMatrix)):
        return name in _MATRICES
    return plain(t) or name in ("k", "v") and contiguous_cpu(t, "float16")


class BlockWeights:
    """One block's tensors as the step reads them, checked once when made (shapes, float32, CPU,
    contiguous; ``ValueError`` quoting what is not) and frozen after.

    attn_norm, mlp_norm (dim,); qkv (q_dim + 2 kv_dim, dim), Q, K and V fused; wo (dim, q_dim);
    gate_up (2 hidden, dim), gate and up fused; down (dim, hidden); k, v caches (slots, kv_heads,
    max_seq, head_dim), both float32 or both float16 (``kv_half``: written rounded to nearest
    even); cos, sin RoPE tables (rope_len, head_dim). Each of qkv, wo, gate_up and down
    is float32, or a ``QuantMatrix`` or ``StackedMatrix`` of that shape.

    Keywords, each absent by default (a Llama block): ``qkv_bias`` (q_dim + 2 kv_dim,) added to the
    Q/K/V product; ``q_norm``, ``k_norm`` (head_dim,) RMSNorm weights of each head of Q and of K,
    after the bias and before RoPE (eps the block's); ``post_attn_norm``, ``post_mlp_norm`` (dim,)
    RMSNorm weights of the attention's and the feed-forward's output before each is added to x
    ("sandwich" norms); ``activation`` of the gate, one of ``ACTIVATIONS`` ("silu": SwiGLU;
    "gelu_tanh": GeGLU with tanh-approximated gelu); ``attn_scale`` the scores' factor (None: 1 /
    sqrt(head_dim)); ``window`` the keys a row at position p attends (0: all; else positions p -
    window + 1 .. p); ``qk_pairs`` the product's Q and K rows in llama.cpp's RoPE-pair order
    (each head's (half, 2) values, as a Llama GGUF file stores them), put in Hugging Face's order
    (2, half) before the bias; ``experts`` an ``Experts``, the block's feed-forward a mixture of
    experts, gate_up and down None."""

    __slots__ = _TENSORS + _OPTIONAL + _SETTINGS + (
        "n_heads", "eps", "dim", "n_kv", "head_dim", "hidden", "n_slots", "positions",
        "kv_half")

    def __init__(self, attn_norm: Any, qkv: Any, wo: Any, mlp_norm: Any, gate_up: Any,
                 down: Any, k: Any, v: Any, cos: Any, sin: Any, n_heads: int,
                 eps: float, *, qkv_bias: Any = None, q_norm: Any = None, k_norm: Any = None,
                 post_attn_norm: Any = None, post_mlp_norm: Any = None,
                 activation: str = "silu", attn_scale: Optional[float] = None,
                 window: int = 0, qk_pairs: bool = False,
                 experts: Optional[Experts] = None) -> None:
        given = dict(zip(_TENSORS, (attn_norm, qkv, wo, mlp_norm, gate_up, down, k, v, cos,
                                    sin)))
        hidden = _feed_forward(gate_up, down, experts, attn_norm)
        for name, t in given.items():
            if not (t is None and experts is not None and name in ("gate_up", "down")
                    or _acceptable(name, t)):
                raise ValueError(f"{name} is not a contiguous float32 CPU tensor"
                                 + (" or a Quant/StackedMatrix" if name in _MATRICES else ""))
        kv_half = contiguous_cpu(k, "float16")
        if contiguous_cpu(v, "float16") != kv_half:
            raise ValueError(f"k {getattr(k, 'dtype', '?')} and v {getattr(v, 'dtype', '?')} "
                             "are not both float32 or both float16")
        n_slots, n_kv, max_seq, head_dim = k.shape
        dim, q_dim = attn_norm.shape[0], n_heads * head_dim
        shapes = {"attn_norm": (dim,), "mlp_norm": (dim,), "wo": (dim, q_dim),
                  "qkv": (q_dim + 2 * n_kv * head_dim, dim), "gate_up": (2 * hidden, dim),
                  "down": (dim, hidden), "v": tuple(k.shape), "sin": tuple(cos.shape)}
        for name, shape in shapes.items():
            if given[name] is not None and tuple(given[name].shape) != shape:
                raise ValueError(f"{name} {tuple(given[name].shape)} is not {shape}")
        if n_heads % n_kv or ndim(cos) != 2 or cos.shape[1] != head_dim or head_dim % 2:
            raise ValueError(f"{n_heads} heads over {n_kv} KV heads of {head_dim} with "
                             f"RoPE tables {tuple(cos.shape)} do not fit")
        if qk_pairs is True and head_dim > MAX_PAIRED_HEAD_DIM:
            raise ValueError(f"Q and K in RoPE pairs with heads of {head_dim} values, over "
                             f"{MAX_PAIRED_HEAD_DIM}")
        optional = _checked_optional(
            dict(qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm, post_attn_norm=post_attn_norm,
                 post_mlp_norm=post_mlp_norm),
            dict(qkv_bias=(q_dim + 2 * n_kv * head_dim,), q_norm=(head_dim,),
                 k_norm=(head_dim,), post_attn_norm=(dim,), post_mlp_norm=(dim,)))
        values = dict(given, **optional, **_checked_settings(activation, attn_scale, window),
                      qk_pairs=_checked_flag("qk_pairs", qk_pairs),
                      experts=experts, n_heads=int(n_heads), eps=float(eps), dim=dim, n_kv=n_kv,
                      head_dim=head_dim, hidden=hidden, n_slots=n_slots,
                      positions=min(max_seq, cos.shape[0]), kv_half=kv_half)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"BlockWeights is frozen ({name})")

    def replace(self, **changes: Any) -> "BlockWeights":
        """A copy with some fields changed, checked again."""
        names = _TENSORS + ("n_heads", "eps") + _OPTIONAL + _SETTINGS
        return BlockWeights(**{n: changes.get(n, getattr(self, n)) for n in names})

    def wants_grad(self) -> bool:
        return any(getattr(getattr(self, n), "requires_grad", False)
                   for n in _TENSORS + _OPTIONAL) or (self.experts is not None
                                                      and self.experts.wants_grad())

    def quantized(self) -> Tuple[str, ...]:
        """Names of the matrices held quantized ("experts" where any expert's is)."""
        held = [getattr(self, n) for n in _MATRICES] + [
            m for m in (self.experts.matrices() if self.experts is not None else ())]
        names = _MATRICES + ("experts",) * (len(held) - len(_MATRICES))
        return tuple(dict.fromkeys(n for n, m in zip(names, held)
                                   if isinstance(m, (QuantMatrix, StackedMatrix))))


def _feed_forward(gate_up: Any, down: Any, experts: Optional[Experts], attn_norm: Any) -> int:
    """gate_up's half, or the experts' (gate_up and down then None)."""
    if experts is None:
        return int(getattr(gate_up, "shape", (0,))[0]) // 2
    if not isinstance(experts, Experts):
        raise ValueError(f"experts {type(experts).__name__} are not Experts")
    if gate_up is not None or down is not None:
        raise ValueError("a block with experts has no gate_up or down of its own")
    dim = tuple(getattr(attn_norm, "shape", ()))
    if dim != (experts.dim,):
        raise ValueError(f"experts of width {experts.dim} in a block of width {dim}")
    return experts.hidden


def _checked_optional(given: Dict[str, Any], shapes: Dict[str, Tuple[int, ...]]
                      ) -> Dict[str, Any]:
    for name, t in given.items():
        if t is None:
            continue
        if not plain(t):
            raise ValueError(f"{name} is not a contiguous float32 CPU tensor")
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{name} {tuple(t.shape)} is not {shapes[name]}")
    return given


def unpaired(heads: Any, head_dim: int) -> Any:
    """Rows of whole heads of ``head_dim`` (rows, n * head_dim) from the RoPE-pair order
    (each head's (half, 2) values) into the "rotate half" order (2, half), a new array
    (``ext/step.h``'s ``st_unpair``)."""
    rows = heads.shape[0]
    return heads.reshape(rows, -1, head_dim // 2, 2).swapaxes(-1, -2).reshape(rows, -1)


def _checked_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} {value!r} is not True or False")
    return value


def _checked_settings(activation: Any, attn_scale: Any, window: Any) -> Dict[str, Any]:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    scale = attn_scale
    if scale is not None:
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            scale = math.nan
        if isinstance(attn_scale, bool) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"attn_scale {attn_scale!r} is not a positive number")
    try:
        keys = -1 if isinstance(window, bool) else operator.index(window)
    except TypeError:
        keys = -1
    if keys < 0:
        raise ValueError(f"window {window!r} is not a whole number >= 0")
    return dict(activation=activation, attn_scale=scale, window=keys)


class Limits:
    """Width, KV slots and positions a call must fit (the fewest of any block)."""

    def __init__(self, weights: Sequence[BlockWeights]) -> None:
        if not weights or not all(isinstance(w, BlockWeights) for w in weights):
            raise ValueError(f"a plan needs one or more BlockWeights, got {len(weights)} "
                             f"({', '.join(sorted({type(w).__name__ for w in weights}))})")
        widths = {w.dim for w in weights}
        if len(widths) != 1:
            raise ValueError(f"blocks of widths {sorted(widths)} cannot run one after another")
        self.dim = widths.pop()
        self.n_slots = min(w.n_slots for w in weights)
        self.positions = min(w.positions for w in weights)
        self.wants_grad = any(w.wants_grad() for w in weights)


def decode_pieces(samples: int, rows_each: int) -> Optional[List[Tuple[int, int]]]:
    """The step calls that take ``samples`` samples of ``rows_each`` consecutive rows each
    (sample-major): ``[start, end)`` of at most ``STEP_ROWS`` rows, in order, where every
    sample's rows are few (at most ``MAX_ROWS``: a decode step, a verification of drafts),
    so that any number of samples decodes at the step's cost per row and each row's result
    is that of the row alone; None for longer runs (a prefill), which the many-row kernels
    take. A sample's rows may span two calls: the earlier call writes their keys and values
    before the later one attends."""
    if samples < 1 or not 1 <= rows_each <= MAX_ROWS:
        return None
    total = samples * rows_each
    return [(start, min(start + STEP_ROWS, total)) for start in range(0, total, STEP_ROWS)]


def usable(weights: BlockWeights, x: Any) -> bool:
    """2-D float32 CPU ``x`` of 1..``STEP_ROWS`` rows of the block's width, no gradient wanted."""
    return _rows_fit(x, weights.dim) and not (
        grad_enabled() and (getattr(x, "requires_grad", False) or weights.wants_grad()))


def _rows_fit(x: Any, dim: int) -> bool:
    return ndim(x) == 2 and 1 <= x.shape[0] <= STEP_ROWS and x.shape[1] == dim and plain(x)


def check(weights: BlockWeights, x: Any, out: Any, slots: Sequence[int],
          positions: Sequence[int], threads: int) -> None:
    if not isinstance(weights, BlockWeights):
        raise ValueError(f"weights {type(weights).__name__} are not BlockWeights")
    check_call(weights, weights.wants_grad(), x, out, slots, positions, threads)


def check_call(limits: Any, wants_grad: bool, x: Any, out: Any, slots: Sequence[int],
               positions: Sequence[int], threads: int) -> None:
    """Against ``limits`` (a ``BlockWeights`` or ``Limits``)."""
    if not _rows_fit(x, limits.dim) or (grad_enabled() and (
            getattr(x, "requires_grad", False) or wants_grad)):
        raise ValueError(f"decode step of x {tuple(x.shape)} {x.dtype} on {device_of(x)}: needs "
                         f"1..{STEP_ROWS} contiguous float32 CPU rows of {limits.dim} and "
                         "no gradient")
    rows = x.shape[0]
    if tuple(out.shape) != (rows, limits.dim) or not plain(out):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a contiguous float32 "
                         f"({rows}, {limits.dim})")
    if len(slots) != rows or len(positions) != rows:
        raise ValueError(f"{len(slots)} slots and {len(positions)} positions for {rows} rows")
    for slot, pos in zip(slots, positions):
        if not (0 <= slot < limits.n_slots and 0 <= pos < limits.positions):
            raise ValueError(f"slot {slot} at position {pos} outside {limits.n_slots} slots "
                             f"of {limits.positions} positions")
    if threads < 1:
        raise ValueError(f"threads {threads} is not >= 1")


def logits_usable(norm: Any, head: Any, x: Any) -> bool:
    """``norm`` (dim,) and ``head`` (vocab, dim; or a ``QuantMatrix``) contiguous CPU float32,
    1..``STEP_ROWS`` rows, no gradient wanted."""
    head_fits = isinstance(head, QuantMatrix) or (plain(head) and ndim(head) == 2)
    return (head_fits and plain(norm) and ndim(norm) == 1 and head.shape[1] == norm.shape[0]
            and _rows_fit(x, norm.shape[0])
            and not (grad_enabled() and any(getattr(t, "requires_grad", False)
                                            for t in (x, norm, head))))


def check_logits(norm: Any, head: Any, x: Any, out: Any, threads: int) -> None:
    if not logits_usable(norm, head, x):
        shapes = [tuple(getattr(t, "shape", ())) for t in (norm, head, x)]
        raise ValueError(f"logits of x {shapes[2]} by norm {shapes[0]} and head {shapes[1]}: "
                         f"needs 1..{STEP_ROWS} contiguous float32 CPU rows of the norm's "
                         "width, a (vocab, width) head and no gradient")
    rows, vocab = x.shape[0], head.shape[0]
    if tuple(out.shape) != (rows, vocab) or not plain(out):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a contiguous float32 "
                         f"({rows}, {vocab})")
    if threads < 1:
        raise ValueError(f"threads {threads} is not >= 1")


def check_halves(src: Any, dst: Any, src_type: str, dst_type: str) -> int:
    """``halves``' and ``widen_halves``' arguments: contiguous 1-D CPU arrays of ``src_type``
    and ``dst_type``, of one length; that length."""
    for name, a, dtype in (("values", src, src_type), ("out", dst, dst_type)):
        if not (contiguous_cpu(a, dtype) and ndim(a) == 1):
            raise ValueError(f"{name} {tuple(getattr(a, 'shape', ()))} "
                             f"{getattr(a, 'dtype', type(a).__name__)} is not a contiguous "
                             f"{dtype} vector")
    if src.shape[0] != dst.shape[0]:
        raise ValueError(f"{src.shape[0]} values into out of {dst.shape[0]}")
    return int(src.shape[0])


def check_act_mul(both: Any, out: Any, activation: str, threads: int) -> int:
    """``act_mul``'s arguments: both (rows, 2 hidden) and out (rows, hidden), contiguous float32
    CPU arrays; the activation's code (its index in ``ACTIVATIONS``)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    rows, width = tuple(both.shape) if ndim(both) == 2 else (0, 0)
    if not (plain(both) and rows >= 1 and width >= 2 and width % 2 == 0):
        raise ValueError(f"gate and up {tuple(getattr(both, 'shape', ()))} are not a contiguous "
                         "float32 (rows, 2 hidden)")
    if not (plain(out) and tuple(out.shape) == (rows, width // 2)):
        raise ValueError(f"out {tuple(getattr(out, 'shape', ()))} is not a contiguous float32 "
                         f"({rows}, {width // 2})")
    if threads < 1:
        raise ValueError(f"threads {threads} is not >= 1")
    return ACTIVATIONS.index(activation)
