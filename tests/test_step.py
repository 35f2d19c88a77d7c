"""The decode step (``ext/_cstep.pyx`` and its twin ``mdiedge/model/_pystep.py``): a dense
block's decode equal to the block's own torch forward within float32 rounding (outputs and
the KV written), the decode path of a model taking it with the same tokens as the torch
path, a row's result independent of the rows beside it and of the thread count (compiled),
argument checks quoting the offending value, and the blocks it does not apply to keeping
the torch path."""
from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any, List, Tuple

import pytest
import torch

from mdiedge.model.transformer import STEP
from mdiedge.model._stepconstants import MAX_ROWS, STEP_ROWS, decode_pieces
from mdiedge.model import transformer as transformer_module
from mdiedge.model.config import ModelConfig
from mdiedge.model.earlyexit.policy import NEVER, ExitPolicy, ExitStep
from mdiedge.model.transformer import Transformer
from tolerance import assert_close, model_path_length

pytestmark = pytest.mark.twins
IMPLS = STEP.implementations()
# head_dim 10 and widths that are not multiples of 8 reach every tail of the kernels
CFG = ModelConfig(vocab_size=64, dim=40, n_layers=3, n_heads=4, n_kv_heads=2,
                  intermediate_size=52, max_seq_len=48)


def preferred(module: ModuleType) -> Any:
    """``module`` as the model's decode would take it, the twin too."""
    return SimpleNamespace(**{**vars(module), "PREFERRED": True})


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> Any:
    return preferred(request.param)


def test_only_the_compiled_step_is_preferred() -> None:
    assert [m.PREFERRED for m in IMPLS] == [False, True][:len(IMPLS)]


class TorchPath:
    """Stands in for the step module: applies to nothing, so every block runs in torch."""

    PREFERRED = False


def model(cfg: ModelConfig = CFG, seed: int = 0, fused: bool = True,
          std: float = 0.3) -> Transformer:
    torch.manual_seed(seed)
    net = Transformer(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, std) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    if fused:
        net.fuse_projections()
    return net


def decode(net: Transformer, step: object, monkeypatch: pytest.MonkeyPatch,
           prompts: torch.Tensor, starts: List[int], steps: int
           ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Greedy decode of ``prompts`` (B, T) in slots 0..B-1, row b prefilled from position
    ``starts[b]``; the logits of every step (steps + 1, B, vocab) and the blocks' K caches."""
    monkeypatch.setattr(transformer_module, "_step", step)
    net.setup_cache(prompts.shape[0] + 1, CFG.max_seq_len)
    rows, length = prompts.shape
    slots = torch.arange(rows)
    with torch.inference_mode():
        logits = torch.cat([net(prompts[b:b + 1], slots[b:b + 1], [starts[b]])
                            for b in range(rows)])
        out = [logits]
        for i in range(steps):
            positions = [s + length + i for s in starts]
            logits = net(logits.argmax(-1)[:, None], slots, positions)
            out.append(logits)
    return torch.stack(out), [b.attn.cache.k.clone() for b in net.layers.values()]


def test_both_implementations_present() -> None:
    names = [m.__name__ for m in IMPLS]
    assert "mdiedge.model._pystep" in names
    assert len(names) == 2 or "MDIEDGE_NO_EXTENSIONS" in __import__("os").environ


@pytest.mark.parametrize("starts", [[0], [0, 0, 0], [0, 5, 2], [3, 0, 9, 1, 0, 4, 2, 7]])
def test_decode_matches_the_torch_path(impl: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                       starts: List[int]) -> None:
    """Rows in their own slots at their own positions (one mask or none in torch)."""
    net = model()
    prompts = torch.randint(0, CFG.vocab_size, (len(starts), 6),
                            generator=torch.Generator().manual_seed(len(starts)))
    ref, ref_k = decode(net, TorchPath, monkeypatch, prompts, starts, 12)
    got, got_k = decode(net, impl, monkeypatch, prompts, starts, 12)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert_close(got, ref, model_path_length(CFG))
    for a, b in zip(got_k, ref_k):
        assert_close(a, b, model_path_length(CFG))


@pytest.mark.parametrize("dim", [72, 80])
def test_wide_heads_match_the_torch_path(impl: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                         dim: int) -> None:
    """Heads of 36 and 40 (four vectors of the weighted sum at once, one, and a tail) over
    keys that cross several groups of eight."""
    cfg = ModelConfig(vocab_size=64, dim=dim, n_layers=2, n_heads=2, n_kv_heads=1,
                      intermediate_size=52, max_seq_len=48)
    net = model(cfg)
    prompts = torch.randint(0, cfg.vocab_size, (3, 6), generator=torch.Generator().manual_seed(5))
    ref, ref_k = decode(net, TorchPath, monkeypatch, prompts, [0, 9, 17], 20)
    got, got_k = decode(net, impl, monkeypatch, prompts, [0, 9, 17], 20)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert_close(got, ref, model_path_length(cfg))
    for a, b in zip(got_k, ref_k):
        assert_close(a, b, model_path_length(cfg))


@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(4, 2, 32), (4, 1, 64), (3, 1, 32),
                                                   (2, 2, 32), (4, 2, 128)])
@pytest.mark.parametrize("starts", [[0], [0, 9, 17]])
def test_common_head_sizes_match_the_torch_path(
        impl: ModuleType, monkeypatch: pytest.MonkeyPatch, n_heads: int, n_kv: int,
        head_dim: int, starts: List[int]) -> None:
    """The head sizes of real models (32, 64, 128) with 2, 4, 3 and 1 query heads per KV
    head, for one row and for three at different positions."""
    cfg = ModelConfig(vocab_size=64, dim=n_heads * head_dim, n_layers=2, n_heads=n_heads,
                      n_kv_heads=n_kv, intermediate_size=52, max_seq_len=48)
    net = model(cfg, std=0.3 * (CFG.dim / cfg.dim) ** 0.5)  # activations as CFG's
    prompts = torch.randint(0, cfg.vocab_size, (len(starts), 6),
                            generator=torch.Generator().manual_seed(7))
    ref, ref_k = decode(net, TorchPath, monkeypatch, prompts, starts, 20)
    got, got_k = decode(net, impl, monkeypatch, prompts, starts, 20)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert_close(got, ref, model_path_length(cfg))
    for a, b in zip(got_k, ref_k):
        assert_close(a, b, model_path_length(cfg))


def test_the_model_decodes_through_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense fused model's decode runs its blocks in one call of the step per step; its
    prefill, of more positions than the step's rows, does not call it. The head of every step, prefill's last position too, is one
    call of ``logits``."""
    calls: List[int] = []
    heads: List[int] = []
    compiled = IMPLS[-1]

    class Counting:
        PREFERRED, MAX_ROWS = True, compiled.MAX_ROWS
        usable = staticmethod(compiled.usable)
        plan = staticmethod(compiled.plan)
        logits_usable = staticmethod(compiled.logits_usable)

        @staticmethod
        def blocks(plan: object, *args: object) -> None:
            calls.append(len(plan.weights))  # type: ignore[attr-defined]
            compiled.blocks(plan, *args)

        @staticmethod
        def logits(norm: object, eps: float, head: object, x: torch.Tensor,
                   *args: object) -> None:
            heads.append(x.shape[0])
            compiled.logits(norm, eps, head, x, *args)

    prompts = torch.randint(0, CFG.vocab_size, (2, compiled.MAX_ROWS + 1),
                            generator=torch.Generator().manual_seed(3))
    decode(model(), Counting, monkeypatch, prompts, [0, 0], 4)
    assert calls == [CFG.n_layers] * 4
    assert heads == [1, 1] + [2] * 4


@torch.no_grad()
def test_blocks_in_one_call_equal_one_call_each(impl: ModuleType) -> None:
    slots, positions = [2, 5, 0], [7, 30, 0]
    outputs = []
    for together in (True, False):
        net, x = step_inputs(3)
        weights = [b.step_weights(net.rope_cos, net.rope_sin) for b in net.layers.values()]
        out = torch.empty(3, CFG.dim)
        if together:
            impl.blocks(impl.plan(weights), x, out, slots, positions, 2)
        else:
            for w in weights:
                impl.block(w, x, out, slots, positions, 2)
                x = out.clone()
        outputs.append((out, [b.attn.cache.v.clone() for b in net.layers.values()]))
    (a, a_v), (b, b_v) = outputs
    assert torch.equal(a, b) and all(torch.equal(p, q) for p, q in zip(a_v, b_v))


def in_rope_pairs(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of whole heads in Hugging Face's order (2, half) put in llama.cpp's RoPE-pair order
    (half, 2), as a Llama GGUF file stores Q and K."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(rows.shape)


@torch.no_grad()
def test_q_and_k_in_rope_pairs_equal_them_in_order(impl: ModuleType) -> None:
    """``qk_pairs``: the product's Q and K heads are put in order before the bias, norms and
    RoPE, so a block with its Q and K rows in pair order computes the same output and KV (each
    row's product is the same sum wherever the row is)."""
    slots, positions = [2, 5, 0], [7, 30, 0]
    results = []
    for pairs in (False, True):
        net, x = step_inputs(3)
        w = net.layers["1"].step_weights(net.rope_cos, net.rope_sin)
        if pairs:
            q_and_k = (CFG.n_heads + CFG.n_kv_heads) * CFG.head_dim
            qkv = torch.cat([in_rope_pairs(w.qkv[:q_and_k], CFG.head_dim), w.qkv[q_and_k:]])
            w = w.replace(qkv=qkv.contiguous(), qk_pairs=True)
        out = torch.empty(3, CFG.dim)
        impl.block(w, x, out, slots, positions, 2)
        results.append((out, w.k.clone(), w.v.clone()))
    (a, a_k, a_v), (b, b_k, b_v) = results
    assert torch.equal(b, a) and torch.equal(b_k, a_k) and torch.equal(b_v, a_v)


@torch.no_grad()
def test_a_half_cache_is_written_rounded_and_read_exactly(impl: ModuleType) -> None:
    """K and V in float16 (the q8 mode's cache): each row's new key and value written rounded
    to nearest even (as torch's ``half()``), the cache's halves read exactly, so the output is
    the float cache's within the new key's and value's rounding."""
    slots, positions = [2, 5, 0], [7, 30, 0]
    results = []
    for half in (False, True):
        net, x = step_inputs(3)
        w = net.layers["1"].step_weights(net.rope_cos, net.rope_sin)
        dtype = torch.float16 if half else torch.float32
        w = w.replace(k=w.k.half().to(dtype).contiguous(), v=w.v.half().to(dtype).contiguous())
        out = torch.empty(3, CFG.dim)
        impl.block(w, x, out, slots, positions, 2)
        results.append((out, w.k, w.v))
    (a, a_k, a_v), (b, b_k, b_v) = results
    assert b_k.dtype == torch.float16 and torch.equal(b_k, a_k.half())
    assert torch.equal(b_v, a_v.half())
    torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)


def test_a_half_cache_needs_both_halves() -> None:
    net, _ = step_inputs(1)
    w = net.layers["1"].step_weights(net.rope_cos, net.rope_sin)
    with pytest.raises(ValueError, match="k torch.float16 and v torch.float32 are not both"):
        w.replace(k=w.k.half())


def test_unpaired_is_the_inverse_of_the_pair_order() -> None:
    from mdiedge.model._stepconstants import unpaired

    rows = torch.arange(2 * 3 * 8, dtype=torch.float32).reshape(3 * 8, 2)  # 3 heads of 8
    paired = in_rope_pairs(rows, 8).T.contiguous().numpy()  # (2 rows, 24)
    assert paired[0, :8].tolist() == [0, 8, 2, 10, 4, 12, 6, 14]
    assert unpaired(paired, 8).tolist() == rows.T.tolist()


@torch.no_grad()
def test_bad_plans_are_refused(impl: ModuleType) -> None:
    net, x = step_inputs(1)
    w = net.layers["0"].step_weights(net.rope_cos, net.rope_sin)
    other = step_inputs(1)[0]
    other_cfg = CFG.replace(dim=48, n_heads=4, n_kv_heads=2)
    wide = model(other_cfg)
    wide.setup_cache(2, 16)
    with pytest.raises(ValueError, match=r"a plan needs one or more BlockWeights, got 0"):
        impl.plan([])
    with pytest.raises(ValueError, match=r"got 2 \(BlockWeights, str\)"):
        impl.plan([w, "block"])
    with pytest.raises(ValueError, match=r"blocks of widths \[40, 48\] cannot run"):
        impl.plan([w, wide.layers["0"].step_weights(wide.rope_cos, wide.rope_sin)])
    with pytest.raises(ValueError, match="plan list is not this module's Plan"):
        impl.blocks([w], x, torch.empty(1, CFG.dim), [0], [0], 1)
    small = impl.plan([w, other.layers["1"].step_weights(other.rope_cos, other.rope_sin)])
    with pytest.raises(ValueError, match="slot 0 at position 48 outside 8 slots of 48"):
        impl.blocks(small, x, torch.empty(1, CFG.dim), [0], [48], 1)


@pytest.mark.parametrize("fused, moe", [(False, False), (True, True)])
def test_blocks_it_does_not_apply_to_keep_the_torch_path(
        monkeypatch: pytest.MonkeyPatch, fused: bool, moe: bool) -> None:
    cfg = CFG.replace(n_experts=3, experts_per_token=2, model_type="mixtral") if moe else CFG

    class Refusing:  # the head's call applies to every model
        PREFERRED, MAX_ROWS = True, 8
        usable = staticmethod(IMPLS[-1].usable)
        logits_usable = staticmethod(IMPLS[-1].logits_usable)
        logits = staticmethod(IMPLS[-1].logits)

        @staticmethod
        def block(*args: object) -> None:
            raise AssertionError("the step ran on a block it does not apply to")

    net = model(cfg, fused=fused)
    for block in net.layers.values() if moe else ():  # an expert's gate and up not fused
        block.mlp.experts[1].gate_up = None
    prompts = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(4))
    decode(net, Refusing, monkeypatch, prompts, [0], 3)
    assert all(b.step_weights(net.rope_cos, net.rope_sin) is None for b in net.layers.values())


def test_the_step_weights_follow_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made once per cache set-up, made again by another ``setup_cache`` or a move."""
    net = model()
    prompts = torch.randint(0, CFG.vocab_size, (1, 4), generator=torch.Generator().manual_seed(5))
    decode(net, preferred(IMPLS[-1]), monkeypatch, prompts, [0], 2)
    first = net._step_weights()
    assert len(first) == CFG.n_layers and net._step_weights() is first
    assert first[0].k is net.layers["0"].attn.cache.k
    assert list(net._plans) == [(0, CFG.n_layers)]
    net.setup_cache(2, 16)
    again = net._step_weights()
    assert again is not first and again[0].k is net.layers["0"].attn.cache.k
    assert not net._plans
    net.to(torch.float32)
    assert net._step_weights() is not again


def step_inputs(rows: int, seed: int = 0) -> Tuple[Transformer, torch.Tensor]:
    net = model(seed=seed)
    net.setup_cache(8, CFG.max_seq_len)
    with torch.no_grad():
        for block in net.layers.values():
            block.attn.cache.k.normal_(generator=torch.Generator().manual_seed(seed + 1))
            block.attn.cache.v.normal_(generator=torch.Generator().manual_seed(seed + 2))
    return net, torch.randn(rows, CFG.dim, generator=torch.Generator().manual_seed(seed + 3))


def half_weights(net: Transformer, half: bool) -> Any:
    """Block 1's step weights, over float16 copies of its caches where ``half``."""
    w = net.layers["1"].step_weights(net.rope_cos, net.rope_sin)
    return w.replace(k=w.k.half(), v=w.v.half()) if half else w


@torch.no_grad()
@pytest.mark.parametrize("half", [False, True], ids=["float32 cache", "float16 cache"])
def test_row_results_do_not_depend_on_batch_or_threads(half: bool) -> None:
    """Compiled: a row's output and KV are bit-identical alone, in a batch of 8 at other
    positions and slots, and on 1 or 3 threads (with a float16 cache the tasks take a KV
    head's query heads together, as many as the threads leave)."""
    if len(IMPLS) < 2:
        pytest.skip("the compiled module is not built")
    compiled = IMPLS[1]
    slots, positions = [3, 0, 7, 1, 2, 4, 5, 6], [17, 0, 40, 3, 9, 31, 1, 46]
    net, x = step_inputs(8)
    w = half_weights(net, half)
    batch = torch.empty(8, CFG.dim)
    compiled.block(w, x, batch, slots, positions, 2)
    batch_k = w.k.clone()
    for threads in (1, 3):
        for r in range(8):
            net, x = step_inputs(8)
            w = half_weights(net, half)
            alone = torch.empty(1, CFG.dim)
            compiled.block(w, x[r:r + 1].contiguous(), alone, slots[r:r + 1],
                           positions[r:r + 1], threads)
            assert torch.equal(alone[0], batch[r])
            written = (slots[r], slice(None), positions[r])
            assert torch.equal(w.k[written], batch_k[written])


@torch.no_grad()
@pytest.mark.parametrize("window", [0, 9], ids=["full", "window 9"])
@pytest.mark.parametrize("half", [False, True], ids=["float32 cache", "float16 cache"])
def test_a_samples_consecutive_rows_equal_its_rows_one_by_one(half: bool, window: int) -> None:
    """Compiled: rows of one sample at consecutive positions (a verified draft; with a float16
    cache their tasks widen the keys once for all of them), beside rows of other samples,
    give each row's output and KV bit for bit as the rows decoded one at a time, on 1 and 3
    threads; a sliding window starts rows at different keys."""
    if len(IMPLS) < 2:
        pytest.skip("the compiled module is not built")
    compiled = IMPLS[1]
    slots = [2, 2, 2, 2, 2, 5, 5, 1]
    positions = [20, 21, 22, 23, 24, 7, 8, 30]
    for threads in (1, 3):
        net, x = step_inputs(8)
        w = half_weights(net, half).replace(window=window)
        batch = torch.empty(8, CFG.dim)
        compiled.block(w, x, batch, slots, positions, threads)
        net, x = step_inputs(8)
        w1 = half_weights(net, half).replace(window=window)
        for r in range(8):
            alone = torch.empty(1, CFG.dim)
            compiled.block(w1, x[r:r + 1].contiguous(), alone, slots[r:r + 1],
                           positions[r:r + 1], threads)
            assert torch.equal(alone[0], batch[r]), (threads, r)
        assert torch.equal(w1.k, w.k) and torch.equal(w1.v, w.v)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(slots=[8]), "slot 8 at position 5 outside 8 slots of 48 positions"),
    (lambda a: a.update(positions=[48]), "slot 0 at position 48 outside 8 slots of 48"),
    (lambda a: a.update(positions=[-1]), "slot 0 at position -1 outside"),
    (lambda a: a.update(positions=[1, 2]), "1 slots and 2 positions for 1 rows"),
    (lambda a: a.update(threads=0), "threads 0 is not >= 1"),
    (lambda a: a.update(out=torch.empty(2, CFG.dim)), "out (2, 40) torch.float32 is not"),
    (lambda a: a.update(x=torch.zeros(1, CFG.dim, dtype=torch.float64)), "x (1, 40) torch.float64"),
    (lambda a: a.update(x=torch.zeros(STEP_ROWS + 1, CFG.dim)), f"x ({STEP_ROWS + 1}, 40)"),
    (lambda a: a.update(weights=a["weights"].replace(wo=torch.zeros(40, 8))),
     "wo (40, 8) is not (40, 40)"),
    (lambda a: a.update(weights=a["weights"].replace(sin=torch.zeros(48, 6))), "sin (48, 6)"),
    (lambda a: a.update(weights=a["weights"].replace(k=torch.zeros(2, 8, 48, 10).transpose(0, 1))),
     "k is not a contiguous float32 CPU tensor"),
    (lambda a: a.update(weights=tuple(range(12))), "weights tuple are not BlockWeights"),
])
@torch.no_grad()
def test_bad_arguments_quote_the_value(impl: ModuleType, change: object, message: str) -> None:
    net, x = step_inputs(1)
    block = net.layers["0"]
    args = {"weights": block.step_weights(net.rope_cos, net.rope_sin), "x": x,
            "out": torch.empty(1, CFG.dim), "slots": [0], "positions": [5], "threads": 1}
    before = block.attn.cache.k.clone()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        change(args)  # type: ignore[operator]
        impl.block(**args)
    assert torch.equal(block.attn.cache.k, before)  # nothing written


@pytest.mark.parametrize("thresholds, depth", [
    ([NEVER, 2.0, NEVER, 2.0, NEVER], 0),   # checked after blocks 1 and 3, never passed
    ([NEVER, 2.0, NEVER, -2.0, NEVER], 4),  # every row exits after block 3
    ([-2.0, NEVER, NEVER, NEVER, NEVER], 1),
])
def test_early_exit_through_the_step_equals_the_torch_path(
        impl: ModuleType, monkeypatch: pytest.MonkeyPatch, thresholds: List[float],
        depth: int) -> None:
    """Blocks between checked ones run in one call; the checks, the exit and the KV fill
    of the skipped blocks are those of the torch path."""
    cfg = CFG.replace(n_layers=5)
    results = []
    for step in (TorchPath, impl):
        monkeypatch.setattr(transformer_module, "_step", step)
        net = model(cfg, seed=2)
        net.setup_cache(3, cfg.max_seq_len)
        prompts = torch.randint(0, cfg.vocab_size, (2, 6),
                                generator=torch.Generator().manual_seed(6))
        policy = ExitPolicy("similarity", thresholds)
        with torch.inference_mode():
            net(prompts, torch.arange(2), [0, 0])
            x = net.embed_tokens(torch.tensor([[7], [9]]))
            exit_step = ExitStep.start(policy, 2)
            y = net.run_blocks(x, torch.arange(2), [6, 6], exit_step)
        written = [b.attn.cache.k[:2, :, 6].clone() for b in net.layers.values()]
        results.append((y, exit_step, written))
    (ref, ref_step, ref_k), (got, got_step, got_k) = results
    assert got_step.depth == ref_step.depth == depth
    assert got_step.checked == ref_step.checked
    assert_close(got, ref, model_path_length(cfg))
    for a, b in zip(got_k, ref_k):
        assert_close(a, b, model_path_length(cfg))


@pytest.mark.twins
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_act_mul_is_torchs_activation_times_up(impl: ModuleType, activation: str) -> None:
    """A prefill's feed-forward product (``act_mul``): torch's silu / gelu(approximate="tanh")
    of the gate times up within 2e-6 relative (1e-12 absolute), large gates of either sign, for
    hidden widths that are not multiples of the lanes; the same bits on 1 and 3 threads."""
    gen = torch.Generator().manual_seed(7)
    for rows, hidden in ((1, 8), (3, 37), (5, 64)):
        both = torch.randn(rows, 2 * hidden, generator=gen) * 4
        both[0, :3] = torch.tensor([-95.0, 0.0, 95.0])
        gate, up = both[:, :hidden], both[:, hidden:]
        act = (torch.nn.functional.silu(gate.double()) if activation == "silu" else
               torch.nn.functional.gelu(gate.double(), approximate="tanh"))
        want = (act * up.double()).float()
        got = impl.act_mul(both, torch.full((rows, hidden), float("nan")), activation, 1)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-12)
        again = impl.act_mul(both, torch.empty(rows, hidden), activation, 3)
        assert torch.equal(again, got)


@pytest.mark.twins
@pytest.mark.parametrize("case,match", [
    ("activation", "activation 'relu' is not one of silu, gelu_tanh"),
    ("odd", r"gate and up \(2, 7\) are not a contiguous float32 \(rows, 2 hidden\)"),
    ("out", r"out \(2, 4\) is not a contiguous float32 \(2, 3\)"),
    ("threads", "threads 0 is not >= 1"),
])
def test_act_mul_refuses_bad_arguments(impl: ModuleType, case: str, match: str) -> None:
    both, out, activation, threads = torch.randn(2, 6), torch.empty(2, 3), "silu", 1
    if case == "activation":
        activation = "relu"
    elif case == "odd":
        both = torch.randn(2, 7)
    elif case == "out":
        out = torch.empty(2, 4)
    else:
        threads = 0
    with pytest.raises(ValueError, match=match):
        impl.act_mul(both, out, activation, threads)


@pytest.mark.parametrize("samples, rows_each, pieces", [
    (1, 1, [(0, 1)]),
    (9, 1, [(0, 9)]),
    (32, 1, [(0, 32)]),
    (33, 1, [(0, 32), (32, 33)]),
    (70, 1, [(0, 32), (32, 64), (64, 70)]),
    (1, 8, [(0, 8)]),
    (5, 7, [(0, 32), (32, 35)]),  # the fifth sample's rows span two calls
    (4, 8, [(0, 32)]),
    (1, 9, None),  # a prefill's run: the many-row kernels
    (4, 64, None),
    (0, 1, None),
    (1, 0, None),
])
def test_decode_pieces_cut_few_rows_each_into_step_calls(samples: int, rows_each: int,
                                                         pieces: Any) -> None:
    assert (MAX_ROWS, STEP_ROWS) == (8, 32)
    assert decode_pieces(samples, rows_each) == pieces
