"""The runtime around a numpy model chunk: stages, pipeline, scheduler, sampling and speculation
run on numpy arrays and never import torch (a subprocess with torch blocked runs them over the
``numpychunk`` test double: greedy tokens equal the double's reference for 1 stage and for 2,
any prefill chunking and grouping; a seed gives the same sampled tokens on 1 stage and on 2);
and the torch chunk takes what the wire delivers (numpy, bfloat16 as uint16 words), its head
giving numpy float32 logits."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from numpychunk import CFG, LAYERS, ShiftChunk, greedy_reference, reference

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

SCRIPT = r"""
import json, sys
sys.modules["torch"] = None  # any import of torch fails
sys.path.insert(0, sys.argv[1])
from numpychunk import ShiftChunk, CFG, LAYERS
from mdiedge.base.request import ids_request
from mdiedge.model.sampling import SamplingParams
from mdiedge.runtime.drafting import NgramDrafter
from mdiedge.runtime.generation import Generation
from mdiedge.runtime.pipeline import EmbedAndHead, Pipeline
from mdiedge.runtime.scheduler import Scheduler
from mdiedge.runtime.speculation import KPolicy, Speculation
from mdiedge.runtime.stages import LocalStage

def run(stages, params, n_samples=1, chunk=0, micro_batch=0, speculate=False):
    cuts = [0, LAYERS] if stages == 1 else [0, 1, LAYERS]
    chunks = [ShiftChunk(a, b, embedding=i == 0, head=i == 0)
              for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    pipeline = Pipeline([LocalStage(c, 4, CFG.max_seq_len, trim_prefill=i == len(chunks) - 1)
                         for i, c in enumerate(chunks)])
    generation = Generation(ids_request([3, 1, 4, 1, 5], 12, n_samples, params), ())
    if speculate:
        generation.speculation = Speculation(NgramDrafter(), params, KPolicy(max_k=3, row_cost=0.0))
    Scheduler(pipeline, EmbedAndHead(chunks[0]), chunk).run(generation, micro_batch)
    widths = max(call["width"] for c in chunks for call in c.calls if call["start"] >= 5)
    return [s.tokens for s in generation.samples], widths

greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=1.0, seed=7)
out = {"greedy": [run(s, greedy, 3, chunk)[0] for s in (1, 2) for chunk in (0, 2)],
       "sampled": [run(s, sampled, 3, 0, mb)[0] for s in (1, 2) for mb in (0, 1)],
       "sampled_alone": run(1, sampled, 1)[0],
       "speculated": run(2, greedy, 2, speculate=True),
       "speculated_sampled": run(2, sampled, 3, speculate=True)[0],
       "torch": "torch" in sys.modules and sys.modules["torch"] is not None}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def torch_free() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(HERE)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=str(REPO))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_greedy_tokens_are_the_reference_on_1_and_2_stages_without_torch(torch_free: dict) -> None:
    want = greedy_reference([3, 1, 4, 1, 5], 12)
    assert len(set(want)) > 3  # not a constant text: the KV cache matters
    for run in torch_free["greedy"]:
        assert run == [want] * 3
    assert not torch_free["torch"]


def test_a_seed_gives_the_same_sampled_tokens_on_any_pipeline(torch_free: dict) -> None:
    runs = torch_free["sampled"]
    assert all(run == runs[0] for run in runs)  # 1 node == ring, any grouping
    assert runs[0][0] == torch_free["sampled_alone"][0]  # sample 0 alone draws the same
    assert len({tuple(t) for t in runs[0]}) == 3  # each sample its own stream
    assert runs[0][0] != greedy_reference([3, 1, 4, 1, 5], 12)


def test_speculation_on_numpy_keeps_the_greedy_text(torch_free: dict) -> None:
    tokens, widest = torch_free["speculated"]
    assert tokens == [greedy_reference([3, 1, 4, 1, 5], 12)] * 2
    assert widest > 1  # drafts were verified (decode steps of several positions per row)
    assert len(torch_free["speculated_sampled"]) == 3


# ------------------------------------------------------- in process: what a stage is handed


def test_a_numpy_stage_takes_torch_tensors_and_bfloat16_words() -> None:
    import torch

    from mdiedge.runtime import messages
    from mdiedge.runtime.messages import Message
    from mdiedge.runtime.stages import LocalStage

    chunk = ShiftChunk()
    stage = LocalStage(chunk, 2, CFG.max_seq_len)
    x = np.eye(CFG.dim, dtype=np.float32)[[[2, 7]]]  # (1, 2, dim)
    words = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    out = [stage.forward(Message(messages.ACTIVATION, [i], [0], hidden, prefill=True)).hidden
           for i, hidden in enumerate([torch.from_numpy(x), words])]
    assert all(isinstance(y, np.ndarray) and y.dtype == np.float32 for y in out)
    assert np.array_equal(out[0], out[1])
    assert out[0].argmax(-1).tolist() == [[reference([2]), reference([2, 7])]]


@pytest.fixture(scope="module")
def tiny() -> object:
    import torch

    from mdiedge.model.config import ModelConfig
    from mdiedge.model.transformer import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                      intermediate_size=24, max_seq_len=16)
    return Transformer(cfg).eval()


def test_a_torch_stage_takes_numpy_as_it_took_tensors(tiny: object) -> None:
    import torch

    from mdiedge.runtime import messages
    from mdiedge.runtime.messages import Message
    from mdiedge.runtime.pipeline import EmbedAndHead
    from mdiedge.runtime.stages import LocalStage

    ends = EmbedAndHead(tiny)
    hidden = ends.embed([[1, 2, 3]])
    outs = []
    for given in (hidden, hidden.numpy().copy(), hidden.to(torch.bfloat16)):
        stage = LocalStage(tiny, 1, 16)
        if given.dtype == torch.bfloat16:  # as the wire delivers it: uint16 words
            given = given.view(torch.int16).numpy().view(np.uint16)
        outs.append(stage.forward(Message(messages.ACTIVATION, [0], [0], given,
                                          prefill=True)).hidden)
    assert torch.equal(outs[0], outs[1])
    assert torch.allclose(outs[0], outs[2], atol=0.1)  # rounded to bfloat16 on the way
    logits = ends.head(outs[1][:, -1])
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32
    with torch.inference_mode():
        assert np.array_equal(logits, tiny.head_logits(outs[1][:, -1]).numpy())
    assert np.array_equal(ends.head(outs[1][:, -1].numpy()), logits)  # from the wire


def test_the_runtime_modules_import_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import mdiedge.runtime.scheduler, mdiedge.runtime.stages, mdiedge.runtime.pipeline, "
            "mdiedge.runtime.links, mdiedge.runtime.ring, mdiedge.runtime.speculation, "
            "mdiedge.runtime.draftmodel, mdiedge.runtime.generation, mdiedge.runtime.messages, "
            "mdiedge.runtime.framing, mdiedge.model.grammar, mdiedge.model.speculative")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_double_is_the_reference() -> None:
    """The double's cached blocks, fed a text one token at a time, give its reference."""
    chunk = ShiftChunk()
    chunk.setup_cache(1, 32)
    text = [3, 1, 4, 1, 5]
    logits = chunk.head_logits(chunk.run_blocks(chunk.embed_tokens(np.array([text])),
                                                np.array([0]), [0]))
    for _ in range(6):
        text.append(int(logits[0, -1].argmax()))
        logits = chunk.head_logits(chunk.run_blocks(
            chunk.embed_tokens(np.array([[text[-1]]])), np.array([0]), [len(text) - 1]))
    assert text[5:] == greedy_reference([3, 1, 4, 1, 5], 6) and LAYERS == 4


def test_a_numpy_draft_model_proposes_its_greedy_continuation() -> None:
    from mdiedge.model.sampling import SamplingParams
    from mdiedge.runtime.draftmodel import DraftModel

    draft = DraftModel(ShiftChunk(), 2, CFG.max_seq_len)
    drafter = draft.drafter(SamplingParams(temperature=0))
    text = [3, 1, 4, 1, 5]
    first = drafter.propose(0, text, 4)
    assert first.q is None and first.tokens == greedy_reference(text, 4)
    text = text + first.tokens[:2] + [(first.tokens[2] + 1) % CFG.vocab_size]
    assert drafter.propose(0, text, 3).tokens == greedy_reference(text, 3)  # rows redone
    sampled = draft.drafter(SamplingParams(temperature=1.0, top_p=1.0, seed=2))
    proposal = sampled.propose(1, text, 3)
    assert proposal.q is not None and proposal.q.shape == (3, CFG.vocab_size)
    assert np.allclose(proposal.q.sum(-1), 1.0)
    assert all(proposal.q[i, t] > 0 for i, t in enumerate(proposal.tokens))
