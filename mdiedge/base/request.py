"""A request as the engine takes it in, once: its ``Prompt`` (tokenized once), ``SamplingParams``,
budget, samples and stop strings, every limit checked by ``take_request`` and trusted by every later
layer. No torch: the CLI checks a request before torch loads. ``GenerationError.field`` names the
value at fault (front ends name their own option or field)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from . import defaults
from .defaults import MAX_STOP_CHARS, MAX_STOPS
from .errors import ContextExceeded, GenerationError


@dataclass(frozen=True)
class Prompt:
    """Text and ids, tokenized once; every later step takes the ids from here."""

    text: str
    ids: Tuple[int, ...]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = defaults.TEMPERATURE  # 0: greedy
    top_k: int = defaults.TOP_K  # 0: no top-k filter
    top_p: float = defaults.TOP_P  # 1: no nucleus filter
    seed: int = defaults.SEED
    min_p: float = 0.0  # 0: no min-p filter
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    logit_bias: Tuple[Tuple[int, float], ...] = ()  # (token id, bias); a dict is taken too
    top_logprobs: Optional[int] = None  # None: no logprobs; N: the chosen token's and N more

    def __post_init__(self) -> None:
        for name, span in (("temperature", defaults.TEMPERATURE_RANGE),
                           ("top_k", defaults.TOP_K_RANGE), ("top_p", defaults.TOP_P_RANGE),
                           ("seed", defaults.SEED_RANGE), ("min_p", defaults.MIN_P_RANGE),
                           ("presence_penalty", defaults.PENALTY_RANGE),
                           ("frequency_penalty", defaults.PENALTY_RANGE),
                           ("repetition_penalty", defaults.REPETITION_PENALTY_RANGE),
                           ("top_logprobs", defaults.TOP_LOGPROBS_RANGE)):
            value = getattr(self, name)
            if value not in span and not (name == "top_logprobs" and value is None):
                raise GenerationError(f"{name}: expected {span.expected}, got {value!r}",
                                      name)
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < defaults.GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """A bias or a penalty changes the logits."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or \
            self.frequency_penalty != 0 or self.repetition_penalty != 1


def check_logit_bias(bias: Any) -> Tuple[Tuple[int, float], ...]:
    """Sorted (token id, bias) pairs, or a one-line error naming the first bad entry."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    if len(pairs) > defaults.MAX_LOGIT_BIAS:
        raise GenerationError(f"logit_bias: at most {defaults.MAX_LOGIT_BIAS} tokens, got "
                              f"{len(pairs)}", "logit_bias")
    out = {}
    for token, value in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise GenerationError(f"logit_bias: expected token ids >= 0, got {token!r}",
                                  "logit_bias")
        if value not in defaults.LOGIT_BIAS_RANGE:
            raise GenerationError(f"logit_bias[{token}]: expected "
                                  f"{defaults.LOGIT_BIAS_RANGE.expected}, got {value!r}",
                                  "logit_bias")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def check_stops(stops: Sequence[str]) -> List[str]:
    """A one-line error naming the first unusable stop (empty, too long, not a string) or too many.
    """
    if isinstance(stops, str):
        stops = [stops]
    stops = list(stops)
    if len(stops) > MAX_STOPS:
        raise GenerationError(f"stop: at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    for stop in stops:
        if not isinstance(stop, str) or not stop:
            raise GenerationError(f"stop: expected non-empty strings, got {stop!r}", "stop")
        if len(stop) > MAX_STOP_CHARS:
            raise GenerationError(f"stop: a string of at most {MAX_STOP_CHARS} characters, got "
                                  f"{len(stop)}: {stop[:20]!r}...", "stop")
    return stops


def check_context(prompt_len: int, max_new_tokens: Optional[int], context: int,
                  default: int = 0, where: str = "") -> int:
    """The one check of a budget: ``max_new_tokens`` (None: ``default``, cut to what the context
    leaves) must fit ``context`` with the prompt (``where`` names it). The budget, or
    ``ContextExceeded``."""
    if prompt_len == 0:
        raise GenerationError("empty prompt: the model needs at least one token (a BOS id or "
                              "text)", "prompt")
    where = where or f"the context of {context} tokens"
    if max_new_tokens is None:
        if prompt_len >= context:
            raise ContextExceeded(f"prompt of {prompt_len} tokens leaves no room for a new one "
                                  f"in {where}", "prompt")
        return min(default, context - prompt_len)
    if prompt_len + max_new_tokens > context:
        raise ContextExceeded(f"prompt of {prompt_len} tokens plus {max_new_tokens} new tokens "
                              f"exceeds {where}", "max_new_tokens")
    return max_new_tokens


@dataclass(frozen=True)
class Asked:
    """A request's budget, samples, sampling and stop strings, checked when made, with no model;
    ``take_request`` adds the prompt and the context check."""

    max_new_tokens: Optional[int] = None
    n_samples: int = 1
    params: SamplingParams = SamplingParams()
    stop: Sequence[str] = ()  # a string or strings; kept as a tuple

    def __post_init__(self) -> None:
        budget, span = self.max_new_tokens, defaults.MAX_NEW_TOKENS_RANGE
        if budget is not None and budget not in span:
            raise GenerationError(f"max_new_tokens: expected {span.expected}, got {budget!r}",
                                  "max_new_tokens")
        if isinstance(self.n_samples, bool) or not isinstance(self.n_samples, int) or \
                not 1 <= self.n_samples <= defaults.MAX_SAMPLES:
            raise GenerationError(f"n_samples: expected an integer 1..{defaults.MAX_SAMPLES}, "
                                  f"got {self.n_samples!r}", "n_samples")
        object.__setattr__(self, "stop", tuple(check_stops(self.stop)))


@dataclass(frozen=True)
class Request:
    """What every later layer runs without checking again."""

    prompt: Prompt
    max_new_tokens: int  # the budget, fitting the context with the prompt
    n_samples: int
    params: SamplingParams
    stop: Tuple[str, ...] = ()

    @property
    def context(self) -> int:
        return len(self.prompt.ids) + self.max_new_tokens


def named(error: GenerationError, names: Mapping[str, str],
          notes: Optional[Mapping[str, str]] = None) -> Tuple[str, str]:
    """``error``'s field as a front end names it (``names``: request field -> option), with its
    ``notes`` on the value before what it got."""
    field = error.field or ""
    name, message = names.get(field, field), str(error)
    if field and message.startswith(field):
        note = (notes or {}).get(field, "")
        message = name + message[len(field):].replace(", got ", note + ", got ", 1)
    return name, message


def take_request(prompt: Prompt, asked: Asked, context: int, default_budget: int = 0,
                 server_stops: Sequence[str] = ()) -> Request:
    """Budget fitted to ``context`` (None: ``default_budget``, cut to what is left);
    ``server_stops`` (a chat template's) after the asked."""
    budget = check_context(len(prompt.ids), asked.max_new_tokens, context, default_budget)
    stops = asked.stop + tuple(s for s in server_stops if s not in asked.stop)
    return Request(prompt, budget, asked.n_samples, asked.params, stops)


def ids_request(ids: Sequence[int], max_new_tokens: int, n_samples: int = 1,
                params: SamplingParams = SamplingParams(), context: int = 0) -> Request:
    """Token ids alone (no text, no stops), for tools and tests; ``context`` 0: prompt plus budget.
    """
    return take_request(Prompt("", tuple(ids)), Asked(max_new_tokens, n_samples, params),
                        context or len(ids) + max_new_tokens)
