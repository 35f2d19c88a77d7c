"""The torch-free CPU chunk (``mdiedge.model.cpumodel.CpuModel``, built by ``cpuload``)
against the torch ``Transformer`` of the same file: logits of a prefill (more rows than the
step takes in one call, so in chunks) and of several decode steps over two slots within a
tight tolerance, greedy tokens identical; with the compiled step and with its numpy twin;
for every family the tiny GGUF files cover, the default model (safetensors), stories260K
(llama2.c) and SmolLM2 Q4_1; and a process that loads and runs one without torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch

from commands import package_child
from conftest import make_hf_llama, stories_dir
from mdiedge.base.errors import CpuPathRefused
from mdiedge.model import _pyquant, _pystep, cpumodel, npprefill
from mdiedge.model.checkpoint import load_model
from mdiedge.model.cpuload import load_cpu_model
from mdiedge.model._stepconstants import STEP_ROWS

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ([5, 9, 3, 17, 4, 8, 21, 2, 6, 11, 7], [3, 12, 4, 9, 15])  # 11 > MAX_ROWS rows
STEPS = 4


@pytest.fixture(params=["compiled", "twin"])
def step_impl(request: Any, monkeypatch: Any) -> str:
    """Each test once with the step the process selected and once with the numpy twins."""
    if request.param == "twin":  # both paths as without the compiled modules
        from mdiedge.model import qlayers, transformer

        monkeypatch.setattr(cpumodel, "_step", _pystep)
        monkeypatch.setattr(cpumodel, "_quant", _pyquant)
        monkeypatch.setattr(npprefill, "_quant", _pyquant)
        monkeypatch.setattr(transformer, "_step", _pystep)
        monkeypatch.setattr(qlayers, "_quant", _pyquant)
    elif cpumodel._step is _pystep:
        pytest.skip("the compiled step is not built")
    return request.param


def _torch_run(path: Path, quantize: Optional[str] = None) -> List[np.ndarray]:
    """The torch model's logits: each prompt's positions, then ``STEPS`` greedy decode
    steps of both slots at once."""
    model = load_model(path, quantize=quantize)
    model.setup_cache(2, 64)
    found, last = [], []
    with torch.no_grad():
        for slot, prompt in enumerate(PROMPTS):
            x = model.run_blocks(model.embed_tokens(torch.tensor([prompt])),
                                 torch.tensor([slot]), [0])
            logits = model.head_logits(x)[0].float().numpy()
            found.append(logits)
            last.append(int(logits[-1].argmax()))
        positions = [len(p) for p in PROMPTS]
        for _ in range(STEPS):
            x = model.run_blocks(model.embed_tokens(torch.tensor([[t] for t in last])),
                                 torch.tensor([0, 1]), positions)
            logits = model.head_logits(x[:, 0]).float().numpy()
            found.append(logits)
            last, positions = [int(r.argmax()) for r in logits], [p + 1 for p in positions]
    return found


def _cpu_run(path: Path, quantize: Optional[str] = None) -> List[np.ndarray]:
    """``_torch_run`` through a ``CpuModel``."""
    model = load_cpu_model(path, quantize=quantize)
    model.setup_cache(2, 64)
    found, last = [], []
    for slot, prompt in enumerate(PROMPTS):
        x = model.run_blocks(model.embed_tokens(np.array([prompt])), np.array([slot]), [0])
        logits = model.head_logits(x)[0]
        assert logits.dtype == np.float32 and logits.flags.c_contiguous
        found.append(logits)
        last.append(int(logits[-1].argmax()))
    positions = [len(p) for p in PROMPTS]
    for _ in range(STEPS):
        x = model.run_blocks(model.embed_tokens(np.array([[t] for t in last])),
                             np.array([0, 1]), positions)
        logits = model.head_logits(x[:, 0])
        found.append(logits)
        last, positions = [int(r.argmax()) for r in logits], [p + 1 for p in positions]
    return found


def assert_same_run(path: Path, tolerance: float = 2e-4, quantize: Optional[str] = None) -> None:
    want, got = _torch_run(path, quantize), _cpu_run(path, quantize)
    assert len(want) == len(got)
    for n, (w, g) in enumerate(zip(want, got)):
        assert w.shape == g.shape, n
        worst = float(np.abs(w - g).max())
        assert worst <= tolerance * max(1.0, float(np.abs(w).max())), (n, worst)
        assert (w.argmax(-1) == g.argmax(-1)).all(), n


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory: Any) -> Dict[str, Path]:
    """A tiny GGUF file of each family the step runs (tests/gguf_files.py's layout)."""
    from gguf_files import write_gguf
    from test_families import make_hf_qwen2
    from test_gemma3_qwen3 import make_hf

    made: Dict[str, Path] = {}
    for name, qtype, build in (
            ("llama-q8_0", "Q8_0", lambda p: make_hf_llama(p, seed=3, hidden_size=64,
                                                          intermediate_size=64)),
            ("llama-q4_1", "Q4_1", lambda p: make_hf_llama(p, seed=4, hidden_size=64,
                                                          intermediate_size=64)),
            ("qwen2", "F32", lambda p: make_hf_qwen2(p, seed=5)),
            ("qwen3", "F16", lambda p: make_hf("qwen3", p, seed=6)),
            ("qwen3_moe", "F32", lambda p: make_hf("qwen3_moe", p, seed=7)),
            ("gemma3", "F32", lambda p: make_hf("gemma3-gguf", p, seed=8))):
        folder = build(tmp_path_factory.mktemp(name))
        made[name] = write_gguf(folder / f"{name}.gguf", folder, qtype)
    return made


@pytest.mark.parametrize("name", ["llama-q8_0", "llama-q4_1", "qwen2", "qwen3", "qwen3_moe",
                                  "gemma3"])
def test_a_tiny_gguf_runs_as_the_torch_model(gguf_models: Dict[str, Path], name: str,
                                             step_impl: str) -> None:
    assert_same_run(gguf_models[name])


def test_the_default_model_runs_as_the_torch_model(step_impl: str) -> None:
    assert_same_run(ROOT / "models" / "nanollama")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_the_default_model_quantized_runs_as_the_torch_model(step_impl: str, qtype: str) -> None:
    """``--quantize``: the blocks' float matrices quantized as ``qlayers.quantize_blocks``
    quantizes them, so the same bytes multiply on both paths."""
    assert_same_run(ROOT / "models" / "nanollama", quantize=qtype)


def test_stories260k_runs_as_the_torch_model(step_impl: str) -> None:
    assert_same_run(stories_dir() / "stories260K.bin")


def test_smollm2_q4_1_runs_as_the_torch_model(step_impl: str) -> None:
    from smollm2 import gguf_file

    path = gguf_file()
    if path is None:
        pytest.skip("SmolLM2 Q4_1 not available")
    if step_impl == "twin":
        pytest.skip("the numpy twin is too slow for a 135M model here")
    assert_same_run(path, tolerance=1e-3)


@pytest.mark.realfiles
@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-1.5b"])
def test_a_real_file_runs_as_the_torch_model(name: str) -> None:
    """The real files (tests/realfiles.py) in the compiled step: Gemma 3's logits move by
    percents with a last-bit change of a RoPE value, so both paths read one table."""
    from realfiles import REAL_FILES

    if name not in REAL_FILES:
        pytest.skip(f"no real file {name!r}")
    path = REAL_FILES[name].path()
    if path is None or cpumodel._step is _pystep:
        pytest.skip(f"{name} not found, or the compiled step not built")
    assert_same_run(path, tolerance=1e-3)


def test_an_experts_load_counts_the_routed_rows(gguf_models: Dict[str, Path]) -> None:
    model = load_cpu_model(gguf_models["qwen3_moe"])
    model.setup_cache(1, 16)
    model.run_blocks(model.embed_tokens(np.array([[3, 4, 5]])), np.array([0]), [0])
    load = model.expert_load()
    assert sorted(load) == [str(i) for i in range(model.cfg.n_layers)]
    assert all(sum(counts) == 3 * model.cfg.experts_per_token for counts in load.values())


def test_the_route_says_numpy_decodes_without_the_compiled_step(
        gguf_models: Dict[str, Path], monkeypatch: Any) -> None:
    monkeypatch.setattr(cpumodel, "_step", _pystep)
    route = load_cpu_model(gguf_models["qwen2"]).decode_route
    assert route == {"blocks": "numpy", "head": "numpy",
                     "reason": "the compiled step is not built (numpy decodes, slowly)"}


def test_a_chunk_of_blocks_passes_hidden_states_on(gguf_models: Dict[str, Path]) -> None:
    """Two chunks (embedding + blocks [0, 2); blocks [2, 4) + head) give the whole model's
    logits; each says what it holds."""
    path = gguf_models["qwen2"]
    whole, first = load_cpu_model(path), load_cpu_model(path, (0, 2), True, False)
    second = load_cpu_model(path, (2, 4), False, True)
    assert (first.has_embedding, first.has_head, second.has_embedding, second.has_head) == (
        True, False, False, True)
    where = "step" if cpumodel._step.PREFERRED else "numpy"
    assert {k: v for k, v in first.decode_route.items() if k != "reason"} == {"blocks": where}
    assert {k: v for k, v in whole.decode_route.items() if k != "reason"} == {
        "blocks": where, "head": where}
    assert ("reason" in whole.decode_route) == (where == "numpy")
    for m in (whole, first, second):
        m.setup_cache(1, 16)
    tokens, slot = np.array([[7, 3, 9]]), np.array([0])
    want = whole.head_logits(whole.run_blocks(whole.embed_tokens(tokens), slot, [0]))
    x = first.run_blocks(first.embed_tokens(tokens), slot, [0])
    got = second.head_logits(second.run_blocks(x, slot, [0]))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert first.kv_cache_bytes() == second.kv_cache_bytes() == 2 * 2 * 4 * 16 * \
        whole.cfg.kv_dim
    assert 0 < first.parameter_bytes() < whole.parameter_bytes()


def test_prefill_in_chunks_equals_token_by_token(gguf_models: Dict[str, Path]) -> None:
    """A prompt in one call (more rows than the step takes: the numpy prefill) leaves the
    cache and the hidden states one token at a time (the step) does."""
    path = gguf_models["gemma3"]  # sliding windows too
    a, b = load_cpu_model(path), load_cpu_model(path)
    for m in (a, b):
        m.setup_cache(1, 32)
    tokens = np.array([[(5 * i + 3) % 90 for i in range(19)]])
    whole = a.run_blocks(a.embed_tokens(tokens), np.array([0]), [0])
    single = np.concatenate([b.run_blocks(b.embed_tokens(tokens[:, i:i + 1]), np.array([0]),
                                          [i]) for i in range(tokens.shape[1])], 1)
    np.testing.assert_allclose(whole, single, rtol=1e-5, atol=1e-5)
    for (ka, va), (kb, vb) in zip(a.caches, b.caches):
        np.testing.assert_allclose(ka, kb, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(va, vb, rtol=1e-5, atol=1e-5)


def _decode_each_alone(model: Any, twin: Any, wrap: Any, samples: int, rows_each: int) -> None:
    """Prefill ``samples`` slots of ``model`` and of ``twin`` (the same file loaded twice),
    prompts of 3 to 7 tokens, then one step of ``rows_each`` rows per sample, each from its
    own position: all at once on ``model``, each alone on ``twin``; equal bit for bit,
    hidden states and logits."""
    lengths = [3 + slot % 5 for slot in range(samples)]
    for m in (model, twin):
        m.setup_cache(samples, 32)
        for slot, length in enumerate(lengths):
            prompt = np.array([[(7 * slot + 3 * i + 1) % 90 for i in range(length)]])
            m.run_blocks(m.embed_tokens(wrap(prompt)), wrap(np.array([slot])), [0])
    tokens = np.array([[(11 * s + t) % 90 for t in range(rows_each)] for s in range(samples)])
    together = model.run_blocks(model.embed_tokens(wrap(tokens)), wrap(np.arange(samples)),
                                lengths)
    alone = [twin.run_blocks(twin.embed_tokens(wrap(tokens[s:s + 1])), wrap(np.array([s])),
                             [lengths[s]]) for s in range(samples)]
    np.testing.assert_array_equal(np.asarray(together),
                                  np.concatenate([np.asarray(a) for a in alone]))
    last = together[:, -1]  # the head: STEP_ROWS rows a call of the step, more on numpy
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(model.head_logits(last[s:s + STEP_ROWS]))
                        for s in range(0, samples, STEP_ROWS)]),
        np.concatenate([np.asarray(twin.head_logits(a[:, -1])) for a in alone]))


def _count_step_calls(monkeypatch: Any, step: Any) -> List[int]:
    """The rows of each call of ``step.blocks`` from now on (the list fills as they come)."""
    calls: List[int] = []
    blocks = step.blocks

    def counted(plan: Any, x: Any, *args: Any) -> None:
        calls.append(x.shape[0])
        blocks(plan, x, *args)

    monkeypatch.setattr(step, "blocks", counted)
    return calls


@pytest.mark.parametrize("name", ["llama-q8_0", "llama-q4_1", "qwen2", "qwen3", "qwen3_moe",
                                  "gemma3"])
@pytest.mark.parametrize("samples, rows_each", [(11, 1), (40, 1), (5, 7)])
@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_more_rows_than_a_step_call_decode_as_each_sample_alone(
        monkeypatch: Any, gguf_models: Dict[str, Path], name: str, samples: int,
        rows_each: int, mode: str) -> None:
    """Decode steps of many samples, one row or several verified rows each, run through the
    step in calls of up to STEP_ROWS rows, never the numpy prefill: the same bits as each
    sample alone (before, past 8 rows, the prefill's arithmetic, whose rounding differs, so
    that a sample's text depended on how many ran beside it)."""
    if not cpumodel._step.PREFERRED:
        pytest.skip("the compiled step is not built")
    from mdiedge.base import cpudot

    monkeypatch.setenv(cpudot.ENV, mode)  # q8: integer kernels, x8 layout, float16 cache
    cpudot.set_cpu_dot(None)
    calls = _count_step_calls(monkeypatch, cpumodel._step)
    monkeypatch.setattr(npprefill, "run_blocks", None)  # a call would fail
    path = gguf_models[name]
    _decode_each_alone(load_cpu_model(path), load_cpu_model(path), lambda a: a, samples,
                       rows_each)
    total = samples * rows_each
    pieces = -(-total // STEP_ROWS)
    assert calls[-samples - pieces:-samples] == \
        [STEP_ROWS] * (total // STEP_ROWS) + ([total % STEP_ROWS] if total % STEP_ROWS else [])


def test_the_torch_model_decodes_many_samples_as_each_alone(
        monkeypatch: Any, gguf_models: Dict[str, Path]) -> None:
    """The same on the torch model's CPU path: 40 samples in two calls of the step."""
    from mdiedge.model import transformer

    if not transformer._step.PREFERRED:
        pytest.skip("the compiled step is not built")
    calls = _count_step_calls(monkeypatch, transformer._step)
    with torch.no_grad():
        path = gguf_models["llama-q4_1"]
        _decode_each_alone(load_model(path), load_model(path), torch.as_tensor, 40, 1)
    assert calls[-40 - 2:-40] == [STEP_ROWS, 40 - STEP_ROWS]


def test_early_exit_is_not_run_here(gguf_models: Dict[str, Path]) -> None:
    model = load_cpu_model(gguf_models["qwen3"])
    model.setup_cache(1, 8)
    with pytest.raises(NotImplementedError):
        model.fill_kv(np.zeros((1, 1, model.cfg.dim), np.float32), np.array([0]), [0])
    with pytest.raises(AssertionError):
        model.run_blocks(np.zeros((1, 1, model.cfg.dim), np.float32), np.array([0]), [0],
                         step=object())


@pytest.mark.parametrize("mode, dtype", [("q8", np.float16), ("f32", np.float32)])
def test_the_q8_mode_keeps_a_float16_cache(monkeypatch: Any, gguf_models: Dict[str, Path],
                                           mode: str, dtype: type) -> None:
    """The q8 mode's cache is float16 (llama.cpp's), the exact f32 mode's float32; decode
    after a prefill reads it either way, and the two modes' logits stay close."""
    from mdiedge.base import cpudot

    monkeypatch.setenv(cpudot.ENV, mode)
    cpudot.set_cpu_dot(None)
    model = load_cpu_model(gguf_models["qwen3"])
    model.setup_cache(1, 16)
    assert all(k.dtype == dtype and v.dtype == dtype for k, v in model.caches)
    assert model.kv_cache_bytes() == 2 * np.dtype(dtype).itemsize * model.cfg.n_layers * 16 \
        * model.cfg.n_kv_heads * model.cfg.head_dim
    ids = np.array([[5, 9, 2, 7]])
    model.run_blocks(model.embed_tokens(ids), np.array([0]), [0])
    x = model.run_blocks(model.embed_tokens(np.array([[3]])), np.array([0]), [4])
    assert np.isfinite(model.head_logits(x[:, -1])).all()
    assert cpumodel.kv_dtype(cpudot.CODES[mode]) == dtype


def test_beyond_the_cache_is_one_line(gguf_models: Dict[str, Path]) -> None:
    model = load_cpu_model(gguf_models["qwen3"])
    model.setup_cache(1, 8)
    with pytest.raises(ValueError, match="beyond the KV cache length 8"):
        model.run_blocks(np.zeros((1, 3, model.cfg.dim), np.float32), np.array([0]), [6])


def test_a_long_context_holds_its_rope_tables_only_where_tokens_went(
        gguf_models: Dict[str, Path]) -> None:
    """Gemma 3's tables (global and sliding) for 131072 tokens would be 2 x 2 x 131072 x
    head_dim floats whole; a few tokens compute, and make resident, one step of rows, and
    the tokens decode as with a short context."""
    from mdiedge.model.rope import GrowingRope

    tokens = np.array([[1, 2, 3, 4]])
    outs = []
    for context in (16, 131072):
        model = load_cpu_model(gguf_models["gemma3"])
        model.setup_cache(1, context)
        before = _resident_anon_kib()
        outs.append(model.run_blocks(model.embed_tokens(tokens), np.array([0]), [0]))
        ropes = list(model._ropes.values())
        assert len(ropes) == 2
        assert all(r.filled == min(context, GrowingRope.ROWS_AT_ONCE) for r in ropes)
        whole_mib = 4 * 4 * context * model.cfg.head_dim / 2**20
        grown_mib = (_resident_anon_kib() - before) / 1024
        assert grown_mib < 8 < whole_mib or context == 16, (grown_mib, whole_mib)
    assert np.array_equal(outs[0], outs[1])


def _resident_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))


def test_a_family_the_step_does_not_run_is_refused(monkeypatch: Any,
                                                   gguf_models: Dict[str, Path]) -> None:
    import dataclasses

    from mdiedge.model import cpuload

    real = cpuload.family_of
    monkeypatch.setattr(cpuload, "family_of",
                        lambda cfg: dataclasses.replace(real(cfg), step_blocks=False))
    with pytest.raises(CpuPathRefused, match="does not run qwen2 blocks"):
        load_cpu_model(gguf_models["qwen2"])


NO_TORCH = """
import sys
sys.modules["torch"] = None  # any import of torch fails
import numpy as np
from mdiedge.model.cpuload import load_cpu_model
for path in sys.argv[1:]:
    model = load_cpu_model(path)
    model.setup_cache(1, 32)
    x = model.run_blocks(model.embed_tokens(np.array([[1, 5, 9, 4, 7, 3, 8, 2, 6, 10]])),
                         np.array([0]), [0])
    token = int(model.head_logits(x[:, -1])[0].argmax())
    x = model.run_blocks(model.embed_tokens(np.array([[token]])), np.array([0]), [10])
    assert model.head_logits(x[:, 0]).shape == (1, model.cfg.vocab_size)
print("ran", len(sys.argv) - 1)
"""


def test_a_cpu_model_loads_and_runs_without_torch(gguf_models: Dict[str, Path]) -> None:
    paths = [str(ROOT / "models" / "nanollama"), str(gguf_models["llama-q4_1"]),
             str(gguf_models["qwen3_moe"])]
    folder, env = package_child()
    done = subprocess.run([sys.executable, "-c", NO_TORCH, *paths], capture_output=True,
                          text=True, timeout=300, cwd=folder, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ran 3"


def test_open_chunk_picks_the_cpu_model_and_falls_back_to_torch(
        monkeypatch: Any, gguf_models: Dict[str, Path], caplog: Any) -> None:
    import dataclasses

    from mdiedge.model import chunks, cpuload
    from mdiedge.model.transformer import Transformer

    path = gguf_models["qwen3"]
    assert isinstance(chunks.open_chunk(path, None, True, True), cpumodel.CpuModel)
    assert isinstance(chunks.open_chunk(path, None, True, True, dtype_name="bfloat16"),
                      Transformer)
    real = cpuload.family_of
    monkeypatch.setattr(cpuload, "family_of",
                        lambda cfg: dataclasses.replace(real(cfg), step_head=False))
    with caplog.at_level("WARNING", logger="mdiedge.model"):
        chunk = chunks.open_chunk(path, (0, 2), True, True)
    assert isinstance(chunk, Transformer) and (chunk.first, chunk.last) == (0, 2)
    warned = [r.getMessage() for r in caplog.records if r.name == "mdiedge.model"]
    assert len(warned) == 1 and "does not run the qwen3 head" in warned[0]
    monkeypatch.setattr(chunks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CpuPathRefused, match=r"head \(install torch to run it: pip install"):
        chunks.open_chunk(path, None, True, True)


def _rss_anon() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status
                    if line.startswith("RssAnon"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_a_kv_cache_is_resident_only_where_written() -> None:
    """A large cache (numpy would ask for 2 MiB huge pages) written at one position per
    4 MiB: about a 4 KiB page each, not 2 MiB (where the kernel uses huge pages on request,
    as this machine's ``madvise`` setting does); zeros, writable and C-contiguous, as the
    step takes it."""
    cache = cpumodel._zeros((16, 1, 4096, 256), np.dtype(np.float32))  # 64 MiB
    assert cache.dtype == np.float32 and cache.flags.c_contiguous and cache.flags.writeable
    before = _rss_anon()
    cache[:, :, 0, 0] = 1.0  # one value every 4 MiB
    assert _rss_anon() - before < 8 << 20
    assert float(cache.sum()) == 16.0
