"""Model families (``mdiedge.model.families``): the registry's lookups as tables, each family's
config and tensor names, the compiled step run only where a family declares it, and Qwen2 (a
block with Q/K/V biases) against transformers' Qwen2ForCausalLM, in one process and on a ring
of worker processes."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from conftest import TINY_LLAMA, write_tiny_tokenizer
from test_hf_parity import assert_logits_match, prompt_ids
from mdiedge.base.errors import ConfigError
from mdiedge.model import families
from mdiedge.model.config import ModelConfig
from mdiedge.model.families import (by_gguf_architecture, by_model_type, config_from_hf,
                                    config_to_hf, family_of)
from mdiedge.model.tensors import expected_shape, tensor_plan

KNOWN = ("known families: llama (llama, mistral), mixtral (mixtral), qwen2 (qwen2), qwen3 (qwen3), "
         "qwen3_moe (qwen3_moe), gemma3 (gemma3_text)")
CFG = ModelConfig(vocab_size=64, dim=40, n_layers=3, n_heads=4, n_kv_heads=2,
                  intermediate_size=52, max_seq_len=48)


# --------------------------------------------------------------------------- the registry


@pytest.mark.parametrize("model_type, family", [
    ("llama", "llama"), ("mistral", "llama"), ("mixtral", "mixtral"), ("qwen2", "qwen2")])
def test_model_types_find_their_family(model_type: str, family: str) -> None:
    assert by_model_type(model_type).name == family


@pytest.mark.parametrize("arch, moe, family", [
    ("llama", False, "llama"), ("llama", True, "mixtral"), ("qwen2", False, "qwen2")])
def test_gguf_architectures_find_their_family(arch: str, moe: bool, family: str) -> None:
    assert by_gguf_architecture(arch, moe, "f.gguf").name == family


@pytest.mark.parametrize("lookup, message", [
    (lambda: by_model_type("gpt2", "config.json"),
     f"config.json: unsupported model_type 'gpt2' ({KNOWN})"),
    (lambda: by_model_type(None, "config.json"),
     f"config.json: unsupported model_type None ({KNOWN})"),
    (lambda: by_gguf_architecture("gpt2", False, "f.gguf"),
     f"f.gguf: unsupported architecture 'gpt2' (supported: gemma3, llama, qwen2, qwen3, "
     f"qwen3moe; {KNOWN})"),
    (lambda: by_gguf_architecture("qwen2", True, "f.gguf"),
     "f.gguf: architecture 'qwen2' with experts is not supported"),
    (lambda: family_of(CFG.replace(n_experts=4, experts_per_token=2)),
     "model_type 'llama' is dense, but n_experts=4"),
    (lambda: family_of(CFG.replace(model_type="mixtral")),
     "model_type 'mixtral' is a mixture of experts, but n_experts=0"),
], ids=["model-type", "no-model-type", "architecture", "moe-architecture", "dense-with-experts",
        "moe-without"])
def test_unknown_families_are_one_line_naming_them(lookup: Any, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        lookup()
    assert str(e.value).endswith(message) and "\n" not in str(e.value)


QWEN2_HF = dict(TINY_LLAMA, model_type="qwen2", use_sliding_window=False, sliding_window=None)


@pytest.mark.parametrize("raw, field, value", [
    (QWEN2_HF, "model_type", "qwen2"),
    (dict(QWEN2_HF, use_sliding_window=True, sliding_window=64), "max_seq_len", 64),
    (dict(TINY_LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
     "n_experts", 4),
    (dict(TINY_LLAMA, model_type="llama", num_local_experts=4), "n_experts", 0),
])
def test_each_family_reads_its_own_keys(raw: Dict[str, Any], field: str, value: Any) -> None:
    assert getattr(config_from_hf(raw), field) == value


@pytest.mark.parametrize("model_type, architecture", [
    ("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("mixtral", "MixtralForCausalLM")])
def test_configs_round_trip_through_their_family(model_type: str, architecture: str) -> None:
    moe = dict(n_experts=3, experts_per_token=2) if model_type == "mixtral" else {}
    cfg = CFG.replace(model_type=model_type, **moe)
    hf = config_to_hf(cfg)
    assert hf["architectures"] == [architecture] and hf["model_type"] == model_type
    assert ("num_local_experts" in hf) == bool(moe)
    assert config_from_hf(hf).replace(name=cfg.name) == cfg


def test_qwen2_names_its_biases() -> None:
    cfg = CFG.replace(model_type="qwen2")
    plan = tensor_plan(cfg, (1, 2), False, False)
    biases = {k: v for k, v in plan.items() if k.endswith(".bias")}
    assert biases == {f"layers.1.attn.{w}.bias": f"model.layers.1.self_attn.{p}_proj.bias"
                      for w, p in (("wq", "q"), ("wk", "k"), ("wv", "v"))}
    assert [expected_shape(cfg, k) for k in biases] == [(40,), (20,), (20,)]
    assert len(plan) == 9 + 3 and len(tensor_plan(CFG, (1, 2), False, False)) == 9


# --------------------------------------------------------------------------- the compiled step


def _module(**changes: Any) -> Any:
    """A step module that is preferred, records the calls of ``blocks`` and ``logits`` and
    forwards them to the compiled step (or its twin where there is none)."""
    from types import SimpleNamespace

    from mdiedge.model.transformer import STEP

    step = STEP.implementations()[-1]
    calls: Dict[str, int] = {"blocks": 0, "logits": 0}

    def counted(name: str) -> Any:
        def call(*args: Any) -> Any:
            calls[name] += 1
            return getattr(step, name)(*args)
        return call

    return SimpleNamespace(**dict(vars(step), PREFERRED=True, blocks=counted("blocks"),
                                  logits=counted("logits"), calls=calls, **changes))


def _random_model(cfg: ModelConfig, seed: int = 0) -> Any:
    from mdiedge.model.transformer import Transformer

    torch.manual_seed(seed)
    net = Transformer(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    net.fuse_projections()
    return net


def _greedy(net: Any, steps: int) -> torch.Tensor:
    """Logits (steps + 1, vocab) of a greedy decode of a fixed prompt in slot 0."""
    net.setup_cache(1, net.cfg.max_seq_len)
    prompt = torch.randint(0, net.cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    slot = torch.tensor([0])
    with torch.inference_mode():
        out = [net(prompt, slot, [0])]
        for i in range(steps):
            out.append(net(out[-1].argmax(-1)[:, None], slot, [5 + i]))
    return torch.cat(out)


@pytest.mark.parametrize("step_blocks, step_head", [(False, True), (True, False), (False, False)])
def test_the_declaration_decides_where_the_step_runs(
        monkeypatch: pytest.MonkeyPatch, step_blocks: bool, step_head: bool) -> None:
    """A family with Llama's block and shapes, declared not to run the step (blocks, head or
    both), decodes those parts in torch, with the same tokens; Llama itself, the same
    weights, runs both through the step."""
    from mdiedge.model import transformer

    declared = dataclasses.replace(families.llama.FAMILY, name="declared",
                                   model_types=("declared",), step_blocks=step_blocks,
                                   step_head=step_head)
    monkeypatch.setitem(families.FAMILIES, "declared", declared)
    llama = _module()
    monkeypatch.setattr(transformer, "_step", llama)
    want = _greedy(_random_model(CFG), 4)
    assert llama.calls == {"blocks": 5, "logits": 5}  # the 5-token prompt is 5 rows of a step
    other = _module()
    monkeypatch.setattr(transformer, "_step", other)
    got = _greedy(_random_model(CFG.replace(model_type="declared")), 4)
    assert other.calls == {"blocks": 5 * step_blocks, "logits": 5 * step_head}
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- Qwen2


def make_hf_qwen2(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random ``Qwen2ForCausalLM`` (TINY_LLAMA's sizes, biases and norms random too)
    to ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**dict(TINY_LLAMA, **overrides))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: Any) -> Path:
    path = make_hf_qwen2(tmp_path_factory.mktemp("qwen2"), seed=7, num_hidden_layers=4)
    write_tiny_tokenizer(path)
    return path


def hf_qwen2(path: Path) -> Any:
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def test_qwen2_logits_match_transformers_through_the_block_step(
        qwen2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill and 32 decode steps within float32 rounding of Qwen2ForCausalLM; decode runs
    the blocks, biases included, through the step, and the head (where it is kept
    row-major)."""
    from mdiedge.model import transformer
    from mdiedge.model.checkpoint import load_model

    step = _module()
    monkeypatch.setattr(transformer, "_step", step)
    ref, ours = hf_qwen2(qwen2), load_model(qwen2)
    assert ours.family.name == "qwen2" and ours.layers["0"].attn.wq.bias is not None
    assert_logits_match(ref, ours)
    heads = 32 if ours.lm_head.weight.is_contiguous() else 0  # the twin's product: transposed
    assert step.calls == {"blocks": 32, "logits": heads}
    assert ours._step_weights()[0].qkv_bias is not None


@torch.no_grad()
def test_qwen2_greedy_generation_matches_transformers(qwen2: Path) -> None:
    from mdiedge.model.checkpoint import load_model
    from mdiedge.model.sampling import SamplingParams
    from mdiedge.base.request import ids_request
    from mdiedge.runtime.generation import Generation
    from mdiedge.runtime.scheduler import run_single

    prompt = prompt_ids(12, seed=1)
    want = hf_qwen2(qwen2).generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                                    min_new_tokens=48, eos_token_id=None, pad_token_id=0)[0, 12:]
    gen = Generation(ids_request(prompt, 48, 1, SamplingParams(temperature=0), 160), ())
    run_single(load_model(qwen2), gen)
    assert gen.samples[0].tokens == want.tolist()


@pytest.mark.parametrize("nodes", [2, 3])
def test_qwen2_on_a_ring_equals_transformers(qwen2: Path, nodes: int) -> None:
    """Greedy decode over real worker processes (one sample per message and micro-batched)
    gives transformers' tokens."""
    from mdiedge.model.sampling import SamplingParams
    from mdiedge.roles.local_ring import LocalRing
    from mdiedge.base.request import ids_request
    from mdiedge.engine.ring import RingEngine
    from mdiedge.runtime.generation import Generation

    prompt = prompt_ids(9, seed=2)
    with torch.no_grad():
        want = hf_qwen2(qwen2).generate(torch.tensor([prompt]), max_new_tokens=16,
                                        do_sample=False, min_new_tokens=16, eos_token_id=None,
                                        pad_token_id=0)[0, len(prompt):].tolist()
    local = LocalRing(nodes - 1, threads=1)
    with local as workers:
        engine = RingEngine(workers, qwen2, timeout_s=30, secret=local.secret)
        try:
            for micro_batch in (1, 0):
                gen = Generation(ids_request(prompt, 16, 2, SamplingParams(temperature=0), 160), ())
                engine.run(gen, micro_batch)
                assert [s.tokens for s in gen.samples] == [want] * 2, micro_batch
        finally:
            engine.close()


@torch.no_grad()
def test_qwen2_gguf_matches_transformers(qwen2: Path, tmp_path: Path) -> None:
    """A ``qwen2`` GGUF file (Q and K rows in Hugging Face's order, biases in F32): in F32 the
    logits of transformers; in Q8_0 every matrix keeps its blocks, the Q/K/V with their float
    biases beside them, and the logits stay near."""
    from gguf_files import write_gguf

    from mdiedge.model.checkpoint import load_model
    from mdiedge.model.qlayers import QuantLinear

    ids = torch.tensor([prompt_ids(16, seed=3)])
    theirs = hf_qwen2(qwen2)(ids).logits[0]
    got = {}
    for qtype in ("F32", "Q8_0"):
        model = load_model(write_gguf(tmp_path / f"q-{qtype}.gguf", qwen2, qtype))
        assert model.cfg.model_type == "qwen2"
        model.setup_cache(1, 32)
        got[qtype] = model(ids, torch.tensor([0]), [0], all_logits=True)[0]
        attn = model.layers["1"].attn
        assert attn.wq.bias is not None and attn.wq.bias.dtype == torch.float32
        assert (type(attn.wq) is QuantLinear) == (type(attn.wo) is QuantLinear) \
            == (qtype == "Q8_0")
    assert (got["F32"] - theirs).abs().max().item() <= 1e-5
    assert (got["Q8_0"] - theirs).abs().max().item() <= 0.05 * theirs.abs().max().item()


@torch.no_grad()
def test_qwen2_quantized_keeps_its_biases_float(qwen2: Path) -> None:
    """``--quantize``: every matrix of a whole number of blocks takes Q8_0, the Q/K/V with
    their float biases beside, and the logits stay near the float model's."""
    from mdiedge.model.checkpoint import load_model
    from mdiedge.model.qlayers import QuantLinear

    ids = torch.tensor([prompt_ids(16, seed=4)])
    logits = []
    for quantize in (None, "Q8_0"):
        model = load_model(qwen2, quantize=quantize)
        attn = model.layers["0"].attn
        assert attn.wq.bias is not None and attn.wq.bias.abs().sum() > 0
        assert (type(attn.wq) is QuantLinear) == (type(attn.wo) is QuantLinear) \
            == (quantize is not None)
        model.setup_cache(1, 32)
        logits.append(model(ids, torch.tensor([0]), [0], all_logits=True)[0])
    assert (logits[1] - logits[0]).abs().max().item() <= 0.05 * logits[0].abs().max().item()
