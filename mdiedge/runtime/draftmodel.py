"""The ``draft:PATH`` drafter: a small model sharing the target's tokenizer, on the starter.

It is a model chunk like any other (the torch ``Transformer``, or a chunk that ``takes_numpy``), the
whole model in this process with its own KV slots (``DraftModel``: loaded once per engine, its slots
shared by the engine's requests, one per sample, from its own ``SlotTable``). A request's
``DraftModelDrafter`` holds its samples' slots there and frees each when the sample ends. For each
sample it remembers the tokens its KV rows hold; a proposal feeds what the sample gained since (the
tokens the target accepted after the common prefix: the KV rows past it are dead and are
overwritten), then drafts k tokens one position at a time: the argmax when sampling is greedy, else
a draw from its distribution after the sampling transforms, which the proposal carries as q for the
speculative sampling rule (``mdiedge.model.speculative``)."""
from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .drafting import Proposal
from .slots import MAX_SAMPLE_ID, SlotTable
from .stages import inference
from ..base.arrays import float32
from ..base.errors import ConfigError
from ..model.sampling import Generator, SamplingParams, draw, sample_generator
from ..model.speculative import distributions

DRAFT_SEED_OFFSET = 0x5EED  # the draft's draws: another stream than the target's


class DraftModel:
    """A draft model (a whole ``Transformer``: embedding, blocks and head) and its KV slots,
    shared by the requests of an engine: each request's ``DraftModelDrafter`` holds slots of
    its own here (under keys unique to this object), so requests never see each other's KV
    rows. Every method runs on the engine's compute thread (loading, ``fit``, and the
    drafters' proposals in the scheduler's loop), so none takes a lock."""

    def __init__(self, model: Any, n_slots: int = 0, context: int = 0) -> None:
        self.model = model
        self.n_slots, self.context = 0, 0
        self.slots = SlotTable(1)
        self._keys = itertools.count()
        if n_slots > 0 and context > 0:
            self.fit(n_slots, context)

    @classmethod
    def load(cls, path: str, target_cfg: Any, n_slots: int = 0, context: int = 0,
             device: str = "cpu") -> "DraftModel":
        """The draft model at ``path``; a ConfigError when its vocabulary is not the
        target's (it must share the tokenizer)."""
        from ..model.chunks import open_chunk

        model = open_chunk(path, None, True, True, device=device)
        cfg = model.cfg
        if (cfg.vocab_size, cfg.bos_id) != (target_cfg.vocab_size, target_cfg.bos_id):
            raise ConfigError(f"draft model {path!r}: vocabulary {cfg.vocab_size} (bos "
                              f"{cfg.bos_id}) is not the target's {target_cfg.vocab_size} "
                              f"(bos {target_cfg.bos_id}); a draft shares the tokenizer")
        return cls(model, n_slots, context)

    def holds(self, n_slots: int, context: int) -> bool:
        """Whether its KV slots hold ``n_slots`` samples of ``context`` tokens (a context
        beyond the model's own counts as its own)."""
        return self.n_slots >= n_slots and self.context >= min(context,
                                                               self.model.cfg.max_seq_len)

    def fit(self, n_slots: int, context: int) -> None:
        """Set its KV slots up anew for at least ``n_slots`` x ``context`` when they hold
        less and no drafter holds a slot (else they stay: a sample finding no free slot is
        drafted nothing)."""
        if self.holds(n_slots, context) or self.slots.in_use:
            return
        self.n_slots = max(self.n_slots, n_slots)
        self.context = min(max(self.context, context), self.model.cfg.max_seq_len)
        self.model.setup_cache(self.n_slots, self.context)
        self.slots = SlotTable(self.n_slots)

    def key(self) -> int:
        """A slot key no other sample of any drafter of this model holds."""
        while True:
            key = next(self._keys) % (MAX_SAMPLE_ID + 1)
            if key not in self.slots.assignments():
                return key

    def drafter(self, params: SamplingParams) -> "DraftModelDrafter":
        """A request's drafter on this model, sampling as ``params`` say."""
        return DraftModelDrafter(self, params)


class DraftModelDrafter:
    """Drafts with the shared ``draft`` model for the samples of one request (known by
    their index in it), sampling as ``params`` say; ``release`` frees a sample's slot."""

    def __init__(self, draft: DraftModel, params: SamplingParams) -> None:
        self.draft, self.params = draft, params
        self._keys: Dict[int, int] = {}  # sample id -> its slot's key in the shared table
        self._fed: Dict[int, List[int]] = {}  # sample id -> the tokens its KV rows hold
        self._gens: Dict[int, Generator] = {}

    @property
    def model(self) -> Any:
        return self.draft.model

    @property
    def context(self) -> int:
        return self.draft.context

    def _slot(self, sample_id: int) -> Optional[int]:
        """The sample's slot of the shared table, allocated at its first proposal; None
        when every slot is held."""
        key = self._keys.get(sample_id)
        if key is not None:
            return self.draft.slots.slot_of(key)
        table = self.draft.slots
        if table.in_use >= self.draft.n_slots:
            return None
        key = self._keys[sample_id] = self.draft.key()
        return table.allocate(key)

    def propose(self, sample_id: int, tokens: Sequence[int], k: int) -> Proposal:
        # Runs in the scheduler's loop on the engine's compute thread, as do ``release`` and
        # the shared model's ``fit``: the shared slot table and KV rows need no lock.
        k = min(k, self.context - len(tokens))
        if k <= 0 or not tokens:
            return Proposal()
        slot = self._slot(sample_id)
        if slot is None:
            return Proposal()
        fed = self._fed.get(sample_id, [])
        start = min(_common_prefix(fed, tokens), len(tokens) - 1)
        fed = self._fed[sample_id] = list(tokens)
        drafts: List[int] = []
        rows: List[np.ndarray] = []
        with inference():
            logits = self._run(tokens[start:], slot, start)
            for i in range(k):
                token = self._choose(sample_id, logits, rows)
                drafts.append(token)
                if i + 1 < k:
                    logits = self._run([token], slot, len(fed))
                    fed.append(token)
        return Proposal(drafts, np.stack(rows) if rows else None)

    def _run(self, tokens: Sequence[int], slot: int, position: int) -> np.ndarray:
        """Logits (vocab,) after ``tokens`` fed into ``slot`` from ``position``."""
        return last_logits(self.model, tokens, slot, position)

    def _choose(self, sample_id: int, logits: np.ndarray, rows: List[np.ndarray]) -> int:
        """The draft token after ``logits``: argmax (greedy), or a draw whose distribution
        is appended to ``rows``."""
        if self.params.greedy:
            return int(logits.argmax())
        q = distributions(logits[None], self.params)[0]
        rows.append(q)
        return draw(q, self._generator(sample_id))

    def _generator(self, sample_id: int) -> Generator:
        gen = self._gens.get(sample_id)
        if gen is None:
            seed = (self.params.seed + DRAFT_SEED_OFFSET) % 2 ** 40
            gen = self._gens[sample_id] = sample_generator(seed, sample_id)
        return gen

    def release(self, sample_id: int) -> None:
        key = self._keys.pop(sample_id, None)
        if key is not None:
            self.draft.slots.free(key)
        self._fed.pop(sample_id, None)
        self._gens.pop(sample_id, None)

    def close(self) -> None:
        """Release every sample it holds (its request ended, or failed)."""
        for sample_id in set(self._keys) | set(self._fed) | set(self._gens):
            self.release(sample_id)

    @property
    def samples(self) -> int:
        """Samples with state here (tests: a released sample leaves nothing)."""
        return max(len(self._fed), len(self._keys), len(self._gens))


def last_logits(model: Any, tokens: Sequence[int], slot: int, position: int) -> np.ndarray:
    """float32 logits (vocab,) of a whole model chunk after ``tokens`` fed into KV ``slot``
    from ``position``: numpy throughout for a chunk that ``takes_numpy``, else the torch
    ``Transformer`` on its device."""
    if getattr(model, "takes_numpy", False):
        x = model.run_blocks(model.embed_tokens(np.array([list(tokens)], dtype=np.int64)),
                             np.array([slot], dtype=np.int64), [position])
        return model.head_logits(x[:, -1:])[0, -1]
    import torch

    device = model.embed.weight.device
    ids = torch.tensor([list(tokens)], device=device)
    return float32(model(ids, torch.tensor([slot], device=device), [position])[0])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

