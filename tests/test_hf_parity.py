"""mdiedge's Llama against transformers' LlamaForCausalLM: logits and greedy generation."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from conftest import make_hf_llama
from mdiedge.model.checkpoint import load_config, load_model
from mdiedge.base.request import ids_request
from mdiedge.runtime.generation import Generation
from mdiedge.runtime.scheduler import run_single
from mdiedge.model.sampling import SamplingParams
from tolerance import assert_close

VARIANTS: Dict[str, Dict[str, Any]] = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "tied": dict(tie_word_embeddings=True),
    "llama3-rope": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "head-dim": dict(head_dim=16),
    "sharded": dict(),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request: Any, tmp_path_factory: Any) -> Path:
    name = request.param
    shard = "20KB" if name == "sharded" else None
    return make_hf_llama(tmp_path_factory.mktemp(name), seed=len(name), max_shard_size=shard,
                         **VARIANTS[name])


def hf_model(path: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def prompt_ids(n: int, seed: int = 0) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, 96, (n - 1,), generator=g).tolist()


def assert_logits_match(ref: Any, ours: Any, prompt_len: int = 20, steps: int = 32) -> None:
    """Our logits within 1e-5 of transformers' ``ref`` for a prefill of ``prompt_len`` tokens
    in slot 1, then ``steps`` greedy decode steps (transformers' choice fed to both)."""
    ours.setup_cache(2, 160)
    ids = torch.tensor([prompt_ids(prompt_len)])
    out = ref(ids, use_cache=True)
    theirs, past = out.logits[0], out.past_key_values
    mine = ours(ids, torch.tensor([1]), [0], all_logits=True)[0]
    assert (mine - theirs).abs().max().item() <= 1e-5
    token = theirs[-1].argmax()
    for step in range(steps):
        out = ref(token.view(1, 1), past_key_values=past, use_cache=True)
        theirs, past = out.logits[0, -1], out.past_key_values
        mine = ours(token.view(1, 1), torch.tensor([1]), [prompt_len + step])[0]
        assert (mine - theirs).abs().max().item() <= 1e-5, f"decode step {step}"
        token = theirs.argmax()


@torch.no_grad()
def test_logits_match_prefill_and_decode(checkpoint: Path) -> None:
    assert_logits_match(hf_model(checkpoint), load_model(checkpoint))


@torch.no_grad()
def test_greedy_generation_matches_transformers(checkpoint: Path) -> None:
    ref = hf_model(checkpoint)
    prompt = prompt_ids(12, seed=1)
    hf_tokens = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                             min_new_tokens=64, eos_token_id=None, pad_token_id=0)[0, 12:]
    gen = Generation(ids_request(prompt, 64, 1, SamplingParams(temperature=0), 160), ())
    run_single(load_model(checkpoint), gen)
    assert gen.samples[0].tokens == hf_tokens.tolist()


@pytest.mark.parametrize("cuts", [(2,), (1, 3)], ids=["2-chunks", "3-chunks"])
@torch.no_grad()
def test_chunks_give_the_same_logits(tiny_llama: Path, cuts: Any) -> None:
    n_layers = load_config(tiny_llama).n_layers
    bounds = [0, *cuts, n_layers]
    chunks = [load_model(tiny_llama, layers=(a, b), embedding=(a == 0), head=(b == n_layers))
              for a, b in zip(bounds, bounds[1:])]
    whole = load_model(tiny_llama)
    for m in chunks + [whole]:
        m.setup_cache(1, 64)
    ids = torch.tensor([prompt_ids(10)])
    slot = torch.tensor([0])
    x: torch.Tensor = ids
    for chunk in chunks:
        x = chunk(x, slot, [0], all_logits=True)
    assert torch.equal(x, whole(ids, slot, [0], all_logits=True))


def test_loading_a_range_reads_only_its_tensors(tiny_llama: Path) -> None:
    read: List[str] = []
    load_model(tiny_llama, layers=(1, 3), embedding=False, head=False,
               on_source=lambda source: read.extend(source.read_names))
    assert read and all(name.startswith(("model.layers.1.", "model.layers.2.")) for name in read)
    assert len(read) == 2 * 9


def test_batched_decode_equals_one_at_a_time(tiny_llama: Path) -> None:
    model = load_model(tiny_llama)
    prompts = [prompt_ids(4 + s, seed=s) for s in range(3)]
    singles = []
    for p in prompts:
        gen = Generation(ids_request(p, 16, 1, SamplingParams(temperature=0), 160), ())
        run_single(model, gen)
        singles.append(gen.samples[0].tokens)
    model.setup_cache(3, 64)
    with torch.no_grad():
        slots = torch.arange(3)
        for i, p in enumerate(prompts):
            model(torch.tensor([p]), slots[i:i + 1], [0])
        # rows at different positions in one forward: compare against the single-sample logits
        ids = torch.tensor([[singles[i][0]] for i in range(3)])
        batched = model(ids, slots, [len(p) for p in prompts]).argmax(-1).tolist()
    assert batched == [s[1] for s in singles]


@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (3, 1, 24), (8, 1, 24), (2, 4, 24),
                                   (9, 24), (4, 5, 24), (0, 24)])
def test_linear_matches_f_linear_for_every_row_count(shape: Any) -> None:
    """model.Linear takes another GEMM orientation for 2..8 rows; the product is the same."""
    from mdiedge.model.layers import Linear

    torch.manual_seed(0)
    layer = Linear(24, 40)
    x = torch.randn(shape)
    got = layer(x)
    assert got.shape == (*shape[:-1], 40) and got.is_contiguous()
    assert_close(got, torch.nn.functional.linear(x, layer.weight), 24)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loaded_head_storage(tmp_path: Path, tied: bool) -> None:
    """The loader keeps the head column-major (a contiguous (dim, vocab) buffer) where the
    twin product decodes (BLAS), row-major where the compiled one does; either way the values,
    the tie to the embedding and the logits are those of transformers."""
    from safetensors.torch import load_file

    from mdiedge.model.layers import transposed_head_pays

    path = make_hf_llama(tmp_path, seed=3, tie_word_embeddings=tied)
    model = load_model(path)
    head = model.lm_head.weight
    assert head.shape == (model.cfg.vocab_size, model.cfg.dim)
    assert head.is_contiguous() is not transposed_head_pays()
    assert (model.embed.weight is head) is tied
    stored = load_file(str(path / "model.safetensors"))
    expected = stored["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert torch.equal(head, expected)
    assert torch.equal(model.embed(torch.tensor([[0, 5, 95]])),
                       stored["model.embed_tokens.weight"][[0, 5, 95]].unsqueeze(0))
    layer = model.lm_head
    for rows in (1, 3, 20):
        x = torch.randn(rows, model.cfg.dim)
        assert_close(layer(x), x @ expected.t(), model.cfg.dim)
