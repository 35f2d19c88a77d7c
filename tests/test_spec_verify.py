"""Verification of drafted tokens in a stage: a decode message carrying several consecutive
positions of a sample (every block writes their K/V and attends causally, through the
compiled step and its twin as through torch), the explicit rewind of a slot's KV fill (the
REWIND flag on the wire, refused without it), and speculative greedy decoding of NanoLlama
over 1 and 3 in-process stages giving exactly plain decoding's 200 tokens, drafting with
prompt lookup and with the draft model."""
from __future__ import annotations

import socket
from pathlib import Path
from types import ModuleType
from typing import Any, List, Optional, Sequence

import numpy as np
import pytest
import torch

from mdiedge.model.transformer import STEP
from mdiedge.runtime.framing import FRAMING
from mdiedge.base.errors import RingError, SlotError
from mdiedge.model import transformer as transformer_module
from mdiedge.model.sampling import SamplingParams
from mdiedge.runtime import framing, messages
from mdiedge.runtime.draftmodel import DraftModelDrafter
from mdiedge.runtime.drafting import NgramDrafter
from mdiedge.runtime.messages import Message
from mdiedge.runtime.slots import SlotTable
from mdiedge.runtime.speculation import KPolicy, Speculation, drafter_for
from mdiedge.runtime.stages import LocalStage
from specloop import build, decode
from test_step import CFG, TorchPath, model, preferred
from tolerance import assert_close, model_path_length

REPO = Path(__file__).resolve().parent.parent
NANOLLAMA = REPO / "models" / "nanollama"
DRAFT = REPO / "models" / "nanollama-draft"
STEPS = STEP.implementations()
FRAMINGS = FRAMING.implementations()


@pytest.mark.parametrize("filled, position, tokens, rewind, after", [
    (10, 10, 3, False, 13),
    (10, 10, 3, True, 13),  # a rewind flag without going back: a plain step
    (10, 7, 4, True, 11),  # back to 7: rows 7..9 overwritten, the fill is 11
    (10, 0, 1, True, 1),
    (10, 7, 4, False, None),  # going back unmarked: a stale step
    (10, 11, 1, True, None),  # past the fill: refused, rewind or not
])
def test_a_marked_step_may_rewind_a_slots_fill(filled: int, position: int, tokens: int,
                                               rewind: bool, after: Optional[int]) -> None:
    table = SlotTable(2)
    table.allocate(5)
    table.advance([5], [0], filled)
    if after is None:
        with pytest.raises(SlotError, match=f"position {position} does not follow"):
            table.advance([5], [position], tokens, rewind=rewind)
        assert table.filled(5) == filled
    else:
        table.advance([5], [position], tokens, rewind=rewind)
        assert table.filled(5) == after


@pytest.mark.parametrize("impl", FRAMINGS, ids=[m.__name__ for m in FRAMINGS])
def test_the_rewind_flag_crosses_a_link(impl: ModuleType) -> None:
    a, b = socket.socketpair()
    try:
        x = torch.randn(1, 3, 8)
        framing.send_tensor(a, messages.ACTIVATION, [4], [9], x, flags=framing.FLAG_REWIND,
                            impl=impl)
        header, got = framing.recv_frame(b, 1 << 20, impl=impl)
        assert header.flags & framing.FLAG_REWIND and np.array_equal(got, x.numpy())
        for rewind in (True, False):
            messages.send(a, Message(messages.ACTIVATION, [4], [9], x, rewind=rewind))
            assert messages.receive(b, 1 << 20)[0].rewind is rewind
    finally:
        a.close()
        b.close()


def stage_steps(step: Any, monkeypatch: pytest.MonkeyPatch, chunks: Sequence[int],
                rewind_to: Optional[int] = None) -> List[torch.Tensor]:
    """A prompt of 5, then decode messages of ``chunks`` positions each through one stage
    of the step test's random model; with ``rewind_to``, one more step of 3 from there.
    The hidden states each returned."""
    monkeypatch.setattr(transformer_module, "_step", step)
    net = model()
    stage = LocalStage(net, 2, CFG.max_seq_len)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5 + sum(chunks) + 3, CFG.dim, generator=gen)
    stage.forward(Message(messages.ACTIVATION, [1], [0], x[:, :5], prefill=True))
    out, at = [], 5
    for n in chunks:
        out.append(stage.forward(Message(messages.ACTIVATION, [1], [at], x[:, at:at + n])).hidden)
        at += n
    if rewind_to is not None:
        y = x[:, at:at + 3]  # other inputs than those the rows past rewind_to were made of
        out.append(stage.forward(Message(messages.ACTIVATION, [1], [rewind_to], y,
                                         rewind=True)).hidden)
        assert stage.slots.filled(1) == rewind_to + 3
    return [h[0] for h in out]


@pytest.mark.parametrize("step", [TorchPath] + [preferred(m) for m in STEPS],
                         ids=["torch"] + [m.__name__ for m in STEPS])
def test_several_positions_of_a_sample_in_one_step_equal_one_at_a_time(
        step: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    one_by_one = torch.cat(stage_steps(step, monkeypatch, [1] * 8))
    for chunks in ([4, 4], [8], [2, 3, 3]):
        together = torch.cat(stage_steps(step, monkeypatch, chunks))
        assert_close(together, one_by_one, model_path_length(CFG))


@pytest.mark.parametrize("impl", STEPS, ids=[m.__name__ for m in STEPS])
def test_several_positions_go_through_the_compiled_step(impl: ModuleType,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A verification of up to the step's rows is one call of the step, as a decode is."""
    calls: List[int] = []
    step = preferred(impl)

    def blocks(plan: Any, x: torch.Tensor, *args: Any) -> None:
        calls.append(x.shape[0])
        impl.blocks(plan, x, *args)

    step.blocks = blocks
    stage_steps(step, monkeypatch, [4, 4])
    assert calls == [5, 4, 4]  # the prompt of 5 too: as few rows as the step takes


@pytest.mark.parametrize("step", [TorchPath] + [preferred(m) for m in STEPS],
                         ids=["torch"] + [m.__name__ for m in STEPS])
def test_a_rewound_step_overwrites_the_dead_rows(step: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight positions verified, three kept: the next step from there (rewind) equals the
    same step on a cache that never held the dead rows."""
    rewound = stage_steps(step, monkeypatch, [3, 5], rewind_to=8)[-1]
    monkeypatch.setattr(transformer_module, "_step", step)
    net = model()
    stage = LocalStage(net, 2, CFG.max_seq_len)
    x = torch.randn(1, 5 + 8 + 3, CFG.dim, generator=torch.Generator().manual_seed(0))
    stage.forward(Message(messages.ACTIVATION, [1], [0], x[:, :5], prefill=True))
    stage.forward(Message(messages.ACTIVATION, [1], [5], x[:, 5:8]))
    clean = stage.forward(Message(messages.ACTIVATION, [1], [8], x[:, 13:16])).hidden[0]
    assert_close(rewound, clean, model_path_length(CFG))


def test_a_step_back_without_the_flag_is_refused() -> None:
    stage = LocalStage(model(), 1, CFG.max_seq_len)
    x = torch.randn(1, 6, CFG.dim)
    stage.forward(Message(messages.ACTIVATION, [1], [0], x, prefill=True))
    with pytest.raises(RingError, match="position 4 does not follow its KV cache"):
        stage.forward(Message(messages.ACTIVATION, [1], [4], x[:, :2]))


PROMPT = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and "
          "Juliet is the sun.")


@pytest.fixture(scope="module")
def prompt_ids() -> List[int]:
    from mdiedge.model.tokenizer import load_tokenizer

    return load_tokenizer(NANOLLAMA).encode_prompt(PROMPT)


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_speculative_greedy_decoding_equals_plain_decoding(stages: int, spec: str,
                                                           prompt_ids: List[int]) -> None:
    greedy = SamplingParams(temperature=0)
    pipeline, ends = build(NANOLLAMA, stages)
    plain = decode(pipeline, ends, prompt_ids, 200, greedy)
    drafter = NgramDrafter() if spec == "ngram" else drafter_for(
        f"draft:{DRAFT}", ends.model.cfg, 1, 512, greedy)
    speculation = Speculation(drafter, greedy, KPolicy(row_cost=0.02))
    fast = decode(pipeline, ends, prompt_ids, 200, greedy, speculation)
    assert fast.tokens == plain.tokens
    assert speculation.stats.accepted > 20 and fast.steps < plain.steps - 20
    assert max(fast.ks) > 1
    assert all(stage.slots_in_use == 0 for stage in pipeline.stages)
    assert getattr(drafter, "samples") == 0
    if isinstance(drafter, DraftModelDrafter):
        assert drafter.draft.slots.in_use == 0


def test_a_seed_gives_the_same_speculative_text_on_1_and_3_stages(prompt_ids: List[int]) -> None:
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=11)
    texts = []
    for stages in (1, 3):
        pipeline, ends = build(NANOLLAMA, stages)
        speculation = Speculation(drafter_for(f"draft:{DRAFT}", ends.model.cfg, 1, 512, params),
                                  params)
        texts.append(decode(pipeline, ends, prompt_ids, 40, params, speculation).tokens)
        assert speculation.stats.accepted > 0
    assert texts[0] == texts[1]
