"""The CPU dot mode (``mdiedge.base.cpudot``): how it is chosen, that the compiled step, the
head and ``QuantLinear`` multiply in integer dot products under q8 (the twin rounding the
activations the same way, ``quant.quantized_activations``) and in float32 under f32, and that
a local ring's workers take the starter's mode and report it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from mdiedge.base import cpudot
from mdiedge.base.errors import ConfigError
from mdiedge.model import _pyquant, quant
from mdiedge.model.qlayers import QUANT, QuantLinear
from mdiedge.model.block import step_matrix
from mdiedge.model.transformer import STEP
from test_step_quant import CFG, quantized_model, random_blocks
from tolerance import assert_close, model_path_length

REPO = Path(__file__).resolve().parent.parent
QUANTIZED = [name for name in quant.KERNEL_TYPES if quant.TYPES[name].act_block]


@pytest.fixture
def mode() -> Iterator[Any]:
    """Set the mode for one test; the test run's (f32) and its environment come back."""
    saved = os.environ.get(cpudot.ENV)
    yield cpudot.set_cpu_dot
    cpudot.set_cpu_dot(None)
    if saved is None:
        os.environ.pop(cpudot.ENV, None)
    else:
        os.environ[cpudot.ENV] = saved


@pytest.mark.parametrize("env, chosen, expected", [
    (None, None, "q8"), ("f32", None, "f32"), ("q8", None, "q8"), ("f32", "q8", "q8"),
    ("q8", "f32", "f32"),
])
def test_the_mode_set_wins_then_the_environment_then_the_default(
        mode: Any, monkeypatch: pytest.MonkeyPatch, env: Any, chosen: Any, expected: str) -> None:
    if env is None:
        monkeypatch.delenv(cpudot.ENV, raising=False)
    else:
        monkeypatch.setenv(cpudot.ENV, env)
    assert mode(chosen) == expected == cpudot.cpu_dot()
    assert cpudot.dot_code() == cpudot.CODES[expected]
    if chosen is not None:  # exported for the processes this one starts
        assert os.environ[cpudot.ENV] == chosen


@pytest.mark.parametrize("bad", ["Q8", "int8", "", "fp32"])
def test_a_bad_mode_is_named(mode: Any, monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    with pytest.raises(ConfigError, match=f"--cpu-dot: expected one of q8, f32, got {bad!r}"):
        mode(bad)
    monkeypatch.setenv(cpudot.ENV, bad)
    with pytest.raises(ConfigError, match=rf"\$MDIEDGE_CPU_DOT: expected one of q8, f32"):
        cpudot.cpu_dot()


@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("impl", QUANT.implementations(), ids=lambda m: m.__name__)
def test_quant_linear_follows_the_mode(mode: Any, impl: Any, qtype: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Under q8 a layer's product is the float product of the rounded activations (where
    the type has an integer kernel here), under f32 of the activations themselves."""
    import mdiedge.model.qlayers as qlayers

    monkeypatch.setattr(qlayers, "_quant", impl)
    k = 512
    layer = QuantLinear(random_blocks(qtype, 24, k, 3), qtype, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    weight = layer.dequantized()
    for chosen in ("q8", "f32"):
        mode(chosen)
        integer = chosen == "q8" and qtype in impl.q8_types()
        rows = quant.quantized_activations(x, quant.TYPES[qtype].act_block) if integer else x
        want = rows @ weight.t()
        got = layer(x)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
        if integer:  # the rounding is visible: the q8 path really ran
            assert not torch.allclose(got, x @ weight.t(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("types", [("Q4_1", "Q8_0", "Q5_0"), ("Q4_K", "Q6_K", "Q5_K"),
                                   ("IQ4_NL", "Q5_1", "Q4_0"), ("Q2_K", "Q3_K", "IQ4_XS"),
                                   ("Q6_K", "Q4_K", "Q6_K")])
@torch.no_grad()
def test_the_compiled_step_under_q8_equals_the_twin(types: Any) -> None:
    """Each block of mixed types and the head, 1..8 rows, compiled against the twin, q8 both,
    from the same input and caches. The products agree to float rounding (test_quant), but a
    rounding of one activation to 8 bits may then land one step apart (the norms and the
    attention are computed in another order), which moves a whole output row by a quant step;
    so the q8 outputs must be far closer to each other than to the f32 output."""
    impls = STEP.implementations()
    if len(impls) < 2:
        pytest.skip("the compiled step is not built")
    compiled_q8 = QUANT.select().q8_types()
    if not set(types) <= set(compiled_q8):
        pytest.skip(f"{sorted(set(types) - set(compiled_q8))}: no integer kernel on this CPU")
    twin, compiled = impls
    qtype, v_type, up_type = types
    net = quantized_model(qtype, v_type=v_type, up_type=up_type, seed=5)
    net.setup_cache(8, CFG.max_seq_len)
    slots, positions = [3, 0, 7, 1, 2, 4, 5, 6], [17, 0, 40, 3, 9, 31, 1, 46]
    x = torch.randn(8, CFG.dim, generator=torch.Generator().manual_seed(8))
    for weights in net._step_weights():
        for rows in (1, 3, 8):
            args = (x[:rows].contiguous(), slots[:rows], positions[:rows], 1)
            _q8_beside_f32(*[_block_output(impl, weights, *args, dot) for impl, dot in
                             ((twin, 1), (compiled, 1), (compiled, 0))])
    norm, head = net.norm.weight, step_matrix(net.lm_head)
    logits = [torch.empty(8, CFG.vocab_size) for _ in range(3)]
    for (impl, dot), out in zip(((twin, 1), (compiled, 1), (compiled, 0)), logits):
        impl.logits(norm, net.norm.eps, head, x, out, 1, dot)
    _q8_beside_f32(*logits)


def _q8_beside_f32(twin_q8: torch.Tensor, compiled_q8: torch.Tensor,
                   compiled_f32: torch.Tensor) -> None:
    apart = float((compiled_q8 - compiled_f32).norm())
    assert apart > 1e-4 * float(compiled_f32.norm())  # q8 is not f32
    assert float((compiled_q8 - twin_q8).norm()) < 0.3 * apart


def _block_output(impl: Any, weights: Any, x: torch.Tensor, slots: Any, positions: Any,
                  threads: int, dot: int) -> torch.Tensor:
    """One block's output from caches filled with the same random keys and values."""
    for cache in (weights.k, weights.v):
        cache.normal_(generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    impl.block(weights, x, out, slots, positions, threads, dot)
    return out


def test_the_twins_name_every_quantized_type() -> None:
    assert set(_pyquant.q8_types()) == set(QUANTIZED)
    assert not {"F16", "BF16"} & set(QUANT.select().q8_types())


def _generate(model: Path, nodes: int, dot: str) -> Any:
    env = dict(os.environ, MDIEDGE_CPU_DOT="f32")  # the option must win over the environment
    out = subprocess.run(
        [sys.executable, "-m", "mdiedge", "generate", "The", "--model", str(model),
         "--nodes", str(nodes), "-n", "12", "--temperature", "0", "--json", "--cpu-dot", dot],
        capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_local_ring_decodes_as_one_node_in_either_mode(tmp_path: Path,
                                                          ring_model: Path) -> None:
    """A 3-node ring's workers take --cpu-dot: the same tokens as one node, in each mode."""
    from gguf_files import write_gguf

    model = write_gguf(tmp_path / "ring.gguf", ring_model, "Q4_0")
    for dot in ("q8", "f32"):
        one, ring = _generate(model, 1, dot), _generate(model, 3, dot)
        assert one["samples"][0]["token_ids"] == ring["samples"][0]["token_ids"]
