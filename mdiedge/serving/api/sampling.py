"""The sampling fields of a request beyond OpenAI's basic ones, read and checked: the
penalties (``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` or llama.cpp's
``repeat_penalty``), ``logit_bias``, ``min_p``, and the log-probabilities asked for (chat:
``logprobs`` true and ``top_logprobs``; completions: ``logprobs`` N). Their meaning is
``mdiedge.model.sampling``'s; a bad value is a 400 naming the field and quoting the value."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ...base import defaults
from ...base.errors import ApiError
from ...base.values import Span

_Check = Tuple[Callable[[Any], bool], str]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


NUMBER: _Check = (_is_number, "a number")
SAMPLING_FIELDS: Dict[str, _Check] = {
    "presence_penalty": NUMBER, "frequency_penalty": NUMBER, "repetition_penalty": NUMBER,
    "repeat_penalty": NUMBER, "min_p": NUMBER,
    "logit_bias": (lambda v: isinstance(v, dict), "an object of token ids to numbers"),
}
CHAT_LOGPROBS: Dict[str, _Check] = {
    "logprobs": (lambda v: isinstance(v, bool), "a boolean"),
    "top_logprobs": (_is_int, "an integer"),
}
COMPLETION_LOGPROBS: Dict[str, _Check] = {"logprobs": (_is_int, "an integer")}
RANGES: Dict[str, Span] = {
    "presence_penalty": defaults.PENALTY_RANGE, "frequency_penalty": defaults.PENALTY_RANGE,
    "repetition_penalty": defaults.REPETITION_PENALTY_RANGE,
    "repeat_penalty": defaults.REPETITION_PENALTY_RANGE, "min_p": defaults.MIN_P_RANGE,
    "top_logprobs": defaults.TOP_LOGPROBS_RANGE, "logprobs": defaults.TOP_LOGPROBS_RANGE,
}


@dataclass
class SamplingOptions:
    """A request's extra sampling, as ``SamplingParams`` takes it (``params()``)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Dict[int, float] = field(default_factory=dict)
    top_logprobs: Optional[int] = None  # None: no logprobs

    def params(self) -> Dict[str, Any]:
        return {"presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "min_p": self.min_p,
                "logit_bias": self.logit_bias, "top_logprobs": self.top_logprobs}

    def check_vocab(self, vocab: int) -> None:
        """A 400 for a biased token the model does not have."""
        for token in self.logit_bias:
            if token >= vocab:
                raise ApiError(400, f"logit_bias: token id {token} is not in the model's "
                               f"vocabulary of {vocab}", "logit_bias", "invalid_value")


def read_sampling(body: Mapping[str, Any], chat: bool) -> SamplingOptions:
    """The fields of ``body`` (already type-checked) in range, or a 400."""
    for name, span in RANGES.items():
        value = body.get(name)
        if value is not None and not (isinstance(value, bool) and name == "logprobs") \
                and value not in span:
            raise ApiError(400, f"{name}: expected {span.expected}, got {value!r}", name,
                           "invalid_value")
    repetition = body.get("repetition_penalty")
    if repetition is None:
        repetition = body.get("repeat_penalty")
    out = SamplingOptions(float(body.get("presence_penalty") or 0.0),
                          float(body.get("frequency_penalty") or 0.0),
                          1.0 if repetition is None else float(repetition),
                          float(body.get("min_p") or 0.0),
                          _logit_bias(body.get("logit_bias") or {}))
    out.top_logprobs = _chat_logprobs(body) if chat else body.get("logprobs")
    return out


def _chat_logprobs(body: Mapping[str, Any]) -> Optional[int]:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs``: the alternatives per token, or
    None for no logprobs; a 400 for ``top_logprobs`` without ``logprobs``."""
    top = body.get("top_logprobs")
    if not body.get("logprobs"):
        if top:
            raise ApiError(400, f"top_logprobs: needs logprobs true, got {top!r}",
                           "top_logprobs", "invalid_value")
        return None
    return top or 0


def _logit_bias(bias: Mapping[str, Any]) -> Dict[int, float]:
    """OpenAI's ``logit_bias`` (token id strings to biases) as ids to floats."""
    if len(bias) > defaults.MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias: at most {defaults.MAX_LOGIT_BIAS} tokens, got "
                       f"{len(bias)}", "logit_bias", "invalid_value")
    out = {}
    for key, value in bias.items():
        token = key.strip() if isinstance(key, str) else ""
        if not (token.isascii() and token.isdigit()) or len(token) > 12:
            raise ApiError(400, f"logit_bias: expected token ids as keys, got {key[:40]!r}",
                           "logit_bias", "invalid_value")
        if not _is_number(value) or value not in defaults.LOGIT_BIAS_RANGE:
            raise ApiError(400, f"logit_bias[{token}]: expected "
                           f"{defaults.LOGIT_BIAS_RANGE.expected}, got {value!r}",
                           "logit_bias", "invalid_value")
        out[int(token)] = float(value)
    return out
