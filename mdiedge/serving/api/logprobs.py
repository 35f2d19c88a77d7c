"""Log-probabilities in OpenAI's shapes: each token's text as it reads in its sample's text, its
UTF-8 bytes, and chat's ``choices[].logprobs.content[]`` and completions' ``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``. Values are the model's log-softmax before
penalties and temperature. A byte piece of a character reads as U+FFFD with its own byte in
``bytes``."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:  # no torch where only the shapes are needed
    from ...model.sampling import TokenLogprob
    from ...model.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's and llama.cpp's byte tokens


def _byte_level_table() -> Dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character spelling each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_LEVEL = _byte_level_table()


def token_bytes(tokenizer: Tokenizer, token: int, text: str) -> List[int]:
    """Its UTF-8, but a character piece's own byte(s)."""
    if "\ufffd" not in text:
        return list(text.encode("utf-8"))
    piece = tokenizer.token(token)
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return [int(match.group(1), 16)]
    if piece and all(c in _BYTE_LEVEL for c in piece):
        return [_BYTE_LEVEL[c] for c in piece]
    return list(text.encode("utf-8"))


@dataclass
class Entry:
    """``offset``: where its text starts in the sample's text."""

    text: str
    bytes: List[int]
    logprob: float
    top: List[Tuple[str, List[int], float]]
    offset: int


class TokenTexts:
    """Each token read after the ``CONTEXT`` ids before it (a piece's leading space, as in the whole
    text)."""

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int], offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.window: List[int] = list(prompt[-self.CONTEXT:])
        self.offset = offset

    def _text(self, token: int, before: str) -> str:
        return self.tokenizer.decode(self.window + [token])[len(before):]

    def push(self, scored: TokenLogprob) -> Entry:
        before = self.tokenizer.decode(self.window)
        text = self._text(scored.token, before)
        top = []
        for token, logprob in scored.top:
            alt = self._text(token, before)
            top.append((alt, token_bytes(self.tokenizer, token, alt), logprob))
        entry = Entry(text, token_bytes(self.tokenizer, scored.token, text), scored.logprob,
                      top, self.offset)
        self.offset += len(text)
        self.window = (self.window + [scored.token])[-self.CONTEXT:]
        return entry


def entries(tokenizer: Tokenizer, prompt: Sequence[int], scored: Sequence[TokenLogprob],
            text_length: Optional[int] = None, offset: int = 0) -> List[Entry]:
    """With ``text_length`` (cut at a stop string), those starting within it."""
    texts = TokenTexts(tokenizer, prompt, offset)
    out = [texts.push(s) for s in scored]
    return out if text_length is None else within(out, text_length)


def prompt_entries(tokenizer: Tokenizer, prompt: Sequence[int],
                   scored: Sequence[Optional[TokenLogprob]], echo: str) -> List[Entry]:
    """Laid over ``echo``: each token's text where ``echo`` reads it next, else empty (a special
    token, a character piece); the first logprob null."""
    from ...model.sampling import TokenLogprob

    texts, out, at = TokenTexts(tokenizer, []), [], 0
    for token, score in zip(prompt, scored):
        entry = texts.push(score if score is not None else TokenLogprob(token, 0.0))
        if entry.text and echo.startswith(entry.text, at):
            entry.offset, at = at, at + len(entry.text)
        else:
            entry.text, entry.offset = "", at
        if score is None:
            entry.logprob = None  # type: ignore[assignment]
        out.append(entry)
    return out


def within(items: Sequence[Entry], text_length: int) -> List[Entry]:
    return [e for e in items if e.offset < text_length]


def chat_logprobs(items: Sequence[Entry]) -> Dict[str, Any]:
    return {"content": [{"token": e.text, "logprob": e.logprob, "bytes": e.bytes,
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b}
                                          for t, b, lp in e.top]} for e in items],
            "refusal": None}


def completion_logprobs(items: Sequence[Entry]) -> Dict[str, Any]:
    """``text_offset`` from the completion's start."""
    return {"tokens": [e.text for e in items], "token_logprobs": [e.logprob for e in items],
            "top_logprobs": [{t: lp for t, _, lp in e.top} for e in items],
            "text_offset": [e.offset for e in items]}


class StreamedLogprobs:
    """Each sample's tokens since its last chunk with text (none when not asked: ``enabled`` false).
    """

    def __init__(self, tokenizer: Tokenizer, samples: Sequence[Any], chat: bool,
                 enabled: bool, offset: int = 0) -> None:
        self.samples, self.enabled = samples, enabled
        self.texts = [TokenTexts(tokenizer, s.prompt, offset) for s in samples] if enabled \
            else []
        self.pending: List[List[Entry]] = [[] for _ in samples]
        self.read = [0] * len(samples)
        self.shape = chat_logprobs if chat else completion_logprobs

    def push(self, index: int) -> None:
        """Its logprob is kept before the token is."""
        if self.enabled:
            scored = self.samples[index].logprobs[self.read[index]]
            self.read[index] += 1
            self.pending[index].append(self.texts[index].push(scored))

    def take(self, index: int, text_length: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """None: none; ``text_length``: those starting within it (the final chunk's)."""
        items, self.pending[index] = self.pending[index], []
        if text_length is not None:
            items = within(items, text_length)
        return self.shape(items) if items else None
