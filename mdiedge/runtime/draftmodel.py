"""The ``draft:PATH`` drafter: a small model sharing the target's tokenizer, on the starter.

It is the same plain torch ``Transformer`` as any chunk, the whole model in this process with
its own KV slots (one per sample, from its own ``SlotTable``). For each sample it remembers
the tokens its KV rows hold; a proposal feeds what the sample gained since (the tokens the
target accepted after the common prefix: the KV rows past it are dead and are overwritten),
then drafts k tokens one position at a time: the argmax when sampling is greedy, else a
draw from its distribution after the sampling transforms, which the proposal carries as q
for the speculative sampling rule (``mdiedge.model.speculative``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from .drafting import Proposal
from .slots import SlotTable
from .stages import inference
from ..base.errors import ConfigError
from ..model.sampling import SamplingParams, sample_generator
from ..model.speculative import distributions

DRAFT_SEED_OFFSET = 0x5EED  # the draft's draws: another stream than the target's


class DraftModelDrafter:
    """Drafts with ``model`` (a whole ``Transformer``: embedding, blocks and head) for up to
    ``n_slots`` samples of ``context`` tokens, sampling as ``params`` say."""

    def __init__(self, model: Any, n_slots: int, context: int, params: SamplingParams) -> None:
        self.model, self.params = model, params
        self.context = min(context, model.cfg.max_seq_len)
        model.setup_cache(n_slots, self.context)
        self.slots = SlotTable(n_slots)
        self._fed: Dict[int, List[int]] = {}  # sample id -> the tokens its KV rows hold
        self._gens: Dict[int, torch.Generator] = {}

    @classmethod
    def load(cls, path: str, target_cfg: Any, n_slots: int, context: int,
             params: SamplingParams, device: str = "cpu") -> "DraftModelDrafter":
        """The draft model at ``path``; a ConfigError when its vocabulary is not the
        target's (it must share the tokenizer)."""
        from ..model.checkpoint import load_model

        model = load_model(path, device=device)
        cfg = model.cfg
        if (cfg.vocab_size, cfg.bos_id) != (target_cfg.vocab_size, target_cfg.bos_id):
            raise ConfigError(f"draft model {path!r}: vocabulary {cfg.vocab_size} (bos "
                              f"{cfg.bos_id}) is not the target's {target_cfg.vocab_size} "
                              f"(bos {target_cfg.bos_id}); a draft shares the tokenizer")
        return cls(model, n_slots, context, params)

    def propose(self, sample_id: int, tokens: Sequence[int], k: int) -> Proposal:
        k = min(k, self.context - len(tokens))
        if k <= 0 or not tokens:
            return Proposal()
        slot = self.slots.get_or_allocate(sample_id)
        fed = self._fed.get(sample_id, [])
        start = min(_common_prefix(fed, tokens), len(tokens) - 1)
        fed = self._fed[sample_id] = list(tokens)
        drafts: List[int] = []
        rows: List[torch.Tensor] = []
        with inference():
            logits = self._run(tokens[start:], slot, start)
            for i in range(k):
                token = self._choose(sample_id, logits, rows)
                drafts.append(token)
                if i + 1 < k:
                    logits = self._run([token], slot, len(fed))
                    fed.append(token)
        return Proposal(drafts, torch.stack(rows) if rows else None)

    def _run(self, tokens: Sequence[int], slot: int, position: int) -> torch.Tensor:
        """Logits (vocab,) after ``tokens`` fed into ``slot`` from ``position``."""
        device = self.model.embed.weight.device
        ids = torch.tensor([list(tokens)], device=device)
        return self.model(ids, torch.tensor([slot], device=device), [position])[0]

    def _choose(self, sample_id: int, logits: torch.Tensor, rows: List[torch.Tensor]) -> int:
        """The draft token after ``logits``: argmax (greedy), or a draw whose distribution
        is appended to ``rows``."""
        if self.params.greedy:
            return int(logits.argmax())
        q = distributions(logits[None], self.params)[0]
        rows.append(q)
        return int(torch.multinomial(q, 1, generator=self._generator(sample_id)))

    def _generator(self, sample_id: int) -> torch.Generator:
        gen = self._gens.get(sample_id)
        if gen is None:
            seed = (self.params.seed + DRAFT_SEED_OFFSET) % 2 ** 40
            gen = self._gens[sample_id] = sample_generator(seed, sample_id)
        return gen

    def release(self, sample_id: int) -> None:
        if sample_id in self.slots.assignments():
            self.slots.free(sample_id)
        self._fed.pop(sample_id, None)
        self._gens.pop(sample_id, None)

    @property
    def samples(self) -> int:
        """Samples with state here (tests: a released sample leaves nothing)."""
        return max(len(self._fed), self.slots.in_use, len(self._gens))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

