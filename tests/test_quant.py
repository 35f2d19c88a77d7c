"""Quantized weights (``mdiedge.model.quant``) and the products that read them
(``ext/_cquant.pyx``, its vector and scalar paths, and its twin ``mdiedge/model/_pyquant.py``):
the block layouts equal to llama.cpp's own reader and quantizer (the ``gguf`` package), every
kernel within 1e-5 of de-quantize-then-float32 for rows 1..8 and widths of one or several
blocks (the integer q8 kernels: of the activations quantized to 8 bits), a row's result
independent of its batch and threads, bad sizes and bad blocks refused with one line, and the
C kernels' unit test natively and on aarch64 (qemu) where the tools are installed."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Iterator, Tuple

import numpy as np
import pytest
import torch

from mdiedge.model.qlayers import QUANT
from mdiedge.base.errors import CheckpointError, QuantError
from mdiedge.model import quant
from quantblocks import random_blocks

ROOT = Path(__file__).resolve().parents[1]
IMPLS = QUANT.implementations()
PATHS = [("twin", IMPLS[0], True)] + [(f"compiled-{p}", m, p == "simd") for m in IMPLS[1:]
                                      for p in ("simd", "scalar")]
# widths of one and several blocks; for the 32-weight types, widths that are not multiples of
# 256; for F16 and BF16, widths that are not multiples of 8 or 16
WIDTHS = {1: (13, 100, 544), 32: (32, 96, 256, 544), 256: (256, 768)}


@pytest.fixture(params=PATHS, ids=[p[0] for p in PATHS])
def impl(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """Each implementation; the compiled one on its vector path and on its scalar one."""
    _, module, simd = request.param
    module.set_simd(simd)
    yield module
    module.set_simd(True)


def blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random valid blocks: random bytes, with each block's f16 scales (F16's and BF16's
    every value) set to finite small numbers of either sign."""
    return random_blocks(qtype, n, k, seed)


def within(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> Tuple[bool, float]:
    """Whether ``got`` is within 1e-5 of x W^T relative to sum |x| |W| (each output's scale),
    with the float32 product of the de-quantized weight as the reference; and the worst."""
    ref = (x @ weight.t()).double()
    scale = x.double().abs() @ weight.double().abs().t() + 1e-30
    worst = float(((got.double() - ref).abs() / scale).max())
    return worst <= 1e-5, worst


def test_types_are_ggmls() -> None:
    gguf = pytest.importorskip("gguf")
    for name, t in quant.TYPES.items():
        ggml = gguf.GGMLQuantizationType[name]
        assert t.ggml_id == int(ggml)
        assert (t.block, t.block_bytes) == gguf.GGML_QUANT_SIZES[ggml]
    # every type llama.cpp's usual presets write is multiplied natively
    assert set(quant.KERNEL_TYPES) == {"F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                       "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                                       "IQ4_XS"}
    codes = sorted(quant.TYPES[n].kernel for n in quant.KERNEL_TYPES)
    assert codes == list(range(len(codes)))


def test_the_compiled_modules_kernel_tables_are_the_type_table() -> None:
    """Each compiled module's ext/quant.h table (name, weights and bytes per block in enum
    order) is TYPES' (checked at import too); a stale one is refused with one line."""
    if len(IMPLS) < 2:
        pytest.skip("the compiled module is not built")
    compiled = IMPLS[1].COMPILED_TYPES
    assert [(quant.TYPES[n].kernel, quant.TYPES[n].block, quant.TYPES[n].block_bytes)
            for n, _, _ in compiled] == [(i, b, bb) for i, (_, b, bb) in enumerate(compiled)]
    quant.check_compiled(compiled, "_cquant")
    assert IMPLS[0].COMPILED_TYPES == compiled  # the twin runs the same types
    stale = list(compiled)
    stale[7] = ("Q5_0", 32, 20)
    with pytest.raises(QuantError, match=r"_cquant was built with quant type 7 = \('Q5_0', "
                                         r"32, 20\), but .* has \('Q5_0', 32, 22\): rebuild"):
        quant.check_compiled(stale, "_cquant")
    with pytest.raises(QuantError, match="quant type 13 = None"):
        quant.check_compiled(compiled[:-1], "_cstep")


@pytest.mark.parametrize("qtype", list(quant.TYPES))
def test_dequantize_equals_gguf(qtype: str) -> None:
    gguf = pytest.importorskip("gguf")
    k = 512 if quant.TYPES[qtype].block == 256 else 96
    raw = blocks(qtype, 5, k).numpy()
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    got = quant.dequantize(torch.from_numpy(raw), qtype, k)
    assert got.dtype == torch.float32 and got.shape == (5, k)
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("qtype", quant.QUANTIZERS)
def test_quantize_writes_ggmls_bytes_and_round_trips(qtype: str) -> None:
    gguf = pytest.importorskip("gguf")
    w = torch.randn(9, 160, generator=torch.Generator().manual_seed(3))
    w[0, :32] = 0  # an all-zero block: scale 0
    packed = quant.quantize(w, qtype)
    want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(packed.numpy(), want)
    back = quant.dequantize(packed, qtype, 160)
    top = w.reshape(-1, 32).abs().amax(1).repeat_interleave(32)
    # half a step (Q4_0: a whole one where +max clips to 7), and what rounding the scale
    # (and Q4_1's minimum) to f16 adds
    bound = {"Q8_0": 0.6 * top / 127, "Q4_0": 1.01 * top / 8, "Q4_1": 0.6 * 2 * top / 15}
    assert torch.all((back - w).abs().flatten() <= bound[qtype] + 1e-7)


@pytest.mark.twins
@pytest.mark.parametrize("qtype", quant.KERNEL_TYPES)
def test_matmul_equals_dequantize_then_float32(impl: ModuleType, qtype: str) -> None:
    """Every row count 1..8 and widths of one and several blocks (not powers of two)."""
    for k in WIDTHS[quant.TYPES[qtype].block]:
        w = blocks(qtype, 13, k, seed=k)
        weight = quant.dequantize(w, qtype, k)
        for rows in range(1, 9):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            out = torch.full((rows, 13), float("nan"))
            assert impl.matmul(x, w, qtype, out, 2) is out
            ok, worst = within(out, x, weight)
            assert ok, f"{qtype} k={k} rows={rows}: {worst:.2e}"


# the types with an integer (q8) kernel: a scalar reference each, and on these paths a kernel
# each (elsewhere, a type without one multiplies in float32)
Q8_TYPES = [n for n in quant.KERNEL_TYPES if quant.TYPES[n].act_block]
Q8_EVERY_TYPE = ("scalar", "avx2")


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "scalar"])
@pytest.mark.parametrize("qtype", Q8_TYPES)
def test_q8_matmul_equals_quantized_activations_then_float32(qtype: str, simd: bool) -> None:
    """dot=1: within 1e-5 of x quantized to 8 bits times the de-quantized weight, for rows
    1..11 and widths of one and several blocks, and not the float32 product (the integer
    kernel ran) on every path that has one for every type."""
    if len(IMPLS) < 2:
        pytest.skip("the compiled module is not built")
    compiled, block = IMPLS[1], quant.TYPES[qtype].block
    path = compiled.set_simd(simd)
    try:
        for k in WIDTHS[block]:
            w = blocks(qtype, 13, k, seed=k)
            weight = quant.dequantize(w, qtype, k)
            for rows in range(1, 12):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                got = compiled.matmul(x, w, qtype, torch.full((rows, 13), float("nan")), 1,
                                      dot=1)
                f32 = compiled.matmul(x, w, qtype, torch.empty(rows, 13), 1, dot=0)
                if path not in Q8_EVERY_TYPE and torch.equal(got, f32):
                    continue  # no integer kernel for this type on this path
                ok, worst = within(got, quant.quantized_activations(x, block), weight)
                assert ok, f"{qtype} {path} k={k} rows={rows}: {worst:.2e}"
                assert not within(got, x, weight)[0], f"{qtype} {path}: the float32 product"
    finally:
        compiled.set_simd(True)


@pytest.mark.twins
@pytest.mark.parametrize("qtype", quant.KERNEL_TYPES)
def test_dequantize_rows_equals_the_reference(impl: ModuleType, qtype: str) -> None:
    k = 512 if quant.TYPES[qtype].block == 256 else 96
    w = blocks(qtype, 11, k)
    out = torch.full((4, k), float("nan"))
    assert impl.dequantize_rows(w, qtype, 6, 4, out) is out
    assert torch.equal(out, quant.dequantize(w, qtype, k)[6:10])


@pytest.mark.parametrize("k", [512, 4352])
@pytest.mark.parametrize("qtype", quant.KERNEL_TYPES)
def test_rows_do_not_depend_on_batch_or_threads(qtype: str, k: int) -> None:
    """Compiled: a row's outputs are bit-identical alone or in a batch of 8, on 1 or 3
    threads, for rows of a few blocks and rows wider than 4096 weights."""
    if len(IMPLS) < 2:
        pytest.skip("the compiled module is not built")
    compiled = IMPLS[1]
    w = blocks(qtype, 70, k)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(5))
    batch = compiled.matmul(x, w, qtype, torch.empty(8, 70), 3)
    for r in range(8):
        alone = compiled.matmul(x[r:r + 1].contiguous(), w, qtype, torch.empty(1, 70), 1)
        assert torch.equal(alone, batch[r:r + 1])


@pytest.mark.twins
@pytest.mark.parametrize("dot", [0, 1], ids=["f32", "q8"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_1"])
def test_matmul_writes_a_stretch_of_columns_of_a_wider_array(impl: ModuleType, qtype: str,
                                                             dot: int) -> None:
    """out may be columns [5, 5 + n) of a wider array (a stacked matrix's part): the same
    values as into its own array, the columns beside it untouched; numpy and torch alike."""
    k = 512 if quant.TYPES[qtype].block == 256 else 96
    w = blocks(qtype, 37, k, seed=2)
    for rows in (1, 3, 12):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        alone = impl.matmul(x, w, qtype, torch.empty(rows, 37), 2, dot)
        wide = torch.full((rows, 50), float("nan"))
        impl.matmul(x, w, qtype, wide[:, 5:42], 2, dot)
        assert torch.equal(wide[:, 5:42], alone), f"{qtype} rows={rows}"
        assert wide[:, :5].isnan().all() and wide[:, 42:].isnan().all()
        into = np.full((rows, 50), np.nan, np.float32)
        impl.matmul(x.numpy(), w.numpy(), qtype, into[:, 5:42], 2, dot)
        assert np.array_equal(into[:, 5:42], alone.numpy())
        assert np.isnan(into[:, :5]).all() and np.isnan(into[:, 42:]).all()


def test_the_compiled_module_takes_the_vector_path_where_it_can() -> None:
    if len(IMPLS) < 2:
        pytest.skip("the compiled module is not built")
    compiled = IMPLS[1]
    assert compiled.set_simd(False) == "scalar"
    assert compiled.set_simd(True) == compiled.simd_path()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2 " in flags and " fma " in flags and " f16c " in flags:
        assert compiled.simd_path() == "avx2"
        assert compiled.integer_path() == ("avx2+avx512vnni" if has_vnni() else "avx2")


def has_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI on 256-bit vectors (the integer kernels' best x86
    variant)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    return "avx512_vnni" in flags and "avx512vl" in flags


def test_row_bytes_and_widths() -> None:
    assert quant.row_bytes("q4_1", 576) == 18 * 20
    assert quant.row_bytes("Q6_K", 768) == 3 * 210
    with pytest.raises(QuantError, match="width 576 is not a positive multiple of Q4_K's "
                                         "block of 256"):
        quant.row_bytes("Q4_K", 576)
    with pytest.raises(QuantError, match="weight type 'Q8_K' is not one of"):
        quant.row_bytes("Q8_K", 256)
    assert issubclass(QuantError, CheckpointError)


BAD_CALLS = [
    ("type", "no quantized kernel for F32"),
    ("width", "width 40 is not a positive multiple of Q4_1's block of 32"),
    ("row_bytes", r"weight rows of 21 bytes do not hold 64 Q4_1 weights \(40 bytes\)"),
    ("x_dtype", r"activations \(2, 64\) torch.float64 is not a contiguous float32"),
    ("x_strided", "activations .* is not a contiguous float32"),
    ("out_shape", r"out \(2, 4\) torch.float32 is not a float32 CPU tensor of shape \(2, 3\) "
                  "with contiguous rows"),
    ("out_strided", "out .* is not a float32 CPU tensor .* with contiguous rows"),
    ("out_overlapping", "out .* is not a float32 CPU tensor .* with contiguous rows"),
    ("w_dtype", r"quantized weight \(3, 40\) torch.int8 is not a contiguous uint8"),
    ("w_strided", "quantized weight .* is not a contiguous uint8"),
    ("threads", "threads 0 is not >= 1"),
]


@pytest.mark.twins
@pytest.mark.parametrize("case,match", BAD_CALLS, ids=[c for c, _ in BAD_CALLS])
def test_bad_calls_are_refused_with_one_line(impl: ModuleType, case: str, match: str) -> None:
    x, w, qtype = torch.randn(2, 64), blocks("Q4_1", 3, 64), "Q4_1"
    out, threads = torch.empty(2, 3), 1
    if case == "type":
        qtype = "F32"
    elif case == "width":
        x = torch.randn(2, 40)
    elif case == "row_bytes":
        w = w[:, :21].contiguous()
    elif case == "x_dtype":
        x = x.double()
    elif case == "x_strided":
        x = torch.randn(64, 2).t()
    elif case == "out_shape":
        out = torch.empty(2, 4)
    elif case == "out_strided":
        out = torch.empty(3, 2).t()
    elif case == "out_overlapping":  # rows 2 floats apart, 3 wide: each overlaps the next
        out = torch.empty(8).as_strided((2, 3), (2, 1))
    elif case == "w_dtype":
        w = w.view(torch.int8)
    elif case == "w_strided":
        w = torch.cat([w, w], 1)[:, :40]
    else:
        threads = 0
    with pytest.raises(QuantError, match=match) as caught:
        impl.matmul(x, w, qtype, out, threads)
    assert "\n" not in str(caught.value)


@pytest.mark.twins
def test_bad_row_ranges_are_refused(impl: ModuleType) -> None:
    w = blocks("Q8_0", 4, 64)
    with pytest.raises(QuantError, match=r"rows 3\.\.4 are not rows of a weight of 4 rows"):
        impl.dequantize_rows(w, "Q8_0", 3, 2, torch.empty(2, 64))
    with pytest.raises(QuantError, match="rows of 35 bytes are not whole Q8_0 blocks of 34"):
        impl.dequantize_rows(torch.zeros(4, 35, dtype=torch.uint8), "Q8_0", 0, 1,
                             torch.empty(1, 32))


@pytest.mark.parametrize("qtype,at", [("Q8_0", 0), ("Q4_1", 2), ("Q4_K", 2), ("Q6_K", 208)])
@pytest.mark.parametrize("bits", [0x7C00, 0x7E00], ids=["inf", "nan"])
def test_blocks_with_a_scale_that_is_not_finite_are_refused(qtype: str, at: int,
                                                            bits: int) -> None:
    t = quant.TYPES[qtype]
    w = blocks(qtype, 3, 2 * t.block)
    w[2, t.block_bytes + at:t.block_bytes + at + 2] = torch.tensor([bits & 255, bits >> 8])
    with pytest.raises(QuantError, match=f"{qtype} block 1 of row 2 has a scale of "
                                         "(inf|nan) \\(not finite\\)"):
        quant.dequantize(w, qtype, 2 * t.block)
    with pytest.raises(QuantError, match="block 1 of row 2"):
        quant.check_blocks(w, qtype)


def test_dequantize_refuses_misaligned_rows() -> None:
    with pytest.raises(QuantError, match=r"rows of 35 bytes do not hold 32 Q8_0 weights "
                                         r"\(34 bytes\)"):
        quant.dequantize(torch.zeros(2, 35, dtype=torch.uint8), "Q8_0", 32)
    with pytest.raises(QuantError, match="cannot quantize to Q4_K"):
        quant.quantize(torch.zeros(2, 256), "Q4_K")


def run_c_test(compiler: str, runner: Tuple[str, ...], tmp_path: Path) -> str:
    """ext/test_quant.c built with ``compiler`` and run (through ``runner``): its output."""
    binary = tmp_path / "test_quant"
    subprocess.run([compiler, "-O2", "-Wno-psabi", "-Wno-unknown-pragmas",
                    f"-I{ROOT / 'ext'}", "-o", str(binary), str(ROOT / "ext" / "test_quant.c"),
                    "-lm"], check=True, capture_output=True)
    done = subprocess.run([*runner, str(binary)], capture_output=True, text=True, timeout=300)
    if done.returncode == 2:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("target", ["native", "aarch64"])
def test_c_kernels_vector_path_equals_scalar(target: str, tmp_path: Path) -> None:
    """The vector path against the scalar reference in C, the float32 kernels and the integer
    ones (q8): AVX2 natively on x86-64, NEON on aarch64 under qemu-aarch64-static with a CPU
    that has the dot-product instructions (Debian: gcc-aarch64-linux-gnu, qemu-user-static)."""
    if not (ROOT / "ext" / "test_quant.c").exists():
        pytest.skip("no ext/ in this tree")
    if target == "native":
        if shutil.which("gcc") is None:
            pytest.skip("no gcc")
        out = run_c_test("gcc", (), tmp_path)
    else:
        if not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64-static")):
            pytest.skip("no aarch64-linux-gnu-gcc or qemu-aarch64-static")
        out = run_c_test("aarch64-linux-gnu-gcc", ("qemu-aarch64-static", "-cpu", "max", "-L",
                                                    "/usr/aarch64-linux-gnu"), tmp_path)
        assert "path neon" in out
    lines = out.splitlines()
    variants = (["neon-dotprod"] if target == "aarch64"
                else ["avx2", "avx2+avx512vnni"] if has_vnni() else [])
    for name in quant.KERNEL_TYPES:
        assert f"{name}: 24 cases, 0 mismatches" in lines, out
        for variant in variants if quant.TYPES[name].block > 1 else []:  # every type has one
            assert f"{name} integer {variant}: 27 cases, 0 mismatches" in lines, out
    ran = [line for line in lines if " integer " in line and " cases, " in line]
    assert all(line.endswith(" 0 mismatches") for line in ran), out
    assert ran or "no integer kernels on this CPU" in out, out
