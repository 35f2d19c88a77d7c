"""The ``draft:PATH`` drafter: a small model sharing the target's tokenizer, on the starter.

A ``DraftModel`` is loaded once per engine with its own KV slots, one per sample, shared by the
engine's requests. A request's ``DraftModelDrafter`` remembers the tokens each sample's KV rows
hold; a proposal feeds what the sample gained since (rows past the common prefix are dead and
overwritten), then drafts k tokens one position at a time: the argmax when greedy, else a draw after
the sampling transforms, carried as q for the speculative sampling rule (``model.speculative``)."""
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
    """Requests hold slots under keys unique to this object, so they never see each other's KV rows.
    Every method runs on the engine's compute thread, so none takes a lock."""

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
        """ConfigError when its vocabulary is not the target's (it must share the tokenizer)."""
        from ..model.chunks import open_chunk

        model = open_chunk(path, None, True, True, device=device)
        cfg = model.cfg
        if (cfg.vocab_size, cfg.bos_id) != (target_cfg.vocab_size, target_cfg.bos_id):
            raise ConfigError(f"draft model {path!r}: vocabulary {cfg.vocab_size} (bos "
                              f"{cfg.bos_id}) is not the target's {target_cfg.vocab_size} "
                              f"(bos {target_cfg.bos_id}); a draft shares the tokenizer")
        return cls(model, n_slots, context)

    def holds(self, n_slots: int, context: int) -> bool:
        """A context beyond the model's own counts as its own."""
        return self.n_slots >= n_slots and self.context >= min(context,
                                                               self.model.cfg.max_seq_len)

    def fit(self, n_slots: int, context: int) -> None:
        """Set the slots up anew for ``n_slots`` x ``context`` when they hold less and no drafter
        holds one (else a sample finding no free slot is drafted nothing)."""
        if self.holds(n_slots, context) or self.slots.in_use:
            return
        self.n_slots = max(self.n_slots, n_slots)
        self.context = min(max(self.context, context), self.model.cfg.max_seq_len)
        self.model.setup_cache(self.n_slots, self.context)
        self.slots = SlotTable(self.n_slots)

    def key(self) -> int:
        """A slot key no sample of any drafter of this model holds."""
        while True:
            key = next(self._keys) % (MAX_SAMPLE_ID + 1)
            if key not in self.slots.assignments():
                return key

    def drafter(self, params: SamplingParams) -> "DraftModelDrafter":
        return DraftModelDrafter(self, params)


class DraftModelDrafter:
    """Samples known by their index in the request; ``release`` frees a sample's slot."""

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
        """Allocated at the first proposal; None when every slot is held."""
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
        return last_logits(self.model, tokens, slot, position)

    def _choose(self, sample_id: int, logits: np.ndarray, rows: List[np.ndarray]) -> int:
        """Argmax (greedy), or a draw whose distribution is appended to ``rows``."""
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
        for sample_id in set(self._keys) | set(self._fed) | set(self._gens):
            self.release(sample_id)

    @property
    def samples(self) -> int:
        """Samples with state here (tests: a released sample leaves nothing)."""
        return max(len(self._fed), len(self._keys), len(self._gens))


def last_logits(model: Any, tokens: Sequence[int], slot: int, position: int) -> np.ndarray:
    """float32 logits after ``tokens`` fed into ``slot`` from ``position``: numpy throughout for a
    numpy chunk, else torch on its device."""
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

