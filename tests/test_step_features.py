"""The decode step's optional parts (``BlockWeights``' keywords: the Q/K/V bias, per-head Q and
K norms, sandwich norms, GeGLU, another attention scale, a sliding window), each alone and all
together: the compiled step (``ext/_cstep.pyx``) equals its twin (``mdiedge/model/_pystep.py``)
within float32 rounding for 1..8 rows in several slots and positions, over float and
quantized matrices; the twin equals a reference written here in plain torch after
transformers' Qwen2, Qwen3 and Gemma 3 layers (so the twin is not only checked against
itself); the parts are checked when made; ``Block.step_weights`` passes those a block has;
and a Qwen2 model (Q/K/V biases) decodes through the step with the torch path's tokens."""
from __future__ import annotations

import math
from types import ModuleType, SimpleNamespace
from typing import Any, Dict, List, Sequence, Tuple

import pytest
import torch
from test_step import TorchPath, decode, model, preferred
from test_step_quant import random_blocks

from mdiedge.model._stepconstants import BlockWeights, QuantMatrix, StackedMatrix
from mdiedge.model.config import ModelConfig
from mdiedge.model.layers import RMSNorm
from mdiedge.model.transformer import STEP
from tolerance import assert_close, model_path_length

pytestmark = pytest.mark.twins
IMPLS = STEP.implementations()
# float: head_dim 10 and widths that are not multiples of 8 reach every tail of the kernels;
# quantized: widths of whole Q8_0 / Q4_0 / Q4_1 blocks
FLOAT = SimpleNamespace(dim=40, heads=4, kv=2, hd=10, hidden=52, slots=8, seq=48)
QUANT = SimpleNamespace(dim=64, heads=4, kv=2, hd=16, hidden=96, slots=8, seq=48)
# rows 1..8: slot 1 at positions 3 and 4 (two positions of one row); positions 0 and 1
# below every window tried but 1, the others beyond the small ones
SLOTS = [3, 0, 7, 1, 1, 4, 5, 6]
POSITIONS = [17, 0, 40, 3, 4, 31, 1, 47]
FEATURES = ["qkv_bias", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "gelu_tanh",
            "attn_scale", "window1", "window3", "window100"]
CASES = [()] + [(f,) for f in FEATURES] + [tuple(f for f in FEATURES if f not in
                                                 ("window1", "window100"))]
CASE_IDS = ["llama"] + FEATURES + ["all"]


def options(features: Sequence[str], s: Any) -> Dict[str, Any]:
    """The keywords of ``BlockWeights`` for ``features``, random where a tensor."""
    g = torch.Generator().manual_seed(11)
    q_dim, kv_dim = s.heads * s.hd, s.kv * s.hd
    made: Dict[str, Any] = {}
    for name in features:
        if name == "qkv_bias":
            made[name] = torch.randn(q_dim + 2 * kv_dim, generator=g) * 0.5
        elif name in ("q_norm", "k_norm"):
            made[name] = torch.rand(s.hd, generator=g) + 0.5
        elif name in ("post_attn_norm", "post_mlp_norm"):
            made[name] = torch.rand(s.dim, generator=g) + 0.5
        elif name == "gelu_tanh":
            made["activation"] = name
        elif name == "attn_scale":
            made[name] = 0.125  # Gemma 3's query_pre_attn_scalar ** -0.5, of 64
        else:
            made["window"] = int(name[len("window"):])
    return made


def rope(seq: int, hd: int) -> Tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(seq, dtype=torch.float64),
                         10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    both = torch.cat([angles, angles], 1)
    return both.cos().float(), both.sin().float()


def matrix(rows: int, cols: int, qtype: str, seed: int) -> Any:
    if not qtype:
        return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) / cols ** 0.5
    return QuantMatrix(random_blocks(qtype, rows, cols, seed), qtype)


def block_weights(features: Sequence[str], quantized: bool, seed: int = 0) -> BlockWeights:
    """A block of random weights (float32, or Q/K/V as three stacked Q8_0 parts and the
    others Q4_0, Q4_1, Q8_0), its caches filled with random keys and values."""
    s = QUANT if quantized else FLOAT
    g = torch.Generator().manual_seed(seed)
    q_dim, kv_dim = s.heads * s.hd, s.kv * s.hd
    types = ("Q8_0", "Q4_0", "Q4_1", "Q8_0") if quantized else ("",) * 4
    if quantized:
        qkv: Any = StackedMatrix([matrix(n, s.dim, "Q8_0", seed + i)
                                  for i, n in enumerate((q_dim, kv_dim, kv_dim))])
    else:
        qkv = matrix(q_dim + 2 * kv_dim, s.dim, "", seed)
    wo = matrix(s.dim, q_dim, types[1], seed + 3)
    gate_up = matrix(2 * s.hidden, s.dim, types[2], seed + 4)
    down = matrix(s.dim, s.hidden, types[3], seed + 5)
    k, v = (torch.randn(s.slots, s.kv, s.seq, s.hd, generator=g) for _ in range(2))
    norms = [torch.rand(s.dim, generator=g) + 0.5 for _ in range(2)]
    cos, sin = rope(s.seq, s.hd)
    return BlockWeights(norms[0], qkv, wo, norms[1], gate_up, down, k, v, cos, sin, s.heads,
                        1e-5, **options(features, s))


def path_length(s: Any) -> int:
    """A block's reduction lengths (its norms, Q/K norms, products, scores and sum)."""
    return 4 * s.dim + 2 * s.hd + s.seq + s.heads * s.hd + s.hidden


def step(impl: ModuleType, w: BlockWeights, rows: int) -> Tuple[torch.Tensor, ...]:
    x = torch.randn(rows, w.dim, generator=torch.Generator().manual_seed(rows))
    out = torch.empty(rows, w.dim)
    impl.block(w, x, out, SLOTS[:rows], POSITIONS[:rows], 2)
    return out, w.k, w.v


@pytest.mark.parametrize("features", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quant"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@torch.no_grad()
def test_the_compiled_step_equals_its_twin(features: Tuple[str, ...], quantized: bool,
                                           rows: int) -> None:
    if len(IMPLS) < 2:
        pytest.skip("the compiled module is not built")
    twin, compiled = IMPLS
    want = step(twin, block_weights(features, quantized), rows)
    got = step(compiled, block_weights(features, quantized), rows)
    length = path_length(QUANT if quantized else FLOAT)
    for a, b in zip(got, want):
        assert_close(a, b, length)


def reference(w: BlockWeights, x: torch.Tensor, slots: Sequence[int],
              positions: Sequence[int]) -> Tuple[torch.Tensor, ...]:
    """The block as transformers' decoder layers compute it (Qwen2's bias, Qwen3's and Gemma
    3's per-head norms, Gemma 3's sandwich norms, GeGLU, scale and sliding window), with
    float matrices: every row's keys and values written first, then each row's attention
    over the whole cache with the positions it may not see masked."""
    k_cache, v_cache = w.k.clone(), w.v.clone()
    rows, hd, half = x.shape[0], w.head_dim, w.head_dim // 2
    q_dim, kv_dim = w.n_heads * hd, w.n_kv * hd

    def norm(t: torch.Tensor, weight: Any) -> torch.Tensor:
        if weight is None:
            return t
        return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + w.eps))

    def rotate(t: torch.Tensor, p: int) -> torch.Tensor:  # t (heads, hd)
        c, s, a, b = w.cos[p], w.sin[p], t[:, :half], t[:, half:]
        return torch.cat([a * c[:half] - b * s[:half], b * c[half:] + a * s[half:]], 1)

    h = norm(x, w.attn_norm) @ w.qkv.T + (0 if w.qkv_bias is None else w.qkv_bias)
    q = norm(h[:, :q_dim].reshape(rows, w.n_heads, hd), w.q_norm)
    k = norm(h[:, q_dim:q_dim + kv_dim].reshape(rows, w.n_kv, hd), w.k_norm)
    for r, (slot, p) in enumerate(zip(slots, positions)):
        k_cache[slot, :, p] = rotate(k[r], p)
        v_cache[slot, :, p] = h[r, q_dim + kv_dim:].reshape(w.n_kv, hd)
    att = []
    key_pos = torch.arange(w.k.shape[2])
    for r, (slot, p) in enumerate(zip(slots, positions)):
        keys = k_cache[slot].repeat_interleave(w.n_heads // w.n_kv, 0)  # (heads, seq, hd)
        values = v_cache[slot].repeat_interleave(w.n_heads // w.n_kv, 0)
        scores = torch.einsum("hd,hsd->hs", rotate(q[r], p), keys)
        scores = scores * (w.attn_scale if w.attn_scale is not None else hd ** -0.5)
        seen = (key_pos <= p) & ((p - key_pos < w.window) if w.window else True)
        probs = torch.softmax(scores.masked_fill(~seen, -math.inf), -1)
        att.append(torch.einsum("hs,hsd->hd", probs, values).reshape(q_dim))
    x = x + norm(torch.stack(att) @ w.wo.T, w.post_attn_norm)
    gate, up = (norm(x, w.mlp_norm) @ w.gate_up.T).chunk(2, -1)
    if w.activation == "gelu_tanh":
        act = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                           * (gate + 0.044715 * gate ** 3)))
    else:
        act = gate / (1 + torch.exp(-gate))
    return x + norm((act * up) @ w.down.T, w.post_mlp_norm), k_cache, v_cache


@pytest.mark.parametrize("features", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("rows", [1, 3, 8])
@torch.no_grad()
def test_the_twin_equals_the_reference(features: Tuple[str, ...], rows: int) -> None:
    w = block_weights(features, False)
    x = torch.randn(rows, w.dim, generator=torch.Generator().manual_seed(rows))
    want = reference(w, x, SLOTS[:rows], POSITIONS[:rows])
    got = step(IMPLS[0], w, rows)
    for a, b in zip(got, want):
        assert_close(a, b, path_length(FLOAT))


@torch.no_grad()
def test_each_part_changes_the_result() -> None:
    """No part is a no-op where the step is concerned (a test of it could not fail): each
    one moves the output of some row beyond rounding, the window 100 (wider than every
    position) none."""
    plain = step(IMPLS[-1], block_weights((), False), 8)[0]
    for name in FEATURES:
        got = step(IMPLS[-1], block_weights((name,), False), 8)[0]
        moved = (got - plain).abs().max().item()
        assert (moved == 0.0) == (name == "window100"), (name, moved)


def test_window_limits_the_keys(impl: ModuleType) -> None:
    """With a window of 3, a row's output does not depend on keys 3 or more positions back
    but does on the two before it."""
    outs = []
    for poke in (None, 37, 38):  # row 2 (slot 7) at position 40
        w = block_weights(("window3",), False)
        if poke is not None:
            w.k[7, :, poke] += 5.0
        outs.append(step(impl, w, 3)[0][2])
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> Any:
    return preferred(request.param)


@pytest.mark.parametrize("change, message", [
    (dict(qkv_bias=torch.zeros(5)), "qkv_bias (5,) is not (80,)"),
    (dict(q_norm=torch.zeros(40)), "q_norm (40,) is not (10,)"),
    (dict(k_norm=torch.zeros(10, dtype=torch.float64)), "k_norm is not a contiguous float32"),
    (dict(post_attn_norm=torch.zeros(10)), "post_attn_norm (10,) is not (40,)"),
    (dict(post_mlp_norm=[1.0] * 40), "post_mlp_norm is not a contiguous float32"),
    (dict(activation="gelu"), "activation 'gelu' is not one of silu, gelu_tanh"),
    (dict(attn_scale=-0.5), "attn_scale -0.5 is not a positive number"),
    (dict(attn_scale="big"), "attn_scale 'big' is not a positive number"),
    (dict(attn_scale=math.inf), "attn_scale inf is not a positive number"),
    (dict(window=-1), "window -1 is not a whole number >= 0"),
    (dict(window=2.5), "window 2.5 is not a whole number >= 0"),
    (dict(window=True), "window True is not a whole number >= 0"),
])
def test_bad_parts_quote_the_value(change: Dict[str, Any], message: str) -> None:
    w = block_weights((), False)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        w.replace(**change)


def test_replace_keeps_the_parts() -> None:
    w = block_weights(CASES[-1], False)
    again = w.replace(eps=1e-6)
    assert again.eps == 1e-6 and again.q_norm is w.q_norm and again.window == 3
    assert again.activation == "gelu_tanh" and again.attn_scale == 0.125
    assert not w.wants_grad()
    assert w.replace(q_norm=w.q_norm.clone().requires_grad_()).wants_grad()


def test_step_weights_pass_the_parts_a_block_has() -> None:
    """The attribute names the families set on the torch block: absent or None is absent;
    a norm of another eps, or an activation the step has not, keeps the block in torch."""
    net = model()
    net.setup_cache(2, 16)
    block = net.layers["0"]
    plain = block.step_weights(net.rope_cos, net.rope_sin)
    assert (plain.qkv_bias, plain.q_norm, plain.post_attn_norm) == (None, None, None)
    assert (plain.activation, plain.attn_scale, plain.window) == ("silu", None, 0)
    eps, hd, dim = block.attn_norm.eps, block.attn.head_dim, net.cfg.dim
    block.attn.q_norm, block.attn.k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)
    block.post_attn_norm, block.post_mlp_norm = RMSNorm(dim, eps), RMSNorm(dim, eps)
    block.mlp.activation, block.attn.scale, block.attn.window = "gelu_tanh", 0.25, 5
    w = block.step_weights(net.rope_cos, net.rope_sin)
    assert w.q_norm is block.attn.q_norm.weight and w.k_norm is block.attn.k_norm.weight
    assert w.post_attn_norm is block.post_attn_norm.weight
    assert w.post_mlp_norm is block.post_mlp_norm.weight
    assert (w.activation, w.attn_scale, w.window) == ("gelu_tanh", 0.25, 5)
    block.attn.k_norm = None
    assert block.step_weights(net.rope_cos, net.rope_sin).k_norm is None
    block.post_mlp_norm = RMSNorm(dim, eps * 2)
    assert block.step_weights(net.rope_cos, net.rope_sin) is None
    block.post_mlp_norm, block.mlp.activation = None, "relu"
    assert block.step_weights(net.rope_cos, net.rope_sin) is None


QWEN2 = ModelConfig(vocab_size=64, dim=40, n_layers=3, n_heads=4, n_kv_heads=2,
                    intermediate_size=52, max_seq_len=48, model_type="qwen2")


def test_a_qwen2_model_decodes_through_the_step(impl: ModuleType,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Q/K/V biases in the step: every decode step of every row is one call of ``blocks``
    over all blocks, the bias passed, with the torch path's logits and keys."""
    calls: List[int] = []

    class Counting:
        PREFERRED, MAX_ROWS = True, impl.MAX_ROWS
        usable, plan = staticmethod(impl.usable), staticmethod(impl.plan)
        logits_usable, logits = staticmethod(impl.logits_usable), staticmethod(impl.logits)

        @staticmethod
        def blocks(plan: Any, *args: Any) -> None:
            calls.append(len(plan.weights))
            impl.blocks(plan, *args)

    net = model(QWEN2)
    assert net.layers["0"].attn.wq.bias is not None
    prompts = torch.randint(0, QWEN2.vocab_size, (3, impl.MAX_ROWS + 1),  # prefill in torch
                            generator=torch.Generator().manual_seed(2))
    ref, ref_k = decode(net, TorchPath, monkeypatch, prompts, [0, 5, 2], 10)
    got, got_k = decode(net, Counting, monkeypatch, prompts, [0, 5, 2], 10)
    assert calls == [QWEN2.n_layers] * 10
    weights = net._step_weights()
    attn = net.layers["1"].attn
    assert torch.equal(weights[1].qkv_bias, torch.cat([attn.wq.bias, attn.wk.bias, attn.wv.bias]))
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert_close(got, ref, model_path_length(QWEN2))
    for a, b in zip(got_k, ref_k):
        assert_close(a, b, model_path_length(QWEN2))
