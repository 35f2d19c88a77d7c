"""The torch-free prefill (``mdiedge.model.npprefill``, through ``CpuModel.run_blocks`` and
``head_logits``) against the torch ``Transformer``'s prefill: hidden states and logits of
prompts of 40+ tokens, two samples in one call, a second chunk after earlier positions and
samples at different positions, within a tight tolerance, for every family of the tiny GGUF
files, stories260K, the default model and SmolLM2; greedy tokens identical on the real files
under the default dot mode; numpy's BLAS following the node's threads."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from commands import package_child
from conftest import stories_dir
from mdiedge.base import cpudot
from mdiedge.model import _pyquant, blasthreads, npprefill
from mdiedge.model.checkpoint import load_model
from mdiedge.model.cpuload import load_cpu_model
from test_cpumodel import gguf_models, step_impl  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[1]
CALLS = (  # (slots, positions, tokens per sample): every call more rows than the step takes
    ([0, 1], [0, 0], 43),  # two samples at once
    ([1], [43], 20),  # a second chunk of one sample
    ([1, 0], [63, 43], 12))  # two samples at different positions


def _tokens(vocab: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    return (np.arange(batch * seq_len).reshape(batch, seq_len) * 7 + seed) % (vocab - 1) + 1


def _cpu_prefill(path: Path) -> List[np.ndarray]:
    """Each call's hidden states, all its logits and its last rows' (the step's) logits."""
    model = load_cpu_model(path)
    model.setup_cache(2, 128)
    found = []
    for n, (slots, positions, seq_len) in enumerate(CALLS):
        tokens = _tokens(model.cfg.vocab_size, len(slots), seq_len, n)
        x = model.run_blocks(model.embed_tokens(tokens), np.array(slots), positions)
        found += [x, model.head_logits(x), model.head_logits(x[:, -1])]
    return found


def _torch_prefill(path: Path) -> List[np.ndarray]:
    model = load_model(path)
    model.setup_cache(2, 128)
    found = []
    with torch.no_grad():
        for n, (slots, positions, seq_len) in enumerate(CALLS):
            tokens = torch.from_numpy(_tokens(model.cfg.vocab_size, len(slots), seq_len, n))
            x = model.run_blocks(model.embed_tokens(tokens), torch.tensor(slots), positions)
            found += [t.float().numpy() for t in (x, model.head_logits(x),
                                                  model.head_logits(x[:, -1]))]
    return found


def assert_same_prefill(path: Path, tolerance: float = 2e-5) -> None:
    want, got = _torch_prefill(path), _cpu_prefill(path)
    for n, (w, g) in enumerate(zip(want, got)):
        assert w.shape == g.shape and g.dtype == np.float32, n
        worst = float(np.abs(w - g).max())
        assert worst <= tolerance * max(1.0, float(np.abs(w).max())), (n, worst)
        if n % 3:  # logits
            assert (w.argmax(-1) == g.argmax(-1)).mean() > 0.99, n


@pytest.mark.parametrize("name", ["llama-q8_0", "llama-q4_1", "qwen2", "qwen3", "qwen3_moe",
                                  "gemma3"])
def test_a_tiny_gguf_prefills_as_the_torch_model(gguf_models: Dict[str, Path],  # noqa: F811
                                                 name: str, step_impl: str) -> None:  # noqa
    assert_same_prefill(gguf_models[name])


def test_the_default_model_prefills_as_the_torch_model(step_impl: str) -> None:  # noqa: F811
    assert_same_prefill(ROOT / "models" / "nanollama")


def test_stories260k_prefills_as_the_torch_model(step_impl: str) -> None:  # noqa: F811
    assert_same_prefill(stories_dir() / "stories260K.bin")


def test_smollm2_prefills_as_the_torch_model(step_impl: str) -> None:  # noqa: F811
    from smollm2 import gguf_file

    path = gguf_file()
    if path is None:
        pytest.skip("SmolLM2 Q4_1 not available")
    if step_impl == "twin":
        pytest.skip("the numpy twin is too slow for a 135M model here")
    assert_same_prefill(path, tolerance=2e-4)


def test_a_sliding_window_sees_only_its_last_positions(monkeypatch: Any) -> None:
    """``attend`` (blocks of 2 queries, on two threads) against a plain softmax over the
    allowed keys, query by query."""
    monkeypatch.setattr(npprefill, "QUERY_BLOCK", 2)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 5, 8)).astype(np.float32)  # (heads, T, hd)
    keys, values = (rng.standard_normal((2, 16, 8)).astype(np.float32) for _ in range(2))
    for window in (0, 3):
        out = np.empty((5, 4, 8), np.float32)
        npprefill.attend(q, keys, values, out, 6, window, 0.5, threads=2)
        for t in range(5):
            seen = np.arange(16)
            seen = seen[(seen <= 6 + t) & ((seen > 6 + t - window) if window else True)]
            for h in range(4):
                scores = keys[h // 2, seen] @ q[h, t] * 0.5
                p = np.exp(scores - scores.max())
                want = (p / p.sum()) @ values[h // 2, seen]
                np.testing.assert_allclose(out[t, h], want, rtol=1e-5, atol=1e-6)


def test_a_prefill_product_uses_the_bounded_tile(monkeypatch: Any,
                                                 gguf_models: Dict[str, Path]  # noqa: F811
                                                 ) -> None:
    """A quantized product of more rows than the kernel takes (in the f32 mode: every type)
    de-quantizes tiles into one buffer of at most TILE_BYTES (a wider row than that: one row)
    and equals x @ W.T, on one thread or split among two."""
    monkeypatch.setattr(npprefill, "TILE_BYTES", 4 * 64 * 5)  # 5 rows of 64 a tile
    monkeypatch.setattr(npprefill, "_local", type(npprefill._local)())
    model = load_cpu_model(gguf_models["llama-q8_0"])
    matrix = model.weights.blocks[0].wo
    x = np.random.default_rng(1).standard_normal((12, matrix.shape[1])).astype(np.float32)
    out = npprefill.product(x, matrix, np.empty((12, matrix.shape[0]), np.float32), 1, 0)
    weight = np.empty(matrix.shape, np.float32)
    _pyquant.dequantize_rows(matrix.data, matrix.qtype, 0, matrix.shape[0], weight)
    np.testing.assert_allclose(out, x @ weight.T, rtol=1e-5, atol=1e-5)
    assert npprefill._local.tile.size * 4 == npprefill.TILE_BYTES
    two = npprefill.product(x, matrix, np.empty((12, matrix.shape[0]), np.float32), 2, 0)
    np.testing.assert_array_equal(two, out)  # split among threads: the same products


@pytest.mark.parametrize("qtype,k_quant", [("Q4_K", True), ("Q6_K", True), ("IQ4_XS", True),
                                           ("Q4_1", False), ("Q8_0", False), ("Q5_0", False)])
def test_a_q8_prefill_takes_the_integer_kernels_for_k_quants(qtype: str, k_quant: bool,
                                                              monkeypatch: Any) -> None:
    """Under q8, a prefill's product (more rows than the step takes) with a K-quant matrix, or
    one of a type with an x8 layout on this path, is the integer kernels' (the same numbers as
    the compiled product gives, whatever the threads), with another 32-weight type the
    tiles'; under f32 every type takes the tiles. The torch path's QuantLinear multiplies the
    same way (bit for bit where integer)."""
    from mdiedge.model import qlayers
    from mdiedge.model._stepconstants import QuantMatrix
    from quantblocks import random_blocks

    matrix = QuantMatrix(np.asarray(random_blocks(qtype, 40, 512, seed=2)), qtype)
    x = np.random.default_rng(2).standard_normal((20, 512)).astype(np.float32)
    kernels = qlayers.QUANT.select()
    usable = qtype in kernels.q8_types()
    integer = k_quant or qtype in kernels.x8_types()
    assert npprefill.integer_prefill(qtype, 1) == (integer and usable)
    assert not npprefill.integer_prefill(qtype, 0)
    got = npprefill.product(x, matrix, np.empty((20, 40), np.float32), 2, 1)
    direct = kernels.matmul(x, matrix.data, qtype, np.empty((20, 40), np.float32), 1, 1)
    tiles = npprefill.product(x, matrix, np.empty((20, 40), np.float32), 1, 0)
    if integer and usable:
        np.testing.assert_array_equal(got, direct)
        assert not np.array_equal(got, tiles)  # 8-bit activations: other numbers
    else:
        np.testing.assert_array_equal(got, tiles)
    layer = qlayers.QuantLinear(torch.from_numpy(matrix.data), qtype, 512)
    monkeypatch.setenv(cpudot.ENV, "q8")
    torch_got = layer(torch.from_numpy(x)).numpy()
    if integer and usable:
        np.testing.assert_array_equal(torch_got, got)
    else:  # torch's BLAS and numpy's round apart
        np.testing.assert_allclose(torch_got, got, rtol=1e-5, atol=1e-5 * np.abs(got).max())


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_gated_activation_is_the_formula_whatever_the_threads(activation: str) -> None:
    both = (np.random.default_rng(3).standard_normal((37, 20)) * 4).astype(np.float32)
    gate, up = both[:, :10].astype(np.float64), both[:, 10:].astype(np.float64)
    if activation == "silu":
        want = gate / (1 + np.exp(-gate)) * up
    else:
        want = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))) * up
    one = npprefill.gated(both, activation, 1)
    np.testing.assert_allclose(one, want, rtol=1e-5, atol=1e-5)
    for threads in (2, 3):
        np.testing.assert_array_equal(npprefill.gated(both, activation, threads), one)


def test_numpys_blas_follows_the_threads() -> None:
    if blasthreads.blas_calls() is None:
        pytest.skip("numpy's BLAS is not an OpenBLAS found here")
    for threads in (1, 2, 1):
        assert blasthreads.follow_threads(threads)
        assert blasthreads.blas_threads() == threads


GREEDY = """
import sys
import numpy as np
path, kind = sys.argv[1:]
if kind == "numpy":
    from mdiedge.model.cpuload import load_cpu_model
    model, wrap = load_cpu_model(path), np.array
else:
    import torch
    from mdiedge.model.checkpoint import load_model
    torch.set_grad_enabled(False)
    model, wrap = load_model(path), torch.tensor
model.setup_cache(1, 64)
def run(ids, position):
    x = model.run_blocks(model.embed_tokens(wrap([ids])), wrap([0]), [position])
    return int(np.asarray(model.head_logits(x[:, -1]))[0].argmax())
prompt = [(37 * i + 11) % 5000 + 200 for i in range(30)]
out = [run(prompt, 0)]
for n in range(15):
    out.append(run([out[-1]], len(prompt) + n))
print(kind, "torch" in sys.modules, " ".join(map(str, out)))
"""


def _greedy(path: Path, kind: str) -> List[str]:
    """The subprocess imports the package this process imported (installed and compiled in CI,
    where the source tree has no compiled modules)."""
    folder, env = package_child()
    done = subprocess.run([sys.executable, "-c", GREEDY, str(path), kind], capture_output=True,
                          text=True, timeout=900, cwd=folder, env=dict(env, MDIEDGE_CPU_DOT="f32"))
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


@pytest.mark.realfiles
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m", "qwen2.5-coder-1.5b"])
def test_greedy_tokens_are_the_torch_paths(name: str) -> None:
    """A prompt of 30 tokens and 16 greedy tokens in a process of each path: the same tokens
    under f32. Not under q8: the paths' float parts (attention, norms, the 32-weight types'
    prefill tiles) are numpy's on one and torch's on the other, and 8-bit rounding can grow
    their last-bit differences into another greedy token (SmolLM2 here; Qwen2.5 under CI's
    threads, not on a quiet run)."""
    if name == "smollm2":
        from smollm2 import gguf_file

        path = gguf_file()
    else:
        from realfiles import REAL_FILES

        path = REAL_FILES[name].path() if name in REAL_FILES else None
    if path is None:
        pytest.skip(f"{name} not found")
    numpy_run, torch_run = _greedy(path, "numpy"), _greedy(path, "torch")
    assert numpy_run[:2] == ["numpy", "False"] and torch_run[:2] == ["torch", "True"]
    assert len(numpy_run) == 18 and numpy_run[2:] == torch_run[2:]
