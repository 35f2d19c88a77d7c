"""Gemma 3 and Qwen3 (dense and MoE) against transformers' Gemma3ForCausalLM,
Qwen3ForCausalLM and Qwen3MoeForCausalLM: tiny random models as Hugging Face directories and
as GGUF files, logits and greedy tokens in one process and on a 3-node ring; the sliding
window of Gemma 3 shorter than the prompts (the real Gemma 3 270M file: test_real_files.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from conftest import TINY_LLAMA, write_tiny_tokenizer
from test_hf_parity import assert_logits_match, prompt_ids
from mdiedge.base.errors import ConfigError
from mdiedge.model.checkpoint import load_config, load_model
from mdiedge.model.families import config_from_hf, config_to_hf
from mdiedge.model.sampling import SamplingParams
from mdiedge.base.request import ids_request
from mdiedge.runtime.generation import Generation
from mdiedge.runtime.scheduler import run_single

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
MODELS: Dict[str, Any] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(TINY_LLAMA, head_dim=12)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        TINY_LLAMA, head_dim=12, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3_moe-unnormed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        TINY_LLAMA, head_dim=12, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        TINY_LLAMA, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=LAYER_TYPES, tie_word_embeddings=True, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    # as llama.cpp reads a gemma3 file: every 6th block global, scores by head_dim ** -0.5
    "gemma3-gguf": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        TINY_LLAMA, num_hidden_layers=7, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=4, tie_word_embeddings=True)),
}


def make_hf(kind: str, path: Path, seed: int = 0) -> Path:
    """Save a random model of ``MODELS[kind]`` to ``path``: matrices wider than the default
    init, norms random (Gemma's around 0, its weight being 1 + w)."""
    import transformers

    config_class, model_class, values = MODELS[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**values)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
            elif kind.startswith("gemma3"):
                p.uniform_(-0.5, 0.5)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request: Any, tmp_path_factory: Any) -> Path:
    folder = tmp_path_factory.mktemp(f"{request.param}-")  # e.g. qwen3-0
    return make_hf(request.param, folder, seed=len(request.param))


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt: List[int], n: int) -> List[int]:
    with torch.no_grad():
        out = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                      min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(model: Any, prompt: List[int], n: int) -> List[int]:
    gen = Generation(ids_request(prompt, n, 1, SamplingParams(temperature=0), 160), ())
    run_single(model, gen)
    return list(gen.samples[0].tokens)


# --------------------------------------------------------------------------- configs


def test_the_configs_read_their_features(model_dir: Path) -> None:
    cfg = load_config(model_dir)
    kind = model_dir.name.rsplit("-", 1)[0]
    assert cfg.head_dim == (12 if kind.startswith("qwen3") else 16) != cfg.dim // cfg.n_heads
    if kind == "gemma3":
        assert (cfg.sliding_window, cfg.sliding_layers) == (4, (0, 1, 3))
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (
            1e6, 1e4, 24)
    if kind == "gemma3-gguf":
        assert cfg.sliding_layers == (0, 1, 2, 3, 4, 6) and cfg.max_seq_len == 160
    if kind.startswith("qwen3_moe"):
        assert (cfg.n_experts, cfg.intermediate_size) == (4, 24)
        assert cfg.norm_topk_prob == (kind == "qwen3_moe")
    assert config_from_hf(config_to_hf(cfg)).replace(name=cfg.name) == cfg


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0},
                           "sliding_attention": {"rope_type": "default"}}),
     "unsupported rope type 'linear' for Gemma 3 (supported: default)"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not supported"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    (dict(layer_types=["full_attention"]), "layer_types must list"),
])
def test_gemma3_configs_it_cannot_run_are_one_line(changes: Dict[str, Any], message: str) -> None:
    raw = dict(TINY_LLAMA, model_type="gemma3_text", head_dim=16, sliding_window=4, **changes)
    with pytest.raises(ConfigError) as e:
        config_from_hf(raw, "config.json")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_qwen3_moe_with_dense_blocks_is_one_line() -> None:
    raw = dict(TINY_LLAMA, model_type="qwen3_moe", moe_intermediate_size=8, num_experts=4,
               num_experts_per_tok=2, mlp_only_layers=[1])
    with pytest.raises(ConfigError, match="dense blocks among the experts"):
        config_from_hf(raw, "config.json")


# --------------------------------------------------------------------------- one process


def assert_decoded_in_the_step(model: Any) -> None:
    """Where the compiled step is built, every block decoded in it (MoE blocks too)."""
    from mdiedge.model import transformer

    if transformer._step.PREFERRED:
        assert transformer.route_of(model)["blocks"] == "step"


@torch.no_grad()
def test_logits_match_transformers(model_dir: Path) -> None:
    """Prefill of 20 tokens (5 windows of Gemma's sliding layers) and 32 decode steps, in
    the compiled step."""
    model = load_model(model_dir)
    assert_logits_match(hf_model(model_dir), model)
    assert_decoded_in_the_step(model)


@torch.no_grad()
def test_greedy_tokens_match_transformers(model_dir: Path) -> None:
    prompt = prompt_ids(12, seed=1)
    assert greedy(load_model(model_dir), prompt, 40) == hf_greedy(model_dir, prompt, 40)


@torch.no_grad()
def test_uncached_forward_equals_the_cached_one(model_dir: Path) -> None:
    """The causal whole-sequence pass (training, calibration) with the sliding mask."""
    model = load_model(model_dir)
    ids = torch.tensor([prompt_ids(14, seed=2)])
    uncached = model.head_logits(model.hidden_states(ids)[-1])
    model.setup_cache(1, 32)
    cached = model(ids, torch.tensor([0]), [0], all_logits=True)
    torch.testing.assert_close(uncached, cached, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_written_checkpoint_reads_back_in_transformers(model_dir: Path, tmp_path: Path) -> None:
    """``save_hf_checkpoint``: the family's config.json and tensors (Gemma's norms less 1)."""
    from mdiedge.model.checkpoint import save_hf_checkpoint

    save_hf_checkpoint(load_model(model_dir), tmp_path)
    assert_logits_match(hf_model(tmp_path), load_model(model_dir), steps=4)


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory: Any) -> Dict[str, Path]:
    """The GGUF kinds' Hugging Face directories and their F32 files (with a tokenizer)."""
    from gguf_files import write_gguf

    out = {}
    for kind in ("qwen3", "qwen3_moe", "gemma3-gguf"):
        folder = make_hf(kind, tmp_path_factory.mktemp(kind), seed=3)
        (folder / "gguf").mkdir()
        write_tiny_tokenizer(folder / "gguf")
        write_gguf(folder / "gguf" / "tiny.gguf", folder, "F32")
        out[kind] = folder
    return out


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "gemma3-gguf"])
@torch.no_grad()
def test_a_gguf_file_equals_its_hf_directory(gguf_dirs: Dict[str, Path], kind: str) -> None:
    """Same config (Gemma's norms stored 1 + w) and logits within float32 rounding."""
    from test_gguf import as_float32

    folder = gguf_dirs[kind]
    file = folder / "gguf" / "tiny.gguf"
    assert load_config(file).replace(name="x") == as_float32(load_config(folder))
    model = load_model(file)
    assert_logits_match(hf_model(folder), model)
    assert_decoded_in_the_step(model)


# --------------------------------------------------------------------------- ring


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "gemma3-gguf"])
def test_a_three_node_ring_equals_transformers(gguf_dirs: Dict[str, Path], kind: str) -> None:
    """Greedy decode over two worker processes that receive their blocks from the starter
    (the GGUF file's tensors, Gemma's norms included, as pushed chunks)."""
    from mdiedge.engine.ring import RingEngine
    from mdiedge.roles.local_ring import LocalRing

    folder = gguf_dirs[kind]
    prompt = prompt_ids(9, seed=2)
    want = hf_greedy(folder, prompt, 16)
    local = LocalRing(2, threads=1)
    with local as workers:
        engine = RingEngine(workers, folder / "gguf" / "tiny.gguf", timeout_s=30,
                            share_path=False, secret=local.secret)
        try:
            gen = Generation(ids_request(prompt, 16, 2, SamplingParams(temperature=0), 160), ())
            engine.run(gen, 0)
            assert [s.tokens for s in gen.samples] == [want] * 2
        finally:
            engine.close()
