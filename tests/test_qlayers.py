"""Layers that keep GGUF blocks (``mdiedge.model.qlayers``): their products against the
de-quantized weight for decode rows and prefill tiles, one shared prefill buffer, a tied
head sharing the embedding's bytes, and ``load_model(quantize=...)``."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mdiedge.model import qlayers
from mdiedge.model.layers import Linear
from mdiedge.model.qlayers import QuantEmbedding, QuantLinear, quantize_weight
from mdiedge.model.quant import dequantize
from tolerance import assert_close
from commands import MDIEDGE

NANOLLAMA = Path(__file__).resolve().parent.parent / "models" / "nanollama"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_a_product_is_the_de_quantized_weights(qtype: str, rows: int) -> None:
    weight = torch.randn(70, 96, generator=torch.Generator().manual_seed(rows))
    layer = QuantLinear(quantize_weight(weight, qtype), qtype, 96)
    x = torch.randn(rows, 96, requires_grad=True)  # a float model's activations carry grad
    want = x.detach() @ dequantize(layer.qweight, qtype, 96).t()
    assert_close(layer(x), want, 96)
    assert_close(layer(x.view(1, rows, 96))[0], want, 96)


@pytest.mark.parametrize("rows", [1, 8, 40])
def test_a_bias_is_added_by_the_layer_and_left_to_the_caller_in_a_group(rows: int) -> None:
    weights = [torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in (48, 16)]
    layers = [QuantLinear(quantize_weight(w, "Q8_0"), "Q8_0", 64, with_bias=True)
              for w in weights]
    for layer in layers:
        layer.bias.data.normal_()
    x = torch.randn(rows, 64)
    plain = [x @ dequantize(layer.qweight, "Q8_0", 64).t() for layer in layers]
    for layer, product in zip(layers, plain):
        assert_close(layer(x), product + layer.bias, 64)
    group = QuantLinear.fuse_group(layers)
    assert_close(group(x), torch.cat(plain, 1), 64)  # Attention adds the fused biases


def test_prefill_tiles_share_one_buffer() -> None:
    layers = [QuantLinear(quantize_weight(torch.randn(64, 32 * (i + 1)), "Q8_0"), "Q8_0",
                          32 * (i + 1)) for i in range(3)]
    seen = set()
    for layer in layers:
        layer(torch.randn(20, layer.in_features))
        seen.add(id(qlayers._local.tile))
    assert len(seen) == 1 and qlayers._local.tile.numel() * 4 <= 2 * qlayers.TILE_BYTES


def test_an_embedding_looks_up_de_quantized_rows() -> None:
    weight = torch.randn(50, 64)
    embed = QuantEmbedding(quantize_weight(weight, "Q4_1"), "Q4_1", 64)
    tokens = torch.tensor([[3, 0, 49], [7, 7, 1]])
    rows = dequantize(embed.rows.qweight, "Q4_1", 64)
    assert torch.equal(embed(tokens), rows[tokens])


def test_a_bad_weight_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"Q8_0 weight of \(4, 30\) torch.uint8, expected uint8 "
                       r"\(4, 34\)"):
        QuantLinear(torch.zeros(4, 30, dtype=torch.uint8), "Q8_0", 32)


def test_load_model_quantizes_the_blocks_on_request() -> None:
    from mdiedge.model.checkpoint import load_model

    floats, quantized = load_model(NANOLLAMA), load_model(NANOLLAMA, quantize="Q8_0")
    block = quantized.layers["0"]
    assert all(isinstance(layer, QuantLinear) and layer.qtype == "Q8_0" for layer in (
        block.attn.wq, block.attn.wk, block.attn.wv, block.attn.wo, block.mlp.gate,
        block.mlp.up))
    assert type(block.mlp.down) is Linear  # its width, 688, is not a whole number of blocks
    assert quantized.parameter_bytes() < 0.5 * floats.parameter_bytes()
    tokens = torch.tensor([[827, 2007, 3]])
    for net in (floats, quantized):
        net.setup_cache(1, 16)
    a = floats(tokens, torch.tensor([0]), [0])
    b = quantized(tokens, torch.tensor([0]), [0])
    assert a.argmax().item() == b.argmax().item()
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()


def test_generate_quantize_is_the_same_on_one_node_and_a_ring() -> None:
    """``--quantize``: the starter and each worker quantize their own blocks alike, so a
    ring's greedy tokens are one process's."""
    import json
    import subprocess

    def ids(nodes: int) -> list:
        out = subprocess.run([*MDIEDGE, "generate", "ROMEO:", "-n", "24",
                              "--temperature", "0", "--nodes", str(nodes), "--quantize", "q4_0",
                              "--json"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["samples"][0]["token_ids"]

    assert ids(1) == ids(3)


def test_an_assignment_carries_its_quantizer() -> None:
    from mdiedge.runtime.protocol import Assignment, ModelRef
    from mdiedge.model.checkpoint import load_config
    from mdiedge.model.families import config_to_hf

    cfg = load_config(NANOLLAMA)
    ref = ModelRef(cfg.name, "0" * 64, config_to_hf(cfg), {})
    one = Assignment(ref, (0, 4), 1, 64, quantize="Q8_0")
    back = Assignment.from_json(one.to_json())
    assert back.quantize == "Q8_0" and back.same_weights(one)
    assert not back.same_weights(Assignment(ref, (0, 4), 1, 64))
    with pytest.raises(ValueError, match="quantize 'Q5_K' is not one of Q8_0, Q4_0, Q4_1"):
        Assignment.from_json(dict(one.to_json(), quantize="Q5_K"))


def test_file_types_stay_in_their_blocks_and_the_others_are_named(
        caplog: pytest.LogCaptureFixture) -> None:
    """A file's Q5_0 and F16 matrices stay quantized (no float32 copy); a type without a
    kernel is read as float, named in one warning line."""
    import logging

    from mdiedge.model.config import ModelConfig
    from mdiedge.model.transformer import Transformer
    from quantblocks import random_blocks

    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2,
                      intermediate_size=96, max_seq_len=16)
    net = Transformer(cfg)
    stored = {"q": "Q5_0", "k": "IQ2_XXS", "v": "IQ2_XXS", "d": "F16"}
    shapes = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "d": (64, 96)}

    class Source:
        path = "m.gguf"

        @staticmethod
        def qtype(name: str) -> str:
            return stored[name]

        @staticmethod
        def raw(name: str) -> torch.Tensor:
            return random_blocks(stored[name], *shapes[name])

    plan = {"layers.0.attn.wq.weight": "q", "layers.0.attn.wk.weight": "k",
            "layers.0.attn.wv.weight": "v", "layers.0.mlp.down.weight": "d"}
    with caplog.at_level(logging.WARNING, logger="mdiedge.quant"):
        held = qlayers.keep_quantized(net, Source(), plan)
    block = net.layers["0"]
    assert held == {"layers.0.attn.wq.weight", "layers.0.mlp.down.weight"}
    assert (block.attn.wq.qtype, block.mlp.down.qtype) == ("Q5_0", "F16")
    assert isinstance(block.attn.wk, Linear)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["m.gguf: 2 tensor(s) of type IQ2_XXS have no kernel and are "
                     "de-quantized to float32 at load: k, v"]
