"""Where decode runs, said and never silent: ``Transformer.decode_route`` names the compiled
step or torch for a chunk's blocks and head, with the reason (family, block, why) where torch
runs on the CPU; a stage logs that reason once at set-up; ``generate --json`` lists each
node's route and ``status`` shows it."""
from __future__ import annotations

import json
import logging
import subprocess

import pytest
import torch

from commands import MDIEDGE
from mdiedge.cli.console import decode_summary
from mdiedge.model import _pystep, transformer
from mdiedge.model.config import ModelConfig
from mdiedge.model.transformer import Transformer, route_of
from mdiedge.runtime.stages import LocalStage, joined_routes

LLAMA = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    intermediate_size=48, max_seq_len=64)
MIXTRAL = LLAMA.replace(model_type="mixtral", n_experts=4, experts_per_token=2)


def model(cfg: ModelConfig, **kwargs: object) -> Transformer:
    torch.manual_seed(0)
    made = Transformer(cfg, **kwargs).eval()  # type: ignore[arg-type]
    made.fuse_projections()
    return made


def test_a_llama_chunk_decodes_in_the_step() -> None:
    m = model(LLAMA)
    m.setup_cache(2, 16)
    if not transformer._step.PREFERRED:
        pytest.skip("the compiled step is not built here")
    assert route_of(m) == {"blocks": "step", "head": "step"}
    assert route_of(model(LLAMA, layers=(1, 2), embedding=False, head=False)) == {
        "blocks": "torch", "reason": "llama blocks: no KV cache set up"}


def test_a_mixture_of_experts_decodes_in_the_step(caplog: pytest.LogCaptureFixture) -> None:
    """Mixtral's blocks run in the step; an expert's matrix it cannot read is named, with
    the family, the block and the expert, once at set-up."""
    if not transformer._step.PREFERRED:
        pytest.skip("the compiled step is not built here")
    m = model(MIXTRAL)
    m.setup_cache(1, 16)
    assert route_of(m) == {"blocks": "step", "head": "step"}
    expert = m.layers["1"].mlp.experts[3]
    expert.down.weight.data = expert.down.weight.data.double()
    with caplog.at_level(logging.WARNING, "mdiedge.stage"):
        stage = LocalStage(m, 1, 16)
    route = stage.decode_route
    assert route["blocks"] == "torch"
    assert route["reason"] == "mixtral block 1: matrix expert 3 down (float64) has no kernel " \
                              "in the step"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "blocks [0, 2) runs in torch" in warnings[0]
    assert "mixtral block 1" in warnings[0]


def test_the_twin_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transformer, "_step", _pystep)
    m = model(LLAMA)
    m.setup_cache(1, 16)
    route = route_of(m)
    assert route["blocks"] == route["head"] == "torch"
    assert "not built" in route["reason"]


def test_a_block_that_does_not_fit_is_named() -> None:
    if not transformer._step.PREFERRED:
        pytest.skip("the compiled step is not built here")
    m = model(LLAMA)
    m.setup_cache(1, 16)
    block = m.layers["1"]
    block.attn.cache.k = block.attn.cache.k.transpose(2, 3)  # not contiguous: refused
    m._steps = None
    route = route_of(m)
    assert route["blocks"] == "torch"
    assert route["reason"].startswith("llama block 1: ")


def test_a_norm_of_another_eps_is_named() -> None:
    if not transformer._step.PREFERRED:
        pytest.skip("the compiled step is not built here")
    m = model(LLAMA.replace(model_type="qwen3", head_dim=8))
    m.setup_cache(1, 16)
    assert route_of(m)["blocks"] == "step"
    m.layers["0"].attn.q_norm.eps = 1e-3
    m._steps = None
    assert route_of(m)["reason"] == "qwen3 block 0: norms of eps [1e-05, 0.001] beside " \
        "the block's 1e-05"


@pytest.mark.parametrize("routes, joined", [
    ([], {}),
    ([{"blocks": "step", "head": "step"}], {"blocks": "step", "head": "step"}),
    ([{"blocks": "step"}, {"blocks": "torch", "reason": "r"}, {"blocks": "step"}],
     {"blocks": "torch", "reason": "r"}),
    ([{"blocks": "torch", "reason": "a"}, {"head": "torch", "reason": "b"}],
     {"blocks": "torch", "head": "torch", "reason": "a; b"}),
])
def test_joined_routes(routes: list, joined: dict) -> None:
    assert joined_routes(routes) == joined


@pytest.mark.parametrize("route, shown", [
    (None, "-"), ("x", "-"), ({}, "-"), ({"blocks": "step", "head": "step"}, "step"),
    ({"blocks": "step"}, "step"), ({"blocks": "torch", "head": "step"}, "blocks torch, head step"),
])
def test_decode_summary(route: object, shown: str) -> None:
    assert decode_summary(route) == shown


def test_generate_json_lists_each_nodes_route() -> None:
    if not transformer._step.PREFERRED:
        pytest.skip("the compiled step is not built here")
    out = subprocess.run([*MDIEDGE, "generate", "hi", "-n", "3",
                          "--temperature", "0", "--nodes", "2", "--json"],
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    decode = json.loads(out.stdout)["decode"]
    assert [d["node"] for d in decode] == ["starter", "w1"]
    assert decode[0]["blocks"] == decode[0]["head"] == decode[1]["blocks"] == "step"
    assert "head" not in decode[1]
