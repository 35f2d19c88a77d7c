"""Mixture of experts: the expert routing (compiled and pure-Python twin) and the Mixtral model
against transformers' MixtralForCausalLM (logits, greedy generation, split chunks)."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch

from mdiedge.model import grouping, transformer
from mdiedge.model.transformer import route_of
from tolerance import assert_close, model_path_length

IMPLS = [grouping]


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


def random_routing(rng: np.random.Generator, n: int, k: int, n_experts: int
                   ) -> Tuple[np.ndarray, np.ndarray]:
    """k distinct experts per token (as top-k gives) and weights that sum to one."""
    idx = np.argsort(rng.random((n, n_experts)), axis=1)[:, :k].astype(np.int64)  # (n, k)
    w = rng.random((n, k)).astype(np.float32) + 0.01
    return idx, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def assignments(offsets: np.ndarray, tokens: np.ndarray, weights: np.ndarray
                ) -> List[Tuple[int, int, float]]:
    """(token, expert, weight) for every grouped assignment, sorted."""
    out = []
    for e in range(len(offsets) - 1):
        for pos in range(offsets[e], offsets[e + 1]):
            out.append((int(tokens[pos]), e, float(weights[pos])))
    return sorted(out)


def check_grouping(result: Tuple[np.ndarray, np.ndarray, np.ndarray], idx: np.ndarray,
                   w: np.ndarray, n_experts: int) -> None:
    offsets, tokens, weights = result
    n, k = idx.shape
    assert offsets.dtype == np.int64 and tokens.dtype == np.int64 and weights.dtype == np.float32
    assert offsets.shape == (n_experts + 1,) and tokens.shape == weights.shape == (n * k,)
    assert offsets[0] == 0 and offsets[-1] == n * k and (np.diff(offsets) >= 0).all()
    for e in range(n_experts):  # ascending token rows within each expert
        assert (np.diff(tokens[offsets[e]:offsets[e + 1]]) >= 0).all()
    want = sorted((t, int(idx[t, j]), float(w[t, j])) for t in range(n) for j in range(k))
    assert assignments(offsets, tokens, weights) == want


# --------------------------------------------------------------------------- routing


@pytest.mark.twins
@pytest.mark.parametrize("n,k,n_experts", [(1, 2, 8), (7, 2, 4), (64, 2, 6), (33, 1, 8)])
def test_every_token_lands_on_exactly_its_k_experts(impl: ModuleType, n: int, k: int,
                                                    n_experts: int) -> None:
    idx, w = random_routing(np.random.default_rng(n), n, k, n_experts)
    result = impl.group_by_expert(idx, w, n_experts)
    check_grouping(result, idx, w, n_experts)
    offsets, tokens, weights = result
    per_token = np.zeros(n, dtype=np.float64)
    np.add.at(per_token, tokens, weights)
    np.testing.assert_allclose(per_token, 1.0, atol=1e-6)  # weights sum to one per token
    assert np.bincount(tokens, minlength=n).tolist() == [k] * n


@pytest.mark.twins
def test_empty_experts(impl: ModuleType) -> None:
    idx = np.array([[1, 3], [3, 1], [1, 3]], dtype=np.int64)
    w = np.full((3, 2), 0.5, dtype=np.float32)
    offsets, tokens, weights = impl.group_by_expert(idx, w, 6)
    assert offsets.tolist() == [0, 0, 3, 3, 6, 6, 6]
    assert tokens.tolist() == [0, 1, 2, 0, 1, 2]
    check_grouping((offsets, tokens, weights), idx, w, 6)


@pytest.mark.twins
def test_all_tokens_on_one_expert(impl: ModuleType) -> None:
    idx = np.full((5, 1), 2, dtype=np.int64)
    w = np.ones((5, 1), dtype=np.float32)
    offsets, tokens, weights = impl.group_by_expert(idx, w, 4)
    assert offsets.tolist() == [0, 0, 0, 5, 5]
    assert tokens.tolist() == [0, 1, 2, 3, 4] and weights.tolist() == [1.0] * 5


@pytest.mark.twins
def test_k_equals_n_experts(impl: ModuleType) -> None:
    idx, w = random_routing(np.random.default_rng(1), 9, 4, 4)
    offsets, tokens, weights = impl.group_by_expert(idx, w, 4)
    assert offsets.tolist() == [0, 9, 18, 27, 36]
    for e in range(4):
        assert tokens[offsets[e]:offsets[e + 1]].tolist() == list(range(9))
    check_grouping((offsets, tokens, weights), idx, w, 4)


@pytest.mark.twins
def test_no_tokens(impl: ModuleType) -> None:
    offsets, tokens, weights = impl.group_by_expert(
        np.zeros((0, 2), dtype=np.int64), np.zeros((0, 2), dtype=np.float32), 4)
    assert offsets.tolist() == [0] * 5 and offsets.dtype == np.int64
    assert tokens.shape == (0,) and tokens.dtype == np.int64
    assert weights.shape == (0,) and weights.dtype == np.float32


@pytest.mark.twins
def test_torch_tensors_are_accepted(impl: ModuleType) -> None:
    idx = torch.tensor([[0, 2], [2, 1]])
    w = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    offsets, tokens, weights = impl.group_by_expert(idx, w, 3)
    assert offsets.tolist() == [0, 1, 2, 4]
    assert tokens.tolist() == [0, 1, 0, 1] and weights.tolist() == [0.75, 0.5, 0.25, 0.5]


@pytest.mark.twins
@pytest.mark.parametrize("idx,message", [
    ([[0, 1], [4, 2]], "expert index 4 outside [0, 4)"),
    ([[0, -1], [9, 2]], "expert index -1 outside [0, 4)"),  # the first bad value, row-major
    ([[0, 1], [2, 4000000000]], "expert index 4000000000 outside [0, 4)"),
])
def test_bad_index_is_a_clear_error(impl: ModuleType, idx: List[List[int]], message: str
                                    ) -> None:
    with pytest.raises(ValueError) as e:
        impl.group_by_expert(np.array(idx, dtype=np.int64), np.ones((2, 2), np.float32), 4)
    assert str(e.value) == message


@pytest.mark.twins
def test_bad_shapes_are_clear_errors(impl: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"topk_idx must be 2-D \(N, k\), got shape \(3,\)"):
        impl.group_by_expert(np.zeros(3, np.int64), np.zeros(3, np.float32), 4)
    with pytest.raises(ValueError, match=r"topk_w shape \(3, 1\) differs from topk_idx shape"):
        impl.group_by_expert(np.zeros((3, 2), np.int64), np.zeros((3, 1), np.float32), 4)
    with pytest.raises(ValueError, match="n_experts must be positive, got 0"):
        impl.group_by_expert(np.zeros((0, 2), np.int64), np.zeros((0, 2), np.float32), 0)


@pytest.mark.twins
def test_twins_agree_on_random_inputs() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        n_experts = int(rng.integers(1, 10))
        k = int(rng.integers(1, n_experts + 1))
        n = int(rng.integers(0, 40))
        idx = rng.integers(0, n_experts, size=(n, k)).astype(np.int64)  # repeats allowed
        w = rng.random((n, k)).astype(np.float32)
        results = [m.group_by_expert(idx, w, n_experts) for m in IMPLS]
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert a.dtype == b.dtype and np.array_equal(a, b)
        check_grouping(results[0], idx, w, n_experts)


# --------------------------------------------------------------------------- the MoE module


def moe_config(**overrides: Any) -> Any:
    from mdiedge.model.config import ModelConfig

    values: Dict[str, Any] = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                  intermediate_size=48, n_experts=6, experts_per_token=2,
                                  model_type="mixtral")
    values.update(overrides)
    return ModelConfig(**values)


def dense_reference(moe: Any, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the (renormalised) top-k probabilities."""
    x_flat = x.reshape(-1, x.shape[-1])  # (N, dim)
    probs = torch.softmax(moe.router(x_flat).float(), dim=-1)  # (N, E)
    w, idx = probs.topk(moe.top_k, dim=-1)
    gates = torch.zeros_like(probs).scatter(1, idx, w / w.sum(-1, keepdim=True))  # (N, E)
    outs = torch.stack([e(x_flat) for e in moe.experts], dim=1)  # (N, E, dim)
    return (gates[..., None] * outs).sum(1).view_as(x)


@torch.no_grad()
def test_moe_matches_a_dense_computation_with_every_routing() -> None:
    from mdiedge.model.moe import MoE

    torch.manual_seed(0)
    x = torch.randn(3, 5, 32)
    base = MoE(moe_config())
    want = dense_reference(base, x)
    for routing in [*IMPLS, "torch"]:
        moe = MoE(moe_config(), routing=routing)
        moe.load_state_dict(base.state_dict())
        cfg = moe_config()  # the router, an expert's MLP, the sum over the experts
        assert_close(moe(x), want, 3 * cfg.dim + cfg.intermediate_size + cfg.n_experts)


@torch.no_grad()
def test_expert_counts_accumulate_and_reset() -> None:
    from mdiedge.model.moe import MoE

    torch.manual_seed(1)
    moe = MoE(moe_config())
    x = torch.randn(2, 7, 32)
    moe(x)
    moe(x[:, :3])
    counts = moe.expert_counts
    assert counts.dtype == torch.int64 and counts.device.type == "cpu"
    assert counts.shape == (6,) and int(counts.sum()) == (14 + 6) * 2
    assert "expert_counts" not in moe.state_dict()
    moe.reset_stats()
    assert int(moe.expert_counts.sum()) == 0


def test_moe_trains() -> None:
    """With gradients the grouping runs as torch ops, so the router gets a gradient too."""
    from mdiedge.model.moe import MoE

    torch.manual_seed(2)
    moe = MoE(moe_config())
    moe(torch.randn(2, 4, 32)).pow(2).sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    used = [e for e in moe.experts if e.gate.weight.grad is not None]
    assert used and all(e.down.weight.grad.abs().sum() > 0 for e in used)


# --------------------------------------------------------------------------- transformers parity

TINY_MIXTRAL: Dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
VARIANTS: Dict[str, Dict[str, Any]] = {
    "4x-top1": dict(num_local_experts=4, num_experts_per_tok=1),
    "4x-top2": dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=3),
    "8x-top1": dict(num_local_experts=8, num_experts_per_tok=1, num_hidden_layers=3),
    "8x-top2": dict(num_local_experts=8, num_experts_per_tok=2),
}
EXPERT_LAYOUT = ("w1", "w2", "w3")  # what transformers 5 writes (it fuses experts in memory)


def make_hf_mixtral(path: Path, seed: int, **overrides: Any) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**dict(TINY_MIXTRAL, **overrides))).eval()
    with torch.no_grad():  # larger weights than the default init: less flat logits and routing
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def mixtral(request: Any, tmp_path_factory: Any) -> Path:
    name = request.param
    return make_hf_mixtral(tmp_path_factory.mktemp(name), seed=len(name) + ord(name[0]),
                           **VARIANTS[name])


def hf_model(path: Path) -> Any:
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([[1] + torch.randint(3, 128, (n - 1,), generator=g).tolist()])  # (1, n)


def test_checkpoint_layout_is_read(mixtral: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(mixtral / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {f"model.layers.0.block_sparse_moe.experts.0.{w}.weight"
            for w in EXPERT_LAYOUT} <= names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


@torch.no_grad()
def test_logits_match_prefill_and_decode(mixtral: Path) -> None:
    ref = hf_model(mixtral)
    ours = load(mixtral)
    ours.setup_cache(1, 256)
    ids = prompt(16)
    out = ref(ids, use_cache=True)
    theirs, past = out.logits[0], out.past_key_values
    slot = torch.tensor([0])
    mine = ours(ids, slot, [0], all_logits=True)[0]  # (16, vocab)
    assert (mine - theirs).abs().max().item() <= 1e-5
    token = theirs[-1].argmax()
    for step in range(32):
        out = ref(token.view(1, 1), past_key_values=past, use_cache=True)
        theirs, past = out.logits[0, -1], out.past_key_values
        mine = ours(token[None, None], slot, [16 + step])[0]
        assert (mine - theirs).abs().max().item() <= 1e-5, f"decode step {step}"
        token = theirs.argmax()
    moe = ours.layers["0"].mlp
    assert int(moe.expert_counts.sum()) == (16 + 32) * moe.top_k  # the step counts too
    if transformer._step.PREFERRED:
        assert route_of(ours)["blocks"] == "step"


def load(path: Path, **kwargs: Any) -> Any:
    from mdiedge.model.checkpoint import load_model
    from mdiedge.model.moe import MoE

    model = load_model(path, **kwargs)
    assert all(isinstance(b.mlp, MoE) for b in model.layers.values())
    return model


def greedy(model: Any, ids: torch.Tensor, n_new: int) -> List[int]:
    model.setup_cache(1, 256)
    slot = torch.tensor([0])
    logits = model(ids, slot, [0])  # (1, vocab)
    pos, out = ids.shape[1], []
    for _ in range(n_new):
        token = logits.argmax(-1)  # (1,)
        out.append(int(token))
        logits = model(token[None], slot, [pos])
        pos += 1
    return out


@torch.no_grad()
def test_greedy_generation_matches_transformers(mixtral: Path) -> None:
    ref = hf_model(mixtral)
    ids = prompt(16, seed=1)
    hf_tokens = ref.generate(ids, max_new_tokens=64, do_sample=False, min_new_tokens=64,
                             eos_token_id=None, pad_token_id=0)[0, 16:]
    assert greedy(load(mixtral), ids, 64) == hf_tokens.tolist()


@torch.no_grad()
def test_two_chunks_give_the_same_logits(mixtral: Path) -> None:
    from mdiedge.model.checkpoint import load_config

    n_layers = load_config(mixtral).n_layers
    first = load(mixtral, layers=(0, 1), embedding=True, head=False)
    second = load(mixtral, layers=(1, n_layers), embedding=False, head=True)
    whole = load(mixtral)
    for m in (first, second, whole):
        m.setup_cache(1, 256)
    slot = torch.tensor([0])
    ids = prompt(16, seed=2)
    hidden = first(ids, slot, [0])  # (1, 16, dim)
    assert hidden.shape == (1, 16, 64)
    logits = second(hidden, slot, [0], all_logits=True)
    length = model_path_length(load_config(mixtral))
    assert_close(logits, whole(ids, slot, [0], all_logits=True), length)
    token = logits[0, -1].argmax()
    for step in range(8):
        split = second(first(token[None, None], slot, [16 + step]), slot, [16 + step])
        assert_close(split, whole(token[None, None], slot, [16 + step]), length)
        token = split[0].argmax()


# --------------------------------------------------------------------------- in the ring


@pytest.fixture(scope="module")
def ring_mixtral(tmp_path_factory: Any) -> Path:
    from conftest import write_tiny_tokenizer

    path = make_hf_mixtral(tmp_path_factory.mktemp("ring-mixtral"), seed=3, num_local_experts=4,
                           num_experts_per_tok=2, num_hidden_layers=4)
    write_tiny_tokenizer(path)
    return path


@pytest.mark.parametrize("nodes", [2, 3])
def test_ring_equals_single_process(ring_mixtral: Path, nodes: int) -> None:
    """Greedy and seeded sampling, one sample per message and micro-batched, on real worker
    processes; every block reports its expert load, and every token went through every
    block to k experts."""
    from mdiedge.model import expertstats
    from mdiedge.engine.local import LocalEngine
    from mdiedge.roles.local_ring import LocalRing
    from mdiedge.model.sampling import SamplingParams
    from mdiedge.engine.ring import RingEngine

    greedy_params = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=1.0, top_k=20, seed=5)
    reference = LocalEngine(ring_mixtral)
    want = {p: [s["token_ids"] for s in reference.generate("hello ring", 20, 4, p).samples]
            for p in (greedy_params, sampled)}
    local = LocalRing(nodes - 1, threads=1)
    with local as workers:
        engine = RingEngine(workers, ring_mixtral, timeout_s=30, secret=local.secret)
        try:
            for params, micro_batch in ((greedy_params, 1), (greedy_params, 0),
                                        (greedy_params, 3), (sampled, 2)):
                got = engine.generate("hello ring", 20, 4, params, micro_batch=micro_batch)
                assert [s["token_ids"] for s in got.samples] == want[params], micro_batch
            reports = [engine.starter.model.expert_load()] + [
                n.expert_load for n in engine.starter.node_status()]
        finally:
            engine.close()
    assert sum(1 for r in reports if r) >= nodes - 1  # the load comes from the workers too
    load = expertstats.merge(reports)
    assert list(load) == ["0", "1", "2", "3"]
    routed = {sum(counts) for counts in load.values()}
    assert len(routed) == 1 and routed.pop() % 2 == 0  # same tokens in every block, k = 2 each
    assert all(len(counts) == 4 for counts in load.values())


def test_expert_load_lines() -> None:
    from mdiedge.model import expertstats

    load = expertstats.merge([{"3": [1, 2]}, {}, {"1": [4, 0], "10": [0, 0]}])
    assert list(load) == ["1", "3", "10"]
    assert expertstats.since({"1": [5, 2]}, {"1": [4, 0]}) == {"1": [1, 2]}
    assert expertstats.lines({"1": [6, 2]}) == [
        "block 1: 6 2 tokens per expert (busiest 1.50x the mean)"]
    assert expertstats.imbalance([0, 0]) == 0.0
