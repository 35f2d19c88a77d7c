"""The committed K-quant GGUF test files (tests/data/gguf/) are what their README says:
llama-quantize's Q4_K_M and Q6_K of bin/make-gguf-testfiles' seeded random Llama, with
NanoLlama's SentencePiece vocabulary; and mdiedge runs them as transformers de-quantizes them."""
from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "gguf"
SCRIPT = ROOT / "bin" / "make-gguf-testfiles"
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Q4_K_M: llama.cpp keeps the (tied) embedding and, in the last of two blocks, attn_v and
# ffn_down at Q6_K; everything else Q4_K
Q4_K_M_SIX = {"token_embd.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight"}
# root-mean-square error over root-mean-square value of a de-quantized matrix, at most
RELATIVE_RMS = {"Q4_K": 0.09, "Q6_K": 0.025}


def script() -> Any:
    loader = importlib.machinery.SourceFileLoader("make_gguf_testfiles", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def reader(kind: str) -> Any:
    return gguf.GGUFReader(str(DATA / f"tiny-llama-2x256-{kind}.gguf"))


def expected_types(kind: str) -> Dict[str, str]:
    names = ["token_embd.weight"] + [f"blk.{b}.{m}.weight" for b in range(2) for m in MATRICES]
    types = {n: ("Q6_K" if kind == "Q6_K" or n in Q4_K_M_SIX else "Q4_K") for n in names}
    norms = [f"blk.{b}.{n}.weight" for b in range(2) for n in ("attn_norm", "ffn_norm")]
    return dict(types, **{n: "F32" for n in norms + ["output_norm.weight"]})


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q6_K"])
def test_each_file_holds_the_tensor_types_of_its_quantization(kind: str) -> None:
    found = {t.name: t.tensor_type.name for t in reader(kind).tensors}
    assert found == expected_types(kind)


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q6_K"])
def test_the_vocabulary_is_nanollamas_sentencepiece_model(kind: str) -> None:
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(ROOT / "models" / "nanollama" / "tokenizer.model"))
    fields = reader(kind).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert tokens == [sp.IdToPiece(i) for i in range(sp.vocab_size())]
    assert [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL] == [1, 2]
    assert types[0] == gguf.TokenType.UNKNOWN
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 1
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert fields["tokenizer.ggml.add_bos_token"].contents() is False


def test_the_weights_are_the_seeded_random_model_quantized() -> None:
    made = script()
    source = dict(made.gguf_tensors(made.random_llama(0)))
    for kind in ("Q4_K_M", "Q6_K"):
        for t in reader(kind).tensors:
            want = source[t.name]
            got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
            error = np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2))
            limit = RELATIVE_RMS.get(t.tensor_type.name, 0.0)
            assert error <= limit, (kind, t.name, t.tensor_type.name, error)


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q6_K"])
@torch.no_grad()
def test_mdiedge_runs_the_k_quants_as_transformers_de_quantizes_them(kind: str) -> None:
    """The K-quant blocks stay quantized in mdiedge (its Q4_K and Q6_K kernels) and give
    transformers' logits of the de-quantized file, and its greedy tokens."""
    from transformers import AutoModelForCausalLM

    from mdiedge.model.checkpoint import load_model
    from mdiedge.model.qlayers import QuantLinear
    from mdiedge.model.sampling import SamplingParams
    from mdiedge.base.request import ids_request
    from mdiedge.runtime.generation import Generation
    from mdiedge.runtime.scheduler import run_single

    file = DATA / f"tiny-llama-2x256-{kind}.gguf"
    ours = load_model(file)
    assert isinstance(ours.layers["0"].mlp.gate, QuantLinear)
    assert ours.layers["0"].mlp.gate.qtype == ("Q6_K" if kind == "Q6_K" else "Q4_K")
    ref = AutoModelForCausalLM.from_pretrained(str(DATA), gguf_file=file.name,
                                               dtype=torch.float32).eval()
    ids = [1] + torch.randint(3, 2048, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    ours.setup_cache(1, 64)
    theirs = ref(torch.tensor([ids])).logits[0]
    mine = ours(torch.tensor([ids]), torch.tensor([0]), [0], all_logits=True)[0]
    assert (mine - theirs).abs().max().item() <= 1e-4 * max(1.0, theirs.abs().max().item())
    want = ref.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                        do_sample=False, eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    gen = Generation(ids_request(ids, 16, 1, SamplingParams(temperature=0), 64), ())
    run_single(load_model(file), gen)
    assert gen.samples[0].tokens == want
