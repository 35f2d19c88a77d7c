"""The x8 layout (8 rows interleaved block by block, ``ext/quant_q8.h``'s qm_pack_x8): the
compiled packer against the numpy one (``mdiedge.model.x8layout``), the x8 kernels against the
row-by-row ones and the scalar reference, bit for bit where the arithmetic is the same; the
loader packs a block's matrices of those types in the q8 mode only, and a packed model
decodes as an unpacked one. ext/test_quant.c checks the same kernels outside Python (and under qemu)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List

import numpy as np
import pytest

from conftest import make_hf_llama
from gguf_files import write_gguf
from quantblocks import random_blocks
from mdiedge.base.cpudot import ENV, set_cpu_dot
from mdiedge.base.errors import QuantError
from mdiedge.model import _pyquant, cpuload
from mdiedge.model._stepconstants import QuantMatrix, StackedMatrix
from mdiedge.model.cpuload import load_cpu_model, x8_pays
from mdiedge.model.kernels import QUANT
from mdiedge.model.qtypes import TYPES as QTYPES
from mdiedge.model.x8layout import LAYOUTS, pack, pack_q4k

TINY_Q4_K_M = Path(__file__).resolve().parent / "data" / "gguf" / "tiny-llama-2x256-Q4_K_M.gguf"
SHAPES = [(8, 256), (24, 512), (40, 1536)]
TYPES = ["Q4_K", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"]


def compiled(qtype: str = "Q4_K") -> Any:
    quant = QUANT.select()
    if quant is _pyquant or qtype not in quant.x8_types():
        pytest.skip(f"no compiled {qtype} x8 kernel on this path")
    return quant


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n, k", SHAPES)
def test_the_compiled_packer_writes_what_the_numpy_one_does(qtype: str, n: int, k: int) -> None:
    w = random_blocks(qtype, n, k, seed=n).numpy()
    want = pack(w, qtype)
    block, group_block = {"Q4_K": (256, 1184), "IQ4_XS": (256, 1104)}.get(
        qtype, (32, 8 * QTYPES[qtype].block_bytes))
    assert want.shape == (n // 8, k // block * group_block)
    assert np.array_equal(_pyquant.pack_x8(w, qtype), want)
    quant = QUANT.select()
    if quant is not _pyquant:
        assert np.array_equal(quant.pack_x8(w, qtype, 2), want)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "IQ4_XS"])
def test_the_packer_writes_into_a_slice_of_the_whole_layout(qtype: str) -> None:
    """Slices of rows packed into their rows of one layout array (as the loader packs a
    matrix, without a copy) make the layout of the whole; the array is what is returned."""
    w = random_blocks(qtype, 48, 512, seed=9).numpy()
    want = pack(w, qtype)
    for module in {_pyquant, QUANT.select()}:
        into = np.full_like(want, 0xAB)
        for first in (0, 16, 40):
            last = {0: 16, 16: 40, 40: 48}[first]
            got = module.pack_x8(w[first:last], qtype, 2, into[first // 8:last // 8])
            assert np.shares_memory(got, into)
        assert np.array_equal(into, want), module.__name__


@pytest.mark.parametrize("bad", [
    lambda want: np.empty((want.shape[0] + 1, want.shape[1]), np.uint8),
    lambda want: np.empty((want.shape[0], want.shape[1] - 1), np.uint8),
    lambda want: np.empty(want.shape, np.int8),
    lambda want: np.empty((want.shape[0], 2 * want.shape[1]), np.uint8)[:, ::2]])
def test_a_wrong_array_to_pack_into_is_refused(bad: Any) -> None:
    w = random_blocks("Q4_K", 16, 512).numpy()
    out = bad(pack(w, "Q4_K"))
    for module in {_pyquant, QUANT.select()}:
        with pytest.raises(QuantError, match=r"Q4_K x8 layout out .* is not contiguous uint8 "
                                             r"CPU \(2, 2368\)"):
            module.pack_x8(w, "Q4_K", 1, out)


def test_a_packed_32_weight_group_holds_each_rows_bytes() -> None:
    w = random_blocks("Q4_1", 8, 32, seed=3).numpy()
    group = pack(w, "Q4_1")[0]
    for i in range(8):
        assert bytes(group[2 * i:2 * i + 2]) == bytes(w[i, 0:2])
        assert bytes(group[16 + 2 * i:18 + 2 * i]) == bytes(w[i, 2:4])
        for t in range(4):
            assert bytes(group[32 + 32 * t + 4 * i:][:4]) == bytes(w[i, 4 + 4 * t:][:4])


def test_a_packed_group_holds_each_rows_bytes() -> None:
    """Row i's d, dmin, sub-block scales and quants where the layout puts them."""
    w = random_blocks("Q4_K", 8, 256, seed=1).numpy()
    group = pack_q4k(w)[0]
    for i in range(8):
        assert bytes(group[2 * i:2 * i + 2]) == bytes(w[i, 0:2])
        assert bytes(group[16 + 2 * i:18 + 2 * i]) == bytes(w[i, 2:4])
        assert group[32 + i] == w[i, 4] & 63  # sub-block 0's scale
        assert group[96 + 2 * i] == w[i, 8] & 63  # its minimum
        for c in range(4):
            for t in range(8):
                at = 160 + 32 * (8 * c + t) + 4 * i
                assert bytes(group[at:at + 4]) == bytes(w[i, 16 + 32 * c + 4 * t:][:4])


@pytest.mark.parametrize("bad, message", [
    (("Q4_K", 12, 256), "multiple of 8"),
    (("Q6_K", 8, 256), "only Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, IQ4_NL, IQ4_XS")])
def test_a_matrix_without_a_layout_is_refused(bad: Any, message: str) -> None:
    qtype, n, k = bad
    w = random_blocks(qtype, n, k).numpy()
    for module in {_pyquant, QUANT.select()}:
        with pytest.raises(QuantError, match=message):
            module.pack_x8(w, qtype)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17])
def test_the_x8_kernels_equal_the_row_kernels(qtype: str, n: int, k: int, rows: int) -> None:
    """The vector x8 kernels: Q4_K's scale a block's integer sums as the wide row kernels do
    (equal, bit for bit), the 32-weight types' a block's where the row kernels scale each
    lane's (within 1e-5 of the size); the scalar x8 reference as the scalar row reference
    (equal); vector against scalar within 1e-5 of the size; each row's outputs its own
    whatever rows share a call."""
    quant = compiled(qtype)
    w = random_blocks(qtype, n, k, seed=k + n).numpy()
    x8 = quant.pack_x8(w, qtype)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)

    def product(packed: Any, xs: np.ndarray = x) -> np.ndarray:
        return quant.matmul(xs, w, qtype, np.empty((xs.shape[0], n), np.float32), 1, 1,
                            x8=packed)
    got, rows_kernels = product(x8), product(None)
    if qtype == "Q4_K":
        assert np.array_equal(got, rows_kernels)
    assert np.abs(got - rows_kernels).max() <= 1e-5 * np.abs(rows_kernels).max()
    lone = np.stack([product(x8, x[r:r + 1])[0] for r in range(rows)])
    assert np.array_equal(lone, got)
    quant.set_simd(False)
    try:
        scalar = product(x8)
        assert np.array_equal(scalar, product(None))
    finally:
        quant.set_simd(True)
    assert np.abs(got - scalar).max() <= 1e-5 * np.abs(scalar).max()


@pytest.mark.parametrize("bad, message", [
    (lambda w: (w[:, ::2], 1), "not contiguous uint8"),
    (lambda w: (w.view(np.int8), 1), "not contiguous uint8"),
    (lambda w: (w, 0), "threads must be a positive int, got 0")])
def test_bad_arguments_to_the_packer_are_refused(bad: Any, message: str) -> None:
    w = random_blocks("Q4_K", 16, 512).numpy()
    for module in {_pyquant, QUANT.select()}:
        with pytest.raises(QuantError, match=message):
            module.pack_x8(bad(w)[0], "Q4_K", bad(w)[1])


def test_the_compiled_layouts_are_the_numpy_ones() -> None:
    quant = QUANT.select()
    assert set(quant.x8_types()) <= set(LAYOUTS)


@pytest.mark.parametrize("other", [lambda q: q.pack_x8(random_blocks("Q4_K", 16, 512).numpy(),
                                                       "Q4_K"),
                                   lambda q: q.pack_x8(random_blocks("Q4_K", 16, 256).numpy(),
                                                       "Q4_K")[:, ::2]])
def test_a_layout_of_another_matrix_is_refused(other: Any) -> None:
    quant = compiled()
    w = random_blocks("Q4_K", 16, 256).numpy()
    x = np.ones((1, 256), np.float32)
    with pytest.raises(QuantError, match="x8 layout"):
        quant.matmul(x, w, "Q4_K", np.empty((1, 16), np.float32), 1, 1, x8=other(quant))


@pytest.mark.parametrize("qtype, rows, dot, types, pays", [
    ("Q4_K", 256, 1, ("Q4_K",), True),
    ("Q4_K", 256, 0, ("Q4_K",), False),   # the f32 mode reads the rows
    ("Q4_K", 260, 1, ("Q4_K",), False),   # not whole groups
    ("Q6_K", 256, 1, ("Q4_K",), False),   # no layout for the type
    ("Q4_1", 576, 1, ("Q4_1", "Q4_K"), True),
    ("Q5_0", 2048, 1, ("Q5_0", "Q4_K"), True),
    ("IQ4_NL", 1536, 1, ("IQ4_NL", "Q4_K"), True),
    ("Q4_K", 256, 1, (), False),          # none on this path (the twin, NEON)
])
def test_the_loader_packs_where_it_pays(qtype: str, rows: int, dot: int, types: Any,
                                        pays: bool) -> None:
    assert x8_pays(qtype, rows, dot, types) is pays


def _quant_parts(model: Any) -> List[QuantMatrix]:
    found: List[QuantMatrix] = []
    for block in model.weights.blocks:
        for matrix in (block.qkv, block.wo, block.gate_up, block.down):
            found += matrix.parts if isinstance(matrix, StackedMatrix) else [matrix]
    return [m for m in found if isinstance(m, QuantMatrix)]


def _decode(model: Any) -> np.ndarray:
    model.setup_cache(1, 32)
    ids = np.array([[1, 15, 200, 33, 7, 90]])
    x = model.run_blocks(model.embed_tokens(ids), np.zeros(1, np.int64), [0])
    logits = [model.head_logits(x[:, -1])]
    for position in range(6, 10):
        token = np.array([[int(logits[-1].argmax())]])
        x = model.run_blocks(model.embed_tokens(token), np.zeros(1, np.int64), [position])
        logits.append(model.head_logits(x[:, -1]))
    return np.concatenate(logits)


def test_a_packed_model_decodes_as_an_unpacked_one(monkeypatch: Any) -> None:
    """The tiny Q4_K_M file: its blocks' Q4_K matrices packed in the q8 mode (not its Q6_K
    ones, not in the f32 mode); prefill and decode logits within 1e-5 of the unpacked
    model's (the step's row kernels round a row otherwise), the same tokens; the layout is
    what they read (blanked, the logits change)."""
    compiled()
    set_cpu_dot(None)  # the environment's mode from here on (monkeypatch restores it)
    monkeypatch.setenv(ENV, "f32")
    assert not any(m.x8 is not None for m in _quant_parts(load_cpu_model(TINY_Q4_K_M)))
    monkeypatch.setenv(ENV, "q8")
    packed = load_cpu_model(TINY_Q4_K_M)
    parts = _quant_parts(packed)
    assert {m.qtype for m in parts if m.x8 is not None} == {"Q4_K"}
    assert all(m.x8 is None for m in parts if m.qtype != "Q4_K")
    monkeypatch.setattr(cpuload, "x8_pays", lambda *args: False)
    plain = load_cpu_model(TINY_Q4_K_M)
    assert all(m.x8 is None for m in _quant_parts(plain))
    got, want = _decode(packed), _decode(plain)
    for m in parts:  # the step and the prefill read the layout, not the rows
        if m.x8 is not None:
            m.x8[...] = 0
    blanked = _decode(packed)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert not np.allclose(blanked[0], got[0])


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_is_packed_and_read(tmp_path: Path, monkeypatch: Any, tied: bool) -> None:
    """A Q8_0 head (its own, or the tied embedding) is packed in the q8 mode, in slices
    (``PACK_BYTES`` made small: the layout the same as one pack of the whole), and the head's
    product reads the layout (blanked, the logits change) with logits within 1e-5 of the
    unpacked model's; the embedding's lookups still read the rows."""
    compiled("Q8_0")
    hf = make_hf_llama(tmp_path / "hf", seed=5, intermediate_size=64, vocab_size=256,
                       tie_word_embeddings=tied)
    file = write_gguf(tmp_path / "tiny-Q8_0.gguf", hf, "Q8_0")
    set_cpu_dot(None)
    monkeypatch.setenv(ENV, "q8")
    monkeypatch.setattr(cpuload, "PACK_BYTES", 3 * 8 * 34)  # 24 rows of one block: 11 slices
    packed = load_cpu_model(file)
    head = packed.weights.embed if tied else packed.weights.head
    assert head.x8 is not None and head.shape[0] == 256
    assert np.array_equal(head.x8, pack(np.asarray(head.data), "Q8_0"))
    monkeypatch.setattr(cpuload, "x8_pays", lambda *args: False)
    plain = load_cpu_model(file)
    got, want = _decode(packed), _decode(plain)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    head.x8[...] = 0
    x = np.random.default_rng(0).standard_normal((1, 32)).astype(np.float32)
    assert not np.array_equal(packed.head_logits(x), plain.head_logits(x))
    assert np.array_equal(packed.embed_tokens(np.array([[3, 255]])),
                          plain.embed_tokens(np.array([[3, 255]])))
