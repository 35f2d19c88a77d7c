"""A mixture of experts in the decode step (``BlockWeights``' ``experts``; ``ext/step_moe.h``):
Mixtral and Qwen3-MoE blocks through the compiled step and through its twin equal the torch
path (``mdiedge.model.moe``) for 1..8 rows in their own slots and positions, float and
quantized experts (a quantized router too), k = 1 and 2, renormalized or not, and count the
same tokens per expert; a row's result does not depend on the rows beside it or the thread
count; a quantized GGUF Mixtral's experts are read where the file holds them; ``Experts``
refuses what does not fit."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List

import pytest
import torch
from test_step import IMPLS, TorchPath, impl, preferred  # noqa: F401
from test_step_quant import random_blocks

import mdiedge.model.transformer as transformer_module
from mdiedge.model._stepconstants import Experts
from mdiedge.model.config import ModelConfig
from mdiedge.model.qlayers import QuantLinear
from mdiedge.model.transformer import Transformer, route_of
from tolerance import assert_close, model_path_length

pytestmark = pytest.mark.twins
MIXTRAL = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=96, max_seq_len=48, model_type="mixtral", n_experts=6,
                      experts_per_token=2)
SLOTS, POSITIONS = [3, 0, 7, 1, 2, 4, 5, 6], [17, 0, 40, 3, 9, 31, 1, 46]
QUANT_TYPES = {"router": "Q8_0", "gate": "Q4_1", "up": "Q4_0", "down": "Q8_0"}


def moe_model(cfg: ModelConfig, quantized: bool, seed: int = 0) -> Transformer:
    """Random weights; ``quantized``: the router and every expert's gate, up and down random
    blocks of ``QUANT_TYPES`` (gate and up then a stacked matrix of two types)."""
    torch.manual_seed(seed)
    net = Transformer(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    if quantized:
        for n, block in enumerate(net.layers.values()):
            owners = [(block.mlp, "router")] + [(e, name) for e in block.mlp.experts
                                                 for name in ("gate", "up", "down")]
            for i, (owner, name) in enumerate(owners):
                old, kind = getattr(owner, name), QUANT_TYPES[name]
                blocks = random_blocks(kind, old.out_features, old.in_features, 100 * n + i)
                setattr(owner, name, QuantLinear(blocks, kind, old.in_features))
    net.fuse_projections()
    return net


@torch.no_grad()
def run_blocks(net: Transformer, step: Any, x: torch.Tensor, rows: int) -> Any:
    """The blocks on rows x (rows, dim) through ``step`` from the same random caches; the
    output, the logits and the tokens counted per expert in each block."""
    transformer_module._step = step
    net.setup_cache(8, net.cfg.max_seq_len)
    for n, block in enumerate(net.layers.values()):
        block.attn.cache.k.normal_(generator=torch.Generator().manual_seed(n))
        block.attn.cache.v.normal_(generator=torch.Generator().manual_seed(n + 10))
        block.mlp.reset_stats()
    y = net.run_blocks(x[:rows, None].contiguous(), torch.tensor(SLOTS[:rows]),
                       POSITIONS[:rows])[:, 0]
    return y, net.head_logits(y), [b.mlp.expert_counts.clone() for b in net.layers.values()]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("k, renormalize", [(1, True), (2, True), (2, False), (3, False)])
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quant"])
def test_moe_blocks_through_the_step_equal_the_torch_path(
        impl: Any, monkeypatch: pytest.MonkeyPatch, family: str, k: int, renormalize: bool,
        quantized: bool) -> None:
    monkeypatch.setattr(transformer_module, "_step", impl)
    extra = dict(head_dim=16) if family == "qwen3_moe" else {}
    cfg = MIXTRAL.replace(model_type=family, experts_per_token=k, norm_topk_prob=renormalize,
                          **extra)
    net = moe_model(cfg, quantized)
    net.setup_cache(8, cfg.max_seq_len)
    assert route_of(net)["blocks"] == "step"
    experts = net._step_weights()[0].experts
    assert (experts.top_k, experts.renormalize) == (k, renormalize)
    assert net._step_weights()[0].quantized() == (("experts",) if quantized else ())
    x = torch.randn(8, cfg.dim, generator=torch.Generator().manual_seed(1))
    for rows in range(1, 9):
        ref = run_blocks(net, TorchPath, x, rows)
        got = run_blocks(net, impl, x, rows)
        assert float(ref[0].abs().max()) > 0.5  # the blocks did something to compare
        for a, b in zip(got[:2], ref[:2]):
            assert_close(a, b, model_path_length(cfg))
        assert [c.tolist() for c in got[2]] == [c.tolist() for c in ref[2]]
        assert all(int(c.sum()) == rows * k for c in got[2])


def moe_step_inputs(rows: int) -> Any:
    net = moe_model(MIXTRAL, quantized=True)
    net.setup_cache(8, MIXTRAL.max_seq_len)
    with torch.no_grad():
        for block in net.layers.values():
            block.attn.cache.k.normal_(generator=torch.Generator().manual_seed(1))
            block.attn.cache.v.normal_(generator=torch.Generator().manual_seed(2))
    block = net.layers["1"]
    return block, block.step_weights(net.rope_cos, net.rope_sin), torch.randn(
        rows, MIXTRAL.dim, generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def test_a_rows_experts_do_not_depend_on_batch_or_threads() -> None:
    """Compiled: a row's output is bit-identical alone and in a batch of 8 rows (which share
    experts), on 1 or 3 threads; the batch counts 8 k tokens."""
    if len(IMPLS) < 2:
        pytest.skip("the compiled module is not built")
    compiled = IMPLS[1]
    block, w, x = moe_step_inputs(8)
    batch = torch.empty(8, MIXTRAL.dim)
    compiled.block(w, x, batch, SLOTS, POSITIONS, 2)
    assert int(block.mlp.expert_counts.sum()) == 8 * MIXTRAL.experts_per_token
    assert int((block.mlp.expert_counts > 1).sum()) > 0  # rows shared an expert
    for threads in (1, 3):
        for r in range(8):
            block, w, x = moe_step_inputs(8)
            alone = torch.empty(1, MIXTRAL.dim)
            compiled.block(w, x[r:r + 1].contiguous(), alone, SLOTS[r:r + 1],
                           POSITIONS[r:r + 1], threads)
            assert torch.equal(alone[0], batch[r])


@torch.no_grad()
def test_a_quantized_gguf_mixtral_decodes_its_experts_where_the_file_holds_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Q8_0: every expert's gate, up and down one slice of the file's stacked tensors (no
    copy); greedy decode through the step gives the torch path's tokens."""
    from gguf_files import write_gguf
    from test_moe import make_hf_mixtral

    from mdiedge.model.checkpoint import load_model

    if not transformer_module._step.PREFERRED:
        pytest.skip("the compiled step is not built here")
    hf = make_hf_mixtral(tmp_path / "hf", seed=2, num_local_experts=4, num_experts_per_tok=2)
    model = load_model(write_gguf(tmp_path / "moe.gguf", hf, "Q8_0"))
    model.setup_cache(1, 64)
    assert route_of(model)["blocks"] == "step"
    experts = model._step_weights()[0].experts
    gates = [m.parts[0].data for m in experts.gate_up]
    stride = gates[0].numel()
    assert [g.data_ptr() - gates[0].data_ptr() for g in gates] == [e * stride for e in range(4)]
    held = model.layers["0"].mlp.experts[1].down.qweight
    assert experts.down[1].data.data_ptr() == held.data_ptr()
    prompt = torch.tensor([[1, 5, 9, 30, 77, 4]])
    tokens = {}
    for name, step in (("step", transformer_module._step), ("torch", TorchPath)):
        monkeypatch.setattr(transformer_module, "_step", step)
        tokens[name] = greedy(model, prompt, 16)
    assert tokens["step"] == tokens["torch"]


def greedy(model: Transformer, ids: torch.Tensor, n: int) -> List[int]:
    model.setup_cache(1, 64)
    slot = torch.tensor([0])
    logits, pos, out = model(ids, slot, [0]), ids.shape[1], []
    for _ in range(n):
        token = logits.argmax(-1)  # (1,)
        out.append(int(token))
        logits = model(token[None], slot, [pos])
        pos += 1
    return out


@pytest.mark.parametrize("change, message", [
    (dict(top_k=0), "top_k 0 is not in 1..3"),
    (dict(top_k=4), "top_k 4 is not in 1..3"),
    (dict(counts=torch.zeros(3)), "expert counts (3,) are not contiguous int64 CPU (3,)"),
    (dict(counts=torch.zeros(4, dtype=torch.int64)), "expert counts (4,) are not"),
    (dict(down=[torch.zeros(8, 12)] * 3), "expert 0 down (8, 12) is not (8, 6)"),
    (dict(gate_up=[torch.zeros(12, 8)] * 2), "a router of 3 experts with 2 gate_up and 3 down"),
    (dict(router=torch.zeros(3, 8, dtype=torch.float64)), "router is not a contiguous float32"),
])
def test_experts_refuse_what_does_not_fit(change: Any, message: str) -> None:
    given = dict(router=torch.zeros(3, 8), gate_up=[torch.zeros(12, 8)] * 3,
                 down=[torch.zeros(8, 6)] * 3, top_k=2, renormalize=True, counts=None)
    with pytest.raises(ValueError) as e:
        Experts(**dict(given, **change))
    assert message in str(e.value)


def test_a_block_with_experts_has_no_dense_feed_forward() -> None:
    net = moe_model(MIXTRAL, quantized=False)
    net.setup_cache(1, MIXTRAL.max_seq_len)
    w = net._step_weights()[0]
    with pytest.raises(ValueError, match="a block with experts has no gate_up or down"):
        w.replace(gate_up=torch.zeros(2 * 96, 64))
    assert w.replace(window=4).experts is w.experts
