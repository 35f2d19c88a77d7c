"""Q/K/V and gate/up as one product each (``Transformer.fuse_projections``): the parameters
become views of one buffer, loading fills them in place, the outputs are those of the
separate products, and a weight that no longer lives in the buffer turns the fusion off."""
from __future__ import annotations

from pathlib import Path

import torch

from mdiedge.model.checkpoint import load_model
from mdiedge.model.config import ModelConfig
from mdiedge.model.layers import MLP, fused_with
from mdiedge.model.transformer import Transformer
from tolerance import assert_close, model_path_length

CFG = ModelConfig(name="t", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  intermediate_size=48, max_seq_len=64)


def test_fused_parameters_share_one_buffer() -> None:
    model = Transformer(CFG)
    model.fuse_projections()
    attn, mlp = model.layers["0"].attn, model.layers["0"].mlp
    assert attn.qkv is not None and mlp.gate_up is not None
    assert attn.wq.weight.data_ptr() == attn.qkv.data_ptr()
    assert attn.wk.weight.data_ptr() == attn.qkv[CFG.q_dim:].data_ptr()
    assert mlp.up.weight.data_ptr() == mlp.gate_up[CFG.intermediate_size:].data_ptr()
    assert [n for n, _ in model.named_parameters()] == \
        [n for n, _ in Transformer(CFG).named_parameters()]


def test_fused_outputs_equal_the_separate_products() -> None:
    torch.manual_seed(0)
    plain = Transformer(CFG).eval()
    fused = Transformer(CFG).eval()
    fused.load_state_dict(plain.state_dict())
    fused.fuse_projections()
    fused.load_state_dict(plain.state_dict())  # in place: the views keep sharing
    assert fused_with(fused.layers["1"].attn.qkv, fused.layers["1"].attn.wq)
    for model in (plain, fused):
        model.setup_cache(3, 32)
    tokens = torch.randint(0, 64, (3, 5))
    with torch.inference_mode():
        for step, (x, pos) in enumerate([(tokens, 0), (tokens[:, :1], 5), (tokens[:, 1:2], 6)]):
            a = plain(x, torch.arange(3), [pos] * 3)
            b = fused(x, torch.arange(3), [pos] * 3)
            assert_close(a, b, model_path_length(CFG))


def test_a_replaced_weight_turns_the_fusion_off() -> None:
    mlp = MLP(8, 16)
    mlp.fuse_projections()
    assert fused_with(mlp.gate_up, mlp.gate)
    mlp.gate.weight = torch.nn.Parameter(torch.zeros(16, 8))
    assert not fused_with(mlp.gate_up, mlp.gate)
    x = torch.randn(2, 8)
    expected = mlp.down(torch.nn.functional.silu(mlp.gate(x)) * mlp.up(x))
    assert_close(mlp(x), expected, 8 + 16)  # the gate and up products, then down


def test_a_loaded_model_is_fused(tiny_llama: Path) -> None:
    model = load_model(tiny_llama)
    attn = model.layers["0"].attn
    assert fused_with(attn.qkv, attn.wq)
    from safetensors.torch import load_file

    stored = load_file(str(tiny_llama / "model.safetensors"))
    assert torch.equal(attn.wk.weight, stored["model.layers.0.self_attn.k_proj.weight"])
