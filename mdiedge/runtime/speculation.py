"""Speculative decoding per sample: how many tokens to draft, what a step feeds, what it keeps.

A step feeds a sample's last token and k drafted tokens (``mdiedge.runtime.drafting``) as k + 1
consecutive positions of one decode message marked ``rewind`` (the KV rows written past the kept
tokens are dead, ``mdiedge.runtime.slots``); ``settle`` keeps the 1 to k + 1 tokens
``mdiedge.model.speculative`` accepts.

Adaptive k (``choose_k``): the acceptance rate a of a sample's recent verifications (geometric
model, with a prior) gives the expected tokens of a step drafting k, (1 - a^(k+1)) / (1 - a)
(Leviathan et al. 2023, 3.4); each verified row costs ``row_cost`` of a one-row step, and k
maximises tokens per cost. When no k pays, k = 0 and k = 1 is retried after ``retry_after`` plain
steps; steps where the drafter had nothing are no evidence either way."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .draftmodel import DraftModel
from .drafting import Drafter, NgramDrafter, Proposal, parse_speculate
from .plan import verify_rows
from ..base import defaults
from ..base.errors import GenerationError
from ..model.sampling import Generator, History, SamplingParams
from ..model.speculative import accept


@dataclass(frozen=True)
class KPolicy:
    """``max_k`` bounds k (k + 1 rows per sample: the scheduler lowers it to fit a frame or the
    step)."""

    max_k: int = defaults.SPECULATION_MAX_K
    row_cost: float = defaults.SPECULATION_ROW_COST
    window: int = defaults.SPECULATION_WINDOW
    retry_after: int = defaults.SPECULATION_RETRY_AFTER
    prior_accepted: float = 1.0  # pseudo-counts: an acceptance of 1/2 before any evidence
    prior_rejected: float = 1.0


def acceptance(rounds: Sequence[Tuple[int, int]], policy: KPolicy) -> float:
    """The chance a draft is accepted given those before were, over the last ``policy.window``
    rounds that drafted: accepted over accepted plus rejections (a round keeping fewer than drafted
    ended on one)."""
    drafting = [(d, a) for d, a in rounds if d > 0][-policy.window:]
    kept = policy.prior_accepted + sum(a for _, a in drafting)
    rejected = policy.prior_rejected + sum(1 for d, a in drafting if a < d)
    return kept / (kept + rejected)


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens a step emits drafting k at acceptance ``alpha`` (accepted drafts plus the model's
    token)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def choose_k(rounds: Sequence[Tuple[int, int]], policy: KPolicy = KPolicy(),
             max_k: Optional[int] = None) -> int:
    """The k of the most tokens per cost from the sample's rounds ((drafted, accepted), latest
    last), at most ``max_k``; 0 when none beats a plain step, 1 again after ``retry_after`` plain
    steps."""
    bound = policy.max_k if max_k is None else min(max_k, policy.max_k)
    if bound <= 0:
        return 0
    alpha = acceptance(rounds, policy)
    gains = [expected_tokens(alpha, k) / (1.0 + policy.row_cost * k) for k in range(bound + 1)]
    best = max(range(bound + 1), key=lambda k: (gains[k], -k))
    if best > 0:
        return best
    idle = 0
    for drafted, _ in reversed(rounds):
        if drafted:
            break
        idle += 1
    return 1 if idle >= policy.retry_after else 0


@dataclass
class Draft:
    """``tokens`` (last token, drafts, padding) fed from ``position``; the head's scores at the
    first ``drafted + 1`` decide what is kept."""

    position: int
    tokens: List[int]
    proposal: Proposal

    @property
    def drafted(self) -> int:
        return len(self.proposal.tokens)


def pad_draft(draft: Draft, width: int) -> Draft:
    """``draft`` as ``width`` positions: tokens repeated after the drafts, their KV rows dead like a
    rejected draft's."""
    pad = width - len(draft.tokens)
    if pad <= 0:
        return draft
    return Draft(draft.position, draft.tokens + [draft.tokens[-1]] * pad, draft.proposal)


@dataclass
class SpeculationStats:
    """As ``--json`` reports it; ``row_cost``: the one widths were last chosen with."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    emitted: int = 0
    k_histogram: Dict[int, int] = field(default_factory=dict)
    row_cost: float = 0.0  # a verified row's cost as the last step's width was chosen

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def as_dict(self) -> Dict[str, Any]:
        """Tokens per ring pass over the steps that drafted."""
        return {"drafted": self.drafted, "accepted": self.accepted,
                "acceptance": round(self.acceptance, 4), "verify_steps": self.steps,
                "tokens_per_pass": round(self.tokens_per_step, 3),
                "k_histogram": {str(k): n for k, n in sorted(self.k_histogram.items())},
                "row_cost": round(self.row_cost, 3)}


class Speculation:
    def __init__(self, drafter: Drafter, params: SamplingParams,
                 policy: KPolicy = KPolicy()) -> None:
        self.drafter, self.params, self.policy = drafter, params, policy
        self.rounds: Dict[int, List[Tuple[int, int]]] = {}
        self.pending: Dict[int, Draft] = {}  # drafted steps not sent yet, by sample id
        self.stats = SpeculationStats()

    def want(self, sample_id: int, max_k: Optional[int] = None,
             row_cost: Optional[float] = None) -> Tuple[float, int]:
        """The sample's acceptance and the k it would draft alone: what ``group_width`` weighs."""
        rounds = self.rounds.get(sample_id, [])
        policy = self.policy if row_cost is None else replace(self.policy, row_cost=row_cost)
        return acceptance(rounds, policy), choose_k(rounds, policy, max_k)

    def draft(self, sample_id: int, tokens: Sequence[int], budget: int,
              max_k: Optional[int] = None, k: Optional[int] = None) -> Draft:
        """``tokens``: prompt and output (the last not yet in KV); ``budget``: tokens it may still
        emit; ``max_k``: rows per frame; ``k`` overrides the sample's own choice."""
        if not tokens:
            raise GenerationError("a sample with no tokens cannot be drafted for")
        rounds = self.rounds.setdefault(sample_id, [])
        if k is None:
            k = choose_k(rounds, self.policy, max_k)
        k = min(k, budget - 1)
        proposal = self.drafter.propose(sample_id, tokens, k) if k > 0 else Proposal()
        if len(proposal.tokens) > max(k, 0):  # a drafter that proposed more than asked
            proposal = Proposal(proposal.tokens[:k],
                                None if proposal.q is None else proposal.q[:k])
        return Draft(len(tokens) - 1, [int(tokens[-1])] + proposal.tokens, proposal)

    def settle(self, sample_id: int, draft: Draft, logits: Any,
               generator: Generator, history: Optional[History] = None) -> List[int]:
        """The tokens the step emits (1 to drafted + 1) from ``logits`` (padding rows unread);
        ``history`` for penalties."""
        out = accept(draft.proposal.tokens, logits[:draft.drafted + 1], draft.proposal.q,
                     self.params, generator, history)
        drafted = draft.drafted
        self.rounds.setdefault(sample_id, []).append((drafted, len(out) - 1))
        del self.rounds[sample_id][:-max(self.policy.window, self.policy.retry_after) * 2]
        if drafted:
            stats = self.stats
            stats.drafted += drafted
            stats.accepted += len(out) - 1
            stats.steps += 1
            stats.emitted += len(out)
            stats.k_histogram[drafted] = stats.k_histogram.get(drafted, 0) + 1
        return out

    def release(self, sample_id: int) -> None:
        self.rounds.pop(sample_id, None)
        self.drafter.release(sample_id)

    def close(self, sample_ids: Sequence[int]) -> None:
        """A failed request: a shared draft model's slots are free again."""
        for sample_id in sample_ids:
            self.release(sample_id)
        self.pending.clear()


class RowCost:
    """A verified row's measured cost as a share of a one-row step: a line t = a + b rows through
    the fastest round trip per row count of the last ``window`` lone decode messages, b / (a + b)
    clamped to [0, 2]; ``prior`` until two row counts were timed ``least`` times. Quantized kernels
    pay most of a step per row; float weights little."""

    def __init__(self, prior: float = defaults.SPECULATION_ROW_COST, window: int = 8,
                 least: int = 3) -> None:
        self.prior, self.window, self.least = prior, window, least
        self.seconds: Dict[int, List[float]] = {}  # rows -> the latest round trips

    def observe(self, rows: int, seconds: float) -> None:
        if rows >= 1 and seconds > 0:
            times = self.seconds.setdefault(rows, [])
            times.append(seconds)
            del times[:-self.window]

    @property
    def value(self) -> float:
        points = [(r, min(t)) for r, t in sorted(self.seconds.items()) if len(t) >= self.least]
        if len(points) < 2:
            return self.prior
        n = len(points)
        mean_r = sum(r for r, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        slope = sum((r - mean_r) * (t - mean_t) for r, t in points) / \
            sum((r - mean_r) ** 2 for r, _ in points)
        one = mean_t + slope * (1 - mean_r)  # a + b: the fitted one-row step
        return 2.0 if one <= 0 else min(2.0, max(0.0, slope / one))


def group_width(wants: Sequence[Tuple[float, int]], rows: int, room: int,
                row_cost: float) -> int:
    """The positions T each row of a group's step feeds (1: plain): the most expected tokens per
    cost, a sample counting E(a, min(T - 1, k)) tokens and n x T rows costing 1 + ``row_cost`` (n T
    - 1). At most ``rows`` rows in all, ``defaults.SPECULATION_MAX_K`` + 1 a sample and ``room``
    positions; 2 when none pays but a sample is due a retry."""
    n = len(wants)
    cap = min(rows // n, defaults.SPECULATION_MAX_K + 1, room) if n else 0
    if cap <= 1:
        return 1
    gains = [sum(expected_tokens(a, min(t - 1, k)) for a, k in wants) /
             (1.0 + row_cost * (n * t - 1)) for t in range(1, cap + 1)]
    best = max(range(cap), key=lambda i: (gains[i], -i)) + 1
    return 2 if best == 1 and any(k > 0 for _, k in wants) else best


def plan_step(group: Any, context: int, frame_rows: int = 0,
              row_cost: Optional[float] = None) -> int:
    """Draft the next step of ``group``'s live samples: width (``group_width``), then each sample's
    drafts padded to the longest, kept in ``pending`` until sent. Samples are named by index and
    ``row_cost`` applies to greedy requests only, so a seed gives the same text on every pipeline.
    """
    generation = group.generation
    speculation = generation.speculation
    live = [s for s in group.samples if not s.done]
    if speculation is None or not live:
        return 1
    rows = verify_rows(frame_rows)
    texts = [s.prompt + s.tokens for s in live]
    budgets = [min(generation.max_new_tokens - len(s.tokens), context - len(t))
               for s, t in zip(live, texts)]
    measured = row_cost is not None and speculation.params.greedy  # a seed's k: fixed
    cost = speculation.stats.row_cost = row_cost if measured else speculation.policy.row_cost
    wants = [speculation.want(s.index, b - 1, cost) for s, b in zip(live, budgets)]
    room = min(context - len(t) + 1 for t in texts)
    width = group_width(wants, rows, room, cost)
    drafts = {s.sid: speculation.draft(s.index, t, b, k=width - 1)
              for s, t, b in zip(live, texts, budgets)}
    width = 1 + max(d.drafted for d in drafts.values())
    speculation.pending.update((sid, pad_draft(d, width)) for sid, d in drafts.items())
    return width


def step_rows(parts: Sequence[Tuple[Any, Sequence[Any]]]
              ) -> Tuple[List[Any], List[List[int]], Dict[int, Draft]]:
    """A decode message's rows, each row's tokens, and the drafted steps sent now (by sample id,
    from ``pending``)."""
    rows: List[Any] = []
    drafts: Dict[int, Draft] = {}
    tokens: List[List[int]] = []
    for group, samples in parts:
        pending = getattr(group.generation.speculation, "pending", {})
        rows += samples
        for sample in samples:
            draft = pending.pop(sample.sid, None)
            if draft is not None:
                drafts[sample.sid] = draft
            tokens.append(draft.tokens if draft is not None else [sample.tokens[-1]])
    return rows, tokens, drafts


def drafter_for(choice: str, target_cfg: Any, n_slots: int, context: int,
                params: Any, device: str = "cpu", draft: Optional[DraftModel] = None) -> Drafter:
    """``draft``: the engine's shared draft model for ``draft:PATH`` (None: one loaded for this
    drafter)."""
    kind, arg = parse_speculate(choice)
    if kind == "ngram":
        return NgramDrafter(max_n=int(arg) if arg else 3)
    if draft is None:
        draft = DraftModel.load(arg, target_cfg, n_slots, context, device)
    return draft.drafter(params)
