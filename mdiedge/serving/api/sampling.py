"""A request's sampling as a body gives it, read once into ``Asked`` (``asked_from``): the budget,
``n``, ``stop``, temperature, top-k, top-p, seed, and the fields beyond OpenAI's basic ones: the
penalties (``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` or llama.cpp's
``repeat_penalty``), ``logit_bias``, ``min_p``, and the log-probabilities asked for (chat:
``logprobs`` true and ``top_logprobs``; completions: ``logprobs`` N). Their meaning and ranges are
``mdiedge.base.request``'s; a bad value is a 400 naming the body's field and quoting the value."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ...base import defaults
from ...base.errors import ApiError, GenerationError
from ...base.request import Asked, SamplingParams, named

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
def asked_from(body: Mapping[str, Any], chat: bool, max_tokens_key: str) -> Asked:
    """The request ``body`` asks for (type-checked already), its values checked once by
    ``Asked`` and ``SamplingParams``: a 400 naming the body's field for one out of range."""
    stop = body.get("stop")
    try:
        params = SamplingParams(
            _number(body, "temperature", defaults.TEMPERATURE),
            defaults.TOP_K if body.get("top_k") is None else body["top_k"],
            _number(body, "top_p", defaults.TOP_P),
            defaults.random_seed() if body.get("seed") is None else body["seed"],
            **read_sampling(body, chat))
        return Asked(body.get(max_tokens_key), 1 if body.get("n") is None else body["n"],
                     params, (stop,) if isinstance(stop, str) else tuple(stop or ()))
    except GenerationError as e:
        field, message = named(e, _field_names(body, chat, max_tokens_key))
        raise ApiError(400, message, field, "invalid_value") from None


def _field_names(body: Mapping[str, Any], chat: bool, max_tokens_key: str) -> Dict[str, str]:
    """A request's fields (``mdiedge.base.request``) -> the body's names for them."""
    repetition = "repeat_penalty" if body.get("repetition_penalty") is None and \
        body.get("repeat_penalty") is not None else "repetition_penalty"
    return {"max_new_tokens": max_tokens_key, "n_samples": "n",
            "top_logprobs": "top_logprobs" if chat else "logprobs",
            "repetition_penalty": repetition}


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    """A number field as a float (``default`` when absent; an integer past any float's range
    as infinity, which no range holds: a 400 quoting it)."""
    value = body.get(name)
    try:
        return default if value is None else float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def read_sampling(body: Mapping[str, Any], chat: bool) -> Dict[str, Any]:
    """``SamplingParams``' fields beyond OpenAI's basic ones, as ``body`` gives them."""
    repetition = "repetition_penalty" if body.get("repetition_penalty") is not None \
        else "repeat_penalty"
    return {"presence_penalty": _number(body, "presence_penalty", 0.0),
            "frequency_penalty": _number(body, "frequency_penalty", 0.0),
            "repetition_penalty": _number(body, repetition, 1.0),
            "min_p": _number(body, "min_p", 0.0),
            "logit_bias": _logit_bias(body.get("logit_bias") or {}),
            "top_logprobs": _chat_logprobs(body) if chat else _completion_logprobs(body)}


def check_vocab(params: SamplingParams, vocab: int) -> None:
    """A 400 for a biased token the model does not have."""
    for token, _ in params.logit_bias:
        if token >= vocab:
            raise ApiError(400, f"logit_bias: token id {token} is not in the model's "
                           f"vocabulary of {vocab}", "logit_bias", "invalid_value")


def _completion_logprobs(body: Mapping[str, Any]) -> Optional[int]:
    """Completions' ``logprobs`` N (an integer; ``true`` is a 400 naming it)."""
    value = body.get("logprobs")
    if isinstance(value, bool):
        raise ApiError(400, f"logprobs: expected an integer, got {value!r}", "logprobs",
                       "invalid_type")
    return value


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


def _logit_bias(bias: Mapping[str, Any]) -> Tuple[Tuple[int, Any], ...]:
    """OpenAI's ``logit_bias`` (token id strings to numbers) as (id, bias) pairs (their
    count and range are ``SamplingParams``')."""
    out = []
    for key, value in bias.items():
        token = key.strip() if isinstance(key, str) else ""
        if not (token.isascii() and token.isdigit()) or len(token) > 12:
            raise ApiError(400, f"logit_bias: expected token ids as keys, got {key[:40]!r}",
                           "logit_bias", "invalid_value")
        if not _is_number(value):
            raise ApiError(400, f"logit_bias[{token}]: expected a number, got {value!r}",
                           "logit_bias", "invalid_value")
        out.append((int(token), value))
    return tuple(out)
