"""Constrained decoding: output held to a grammar (a JSON schema, any JSON object, GBNF, Lark or a
regular expression) by masking, before each token is sampled, every token it does not allow.
llguidance (Microsoft's engine, as in llama.cpp, vLLM and SGLang) compiles it against the vocabulary
once per request, one matcher per sample. Grammars are bounded (text, schema nesting,
``PARSER_LIMITS``); past them, or not compiling, a ``GrammarError`` naming where, never a hang."""
from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from ..base import defaults
from ..base.arrays import float32
from ..base.errors import GenerationError, GrammarError

GRAMMAR_KINDS = ("json_object", "json_schema", "gbnf", "lark", "regex")
ANY_JSON_OBJECT = {"type": "object"}  # response_format json_object: any object


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise GrammarError("constrained decoding needs the 'llguidance' package (pip install "
                           "'mdiedge[grammar]'; Python 3.9 or newer)") from None
    return llguidance


def _depth(value: Any, limit: int) -> int:
    """Counted until past ``limit``."""
    stack, deepest = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = item.values() if isinstance(item, dict) else item if \
            isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


def grammar_source(kind: str, source: Any) -> str:
    """``kind``: one of ``GRAMMAR_KINDS``."""
    llg = _llguidance()
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"grammar kind {kind!r}: expected one of {', '.join(GRAMMAR_KINDS)}")
    if kind in ("json_object", "json_schema"):
        schema = ANY_JSON_OBJECT if kind == "json_object" else source
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"json_schema: expected a JSON object, got "
                               f"{type(schema).__name__}")
        text = json.dumps(schema)
        if _depth(schema, defaults.GRAMMAR_MAX_DEPTH) > defaults.GRAMMAR_MAX_DEPTH:
            raise GrammarError(f"json_schema: nested deeper than {defaults.GRAMMAR_MAX_DEPTH}")
    elif not isinstance(source, str):
        raise GrammarError(f"{kind}: expected a string, got {type(source).__name__}")
    else:
        text = source
    if len(text.encode("utf-8", "replace")) > defaults.GRAMMAR_MAX_BYTES:
        raise GrammarError(f"{kind}: {len(text)} characters, more than the "
                           f"{defaults.GRAMMAR_MAX_BYTES} bytes a grammar may have")
    try:
        if kind in ("json_object", "json_schema"):
            return str(llg.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": False}))
        if kind == "regex":
            return str(llg.LLMatcher.grammar_from_regex(text))
        return str(llg.grammar_from("gbnf" if kind == "gbnf" else "lark", text))
    except (ValueError, RuntimeError) as e:
        raise GrammarError(f"{kind}: {_one_line(str(e))}") from None


def parser_limits() -> Any:
    llg = _llguidance()
    return llg.LLParserLimits(step_lexer_fuel=defaults.GRAMMAR_STEP_FUEL,
                              max_grammar_size=defaults.GRAMMAR_MAX_SYMBOLS,
                              verbose_errors=False)


def grammar_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """Built once per tokenizer (it takes up to a second)."""
    cached = getattr(tokenizer, "_grammar_tokenizer", None)
    if cached is not None:
        return cached
    llg = _llguidance()
    hf = getattr(tokenizer, "tok", None)
    if hf is None or not hasattr(hf, "to_str"):
        raise GrammarError(f"constrained decoding needs a Hugging Face tokenizer (a "
                           f"tokenizer.json or a GGUF file's), not {type(tokenizer).__name__}")
    try:
        built = llg.LLTokenizer(hf.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_id)
    except (ValueError, RuntimeError) as e:
        raise GrammarError(f"constrained decoding: the tokenizer: {_one_line(str(e))}") from None
    tokenizer._grammar_tokenizer = built
    return built


class Grammar:
    """Compiled for one tokenizer: checked once, then a matcher per sample."""

    def __init__(self, tokenizer: Any, vocab_size: int, kind: str, source: Any) -> None:
        llg = _llguidance()
        self.kind, self.vocab_size = kind, vocab_size
        self.text = grammar_source(kind, source)
        self.tokenizer = grammar_tokenizer(tokenizer, vocab_size)
        self.limits = parser_limits()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(
            self.text, self.tokenizer, limits=self.limits)
        if failed:
            raise GrammarError(f"{kind}: {_one_line(messages[0])}")

    def matcher(self) -> "Constraint":
        llg = _llguidance()
        return Constraint(llg.LLMatcher(self.tokenizer, self.text, log_level=0,
                                        limits=self.limits), self.vocab_size)


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit] + "..."


class Constraint:
    """One sample's place in a grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size

    @property
    def finished(self) -> bool:
        """Complete, allowing nothing more."""
        return bool(self.matcher.is_stopped())

    def allowed(self) -> np.ndarray:
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[:self.vocab_size]
        if bits.shape[0] < self.vocab_size:
            bits = np.pad(bits, (0, self.vocab_size - bits.shape[0]))
        self._check()
        return bits.astype(bool)

    def mask(self, logits: Any) -> np.ndarray:
        """-inf wherever the grammar allows no token."""
        logits, allowed = float32(logits), self.allowed()
        width = logits.shape[-1]
        if width > allowed.shape[0]:
            allowed = np.concatenate([allowed, np.zeros(width - allowed.shape[0], dtype=bool)])
        return np.where(allowed[:width], logits, np.float32(-np.inf))

    def masked_drafts(self, logits: Any, drafts: Sequence[int]) -> np.ndarray:
        """Each row masked as the grammar stands after the drafts before it; rows after a refused
        draft, or completion, as they are (a draft outside the grammar has probability 0 and is
        rejected). The matcher ends where it began."""
        logits = float32(logits)
        rows, followed = logits.copy(), 0
        for i in range(len(drafts) + 1):
            if self.matcher.is_stopped():
                break
            rows[i] = self.mask(logits[i])
            if i == len(drafts) or not self.matcher.try_consume_tokens([int(drafts[i])]):
                break
            followed += 1
        if followed:
            self.matcher.rollback(followed)
        return rows

    def take(self, tokens: Sequence[int]) -> None:
        """GenerationError when the grammar refuses one."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(int(token)):
                self._check()
                raise GenerationError(f"token {int(token)} does not follow the grammar")

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GenerationError(f"grammar: {_one_line(self.matcher.get_error())}")

