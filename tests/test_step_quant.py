"""The compiled decode step on quantized blocks (``ext/_cstep.pyx`` with ``ext/quant.h``'s
kernels, and its twin ``mdiedge/model/_pystep.py``): for every kernel type, a model's blocks
and quantized head through the step equal the torch path with ``QuantLinear`` for 1..8 rows;
Q/K/V and gate/up as groups reading their layers' bytes where they lie; a tiny GGUF model and
``--quantize`` decode through the step with the torch path's tokens; mixed types (Q6_K V beside
Q4_K Q and K) decode through the step as stacked parts; and the SmolLM2 Q4_1 file, decoded through the step, gives transformers' greedy
tokens of its de-quantized fp32 directory."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, List

import pytest
import quantblocks
import torch
from test_step import TorchPath, decode, preferred

from mdiedge.model.transformer import STEP
from mdiedge.model import quant
from mdiedge.model import transformer as transformer_module
from mdiedge.model._stepconstants import MAX_ROWS, BlockWeights, QuantMatrix, StackedMatrix
from mdiedge.model.checkpoint import load_model
from mdiedge.model.config import ModelConfig
from mdiedge.model.qlayers import QuantGroup, QuantLinear
from mdiedge.model.transformer import Transformer
from tolerance import assert_close, model_path_length

pytestmark = pytest.mark.twins
IMPLS = STEP.implementations()
# Q4_K and Q6_K blocks hold 256 weights: every product's input width is a multiple of 256
CFG = ModelConfig(vocab_size=64, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                  intermediate_size=512, max_seq_len=48)
# scales giving weights of about 0.01..0.1 (activations as a trained model's) per type
SCALE = {"Q8_0": 2e-3, "Q4_0": 1.5e-2, "Q4_1": 8e-3, "Q4_K": 4e-4, "Q6_K": 1e-4, "F16": 0.1,
         "BF16": 0.1, "Q5_0": 8e-3, "Q5_1": 4e-3, "Q2_K": 2e-3, "Q3_K": 5e-4, "Q5_K": 2e-4,
         "IQ4_NL": 2e-3, "IQ4_XS": 1e-4}


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> Any:
    return preferred(request.param)


def random_blocks(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Valid random blocks (n, row_bytes): random quants, each block's f16 scales (F16's and
    BF16's every weight) of either sign and of size up to SCALE[qtype]."""
    return quantblocks.random_blocks(qtype, n, k, seed, 0.1 * SCALE[qtype], SCALE[qtype])


def quantized_model(qtype: str, cfg: ModelConfig = CFG, v_type: str = "",
                    seed: int = 0, up_type: str = "") -> Transformer:
    """A model whose every block matrix and head are random ``qtype`` blocks (V as
    ``v_type``, up as ``up_type`` where given), grouped as a GGUF model is after loading."""
    torch.manual_seed(seed)
    net = Transformer(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 1.0) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    layers = [(net, "lm_head")] + [(getattr(b, part), name) for b in net.layers.values()
                                   for part, names in (("attn", "wq wk wv wo"),
                                                       ("mlp", "gate up down"))
                                   for name in names.split()]
    for i, (owner, name) in enumerate(layers):
        old = getattr(owner, name)
        kind = {"wv": v_type, "up": up_type}.get(name) or qtype
        blocks = random_blocks(kind, old.out_features, old.in_features, seed * 100 + i)
        setattr(owner, name, QuantLinear(blocks, kind, old.in_features))
    net.fuse_projections()
    return net


@pytest.mark.parametrize("qtype", quant.KERNEL_TYPES)
def test_quantized_groups_share_their_layers_bytes(qtype: str) -> None:
    """Q/K/V and gate/up each one group of the layers themselves (nothing copied), read by
    the step as a stacked matrix of the layers' own blocks; the model's bytes counted once."""
    torch.manual_seed(0)
    alone = quantized_model(qtype)
    before = {n: b.clone() for n, b in alone.named_buffers() if b.dtype == torch.uint8}
    block = alone.layers["0"]
    assert isinstance(block.attn.qkv, QuantGroup) and isinstance(block.mlp.gate_up, QuantGroup)
    assert block.attn.qkv.layers == (block.attn.wq, block.attn.wk, block.attn.wv)
    alone.setup_cache(1, CFG.max_seq_len)
    qkv = block.step_weights(alone.rope_cos, alone.rope_sin).qkv
    assert isinstance(qkv, StackedMatrix)
    assert [part.data.data_ptr() for part in qkv.parts] == [
        layer.qweight.data_ptr() for layer in (block.attn.wq, block.attn.wk, block.attn.wv)]
    after = {n: b for n, b in alone.named_buffers() if b.dtype == torch.uint8}
    assert all(torch.equal(before[n], after[n]) for n in before)
    quantized_bytes = sum(b.numel() for b in before.values())
    floats = sum(p.numel() * 4 for p in alone.parameters())
    assert alone.parameter_bytes() == quantized_bytes + floats


@torch.no_grad()
def run_blocks(net: Transformer, step: Any, x: torch.Tensor, slots: List[int],
               positions: List[int]) -> Any:
    """The blocks of ``net`` on rows x (B, dim) through ``step``, from caches filled with the
    same random keys and values each time; the output and the K caches."""
    transformer_module._step = step
    net.setup_cache(8, CFG.max_seq_len)
    for n, block in enumerate(net.layers.values()):
        block.attn.cache.k.normal_(generator=torch.Generator().manual_seed(n))
        block.attn.cache.v.normal_(generator=torch.Generator().manual_seed(n + 10))
    y = net.run_blocks(x[:, None], torch.tensor(slots), positions)[:, 0]
    logits = net.head_logits(y)
    return y, logits, [b.attn.cache.k.clone() for b in net.layers.values()]


@pytest.mark.parametrize("qtype", quant.KERNEL_TYPES)
def test_quantized_blocks_through_the_step_equal_the_torch_path(
        impl: ModuleType, monkeypatch: pytest.MonkeyPatch, qtype: str) -> None:
    """Every row count 1..8, rows in their own slots at their own positions; the blocks'
    output, the keys written and the quantized head's logits."""
    monkeypatch.setattr(transformer_module, "_step", TorchPath)
    net = quantized_model(qtype)
    net.setup_cache(8, CFG.max_seq_len)
    weights = net._step_weights()
    assert [w.quantized() for w in weights] == [("qkv", "wo", "gate_up", "down")] * 2
    slots, positions = [3, 0, 7, 1, 2, 4, 5, 6], [17, 0, 40, 3, 9, 31, 1, 46]
    x = torch.randn(8, CFG.dim, generator=torch.Generator().manual_seed(1))
    for rows in range(1, 9):
        args = (x[:rows].contiguous(), slots[:rows], positions[:rows])
        ref = run_blocks(net, TorchPath, *args)
        got = run_blocks(net, impl, *args)
        assert float(ref[0].abs().max()) > 0.5  # the blocks did something to compare
        for a, b in zip(got[:2], ref[:2]):
            assert_close(a, b, model_path_length(CFG))
        for a, b in zip(got[2], ref[2]):
            assert_close(a, b, model_path_length(CFG))


@pytest.mark.parametrize("qtype", quant.KERNEL_TYPES)
def test_quantized_decode_matches_the_torch_path(impl: ModuleType,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 qtype: str) -> None:
    """Greedy decode of three rows at different starts: the same tokens, the logits and
    keys within rounding."""
    net = quantized_model(qtype, seed=1)
    prompts = torch.randint(0, CFG.vocab_size, (3, 5), generator=torch.Generator().manual_seed(2))
    ref, ref_k = decode(net, TorchPath, monkeypatch, prompts, [0, 9, 17], 8)
    got, got_k = decode(net, impl, monkeypatch, prompts, [0, 9, 17], 8)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert_close(got, ref, model_path_length(CFG))
    for a, b in zip(got_k, ref_k):
        assert_close(a, b, model_path_length(CFG))


def counting(calls: List[int], heads: List[Any], chosen: Any = None) -> Any:
    """The step ``chosen`` (default the compiled one, or the twin where it is not built),
    counting its calls: blocks per ``blocks`` call, the head's type per ``logits`` call."""
    chosen = chosen or IMPLS[-1]

    class Counting:
        PREFERRED, MAX_ROWS = True, chosen.MAX_ROWS
        usable = staticmethod(chosen.usable)
        plan = staticmethod(chosen.plan)
        logits_usable = staticmethod(chosen.logits_usable)

        @staticmethod
        def blocks(plan: Any, *args: Any) -> None:
            calls.append(len(plan.weights))
            chosen.blocks(plan, *args)

        @staticmethod
        def logits(norm: Any, eps: float, head: Any, *args: Any) -> None:
            heads.append(getattr(head, "qtype", "F32"))
            chosen.logits(norm, eps, head, *args)

    return Counting


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_gguf_model_decodes_through_the_step(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               qtype: str) -> None:
    """A GGUF file's model: one call of the step per decode step for all its blocks, the
    head quantized through ``logits``, and the torch path's greedy tokens."""
    from conftest import make_hf_llama
    from gguf_files import write_gguf

    hf = make_hf_llama(tmp_path / "hf", hidden_size=64, intermediate_size=96)
    net = load_model(write_gguf(tmp_path / "m.gguf", hf, qtype))
    calls: List[int] = []
    heads: List[Any] = []
    prompts = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    ref, _ = decode(net, TorchPath, monkeypatch, prompts, [0, 4], 10)
    got, _ = decode(net, counting(calls, heads), monkeypatch, prompts, [0, 4], 10)
    assert calls == [net.cfg.n_layers] * (2 + 10)  # each row's 5-token prefill: one step too
    assert set(heads) == {qtype}
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert_close(got, ref, model_path_length(net.cfg))


def test_quantize_on_load_fuses_and_decodes_through_the_step(
        monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    """``--quantize``: the quantized layers grouped again (the float buffers they replace
    released), and decode through the step with the torch path's tokens."""
    net = load_model(tiny_llama, quantize="Q8_0")
    block = net.layers["0"]
    assert isinstance(block.attn.qkv, QuantGroup) and isinstance(block.mlp.gate_up, QuantGroup)
    calls: List[int] = []
    prompts = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(4))
    ref, _ = decode(net, TorchPath, monkeypatch, prompts, [0], 6)
    got, _ = decode(net, counting(calls, []), monkeypatch, prompts, [0], 6)
    assert calls == [net.cfg.n_layers] * (1 + 6)  # the 5-token prefill is one step too
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_mixed_types_decode_through_the_step(impl: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                             rows: int) -> None:
    """V in Q6_K beside Q/K in Q4_K (as Q4_K_M files hold some), and gate/up of two types:
    each group is one stacked matrix of its parts, every block decodes through the step,
    equal to the torch path."""
    net = quantized_model("Q4_K", v_type="Q6_K", up_type="Q8_0")
    net.setup_cache(8, CFG.max_seq_len)
    weights = net.layers["0"].step_weights(net.rope_cos, net.rope_sin)
    assert [p.qtype for p in weights.qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    assert [p.qtype for p in weights.gate_up.parts] == ["Q4_K", "Q8_0"]
    calls: List[int] = []
    heads: List[Any] = []
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, CFG.vocab_size, (rows, 4), generator=gen)
    slots = list(range(rows))
    ref, _ = decode(net, TorchPath, monkeypatch, prompts, slots, 3)
    got, _ = decode(net, counting(calls, heads, impl), monkeypatch, prompts, slots, 3)
    assert calls == [CFG.n_layers] * (rows + 3)  # each row's 4-token prefill: one step too
    assert_close(got, ref, model_path_length(CFG))


@pytest.mark.parametrize("types", [("Q5_0", "Q8_0", "F16"), ("Q2_K", "Q5_K", "Q5_1"),
                                   ("Q3_K", "IQ4_XS", "BF16"), ("IQ4_NL", "Q6_K", "Q4_K")])
def test_new_types_mixed_in_stacked_matrices_equal_the_twin(types: Any) -> None:
    """The compiled step on blocks whose Q/K/V and gate/up are stacked parts of different
    types (as real Q4_K_M files mix Q5_0, Q8_0, Q4_K and Q6_K) equals the twin, 1..8 rows."""
    if len(IMPLS) < 2:
        pytest.skip("the compiled step is not built")
    qtype, v_type, up_type = types
    net = quantized_model(qtype, v_type=v_type, up_type=up_type, seed=2)
    net.setup_cache(8, CFG.max_seq_len)
    weights = net.layers["0"].step_weights(net.rope_cos, net.rope_sin)
    assert [p.qtype for p in weights.qkv.parts] == [qtype, qtype, v_type]
    assert [p.qtype for p in weights.gate_up.parts] == [qtype, up_type]
    slots, positions = [3, 0, 7, 1, 2, 4, 5, 6], [17, 0, 40, 3, 9, 31, 1, 46]
    x = torch.randn(8, CFG.dim, generator=torch.Generator().manual_seed(7))
    for rows in (1, 2, 5, 8):
        args = (x[:rows].contiguous(), slots[:rows], positions[:rows])
        twin = run_blocks(net, preferred(IMPLS[0]), *args)
        compiled = run_blocks(net, preferred(IMPLS[1]), *args)
        assert float(twin[0].abs().max()) > 0.5
        for a, b in zip(compiled[:2], twin[:2]):
            assert_close(a, b, model_path_length(CFG))
        for a, b in zip(compiled[2], twin[2]):
            assert_close(a, b, model_path_length(CFG))


def test_stacked_matrices_refuse_what_does_not_fit() -> None:
    q8 = QuantMatrix(torch.zeros(4, 34, dtype=torch.uint8), "Q8_0")
    wide = QuantMatrix(torch.zeros(4, 68, dtype=torch.uint8), "Q8_0")
    q4 = QuantMatrix(torch.zeros(2, 18, dtype=torch.uint8), "Q4_0")
    assert StackedMatrix([q8, q4]).shape == (6, 32)
    with pytest.raises(ValueError, match=r"input widths \[32, 64\]"):
        StackedMatrix([q8, wide])
    with pytest.raises(ValueError, match="4 parts"):
        StackedMatrix([q8] * 4)
    with pytest.raises(ValueError, match="Tensor"):
        StackedMatrix([q8, torch.zeros(4, 32)])


@pytest.mark.parametrize("matrix, message", [
    (torch.zeros(4, 34, dtype=torch.int8), r"Q8_0 matrix \(4, 34\) torch.int8 is not"),
    (torch.zeros(4, 35, dtype=torch.uint8), r"Q8_0 matrix \(4, 35\) torch.uint8 is not"),
    (torch.zeros(4, 68, dtype=torch.uint8)[:, :34], r"Q8_0 matrix \(4, 34\)"),
])
def test_bad_quantized_matrices_quote_the_value(matrix: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QuantMatrix(matrix, "Q8_0")
    with pytest.raises(ValueError, match="no quantized kernel for F32"):
        QuantMatrix(torch.zeros(4, 64, dtype=torch.uint8), "F32")


def test_block_weights_check_quantized_shapes() -> None:
    """A quantized matrix of the wrong shape is refused, naming it."""
    net = quantized_model("Q8_0")
    net.setup_cache(2, CFG.max_seq_len)
    w = net._step_weights()[0]
    wrong = QuantMatrix(random_blocks("Q8_0", CFG.dim, 512, 0), "Q8_0")
    with pytest.raises(ValueError, match=r"wo \(256, 512\) is not \(256, 256\)"):
        w.replace(wo=wrong)
    with pytest.raises(ValueError, match="k is not a contiguous float32 CPU tensor$"):
        w.replace(k=wrong)
    assert isinstance(w.replace(), BlockWeights)


@pytest.mark.slow
def test_smollm2_q4_1_through_the_step_is_the_fp32_reference(
        monkeypatch: pytest.MonkeyPatch, smollm2_reference: Any) -> None:
    """SmolLM2-135M-Instruct's Q4_1 file decoded through the step (one call for its 30
    blocks per token, the Q8_0 head through ``logits``): transformers' greedy tokens on the
    de-quantized fp32 directory, 40 new tokens (or up to its EOS)."""
    from smollm2 import NEW_TOKENS

    reference = smollm2_reference
    prompt = reference.plain("The capital of France is")
    want = reference.generated(prompt)
    net = load_model("smollm2")
    calls: List[int] = []
    heads: List[Any] = []
    monkeypatch.setattr(transformer_module, "_step", counting(calls, heads))
    net.setup_cache(1, 128)
    slots = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        ids = [int(net(torch.tensor([prompt]), slots, [0]).argmax(-1))]
        for i in range(NEW_TOKENS - 1):
            logits = net(torch.tensor([[ids[-1]]]), slots, [len(prompt) + i])
            ids.append(int(logits.argmax(-1)))
    prefill = 1 if len(prompt) <= MAX_ROWS else 0  # a short prompt is rows of one step
    assert calls == [30] * (prefill + NEW_TOKENS - 1) and set(heads) == {"Q8_0"}
    assert ids[:len(want)] == want
