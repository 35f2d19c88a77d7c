"""A sample's text output and its stop strings (OpenAI's ``stop``; ``--stop``): a sample ends when
its text contains one, its output just before it. ``cut_at_stop`` and ``streamable`` are the pure
rules for the finished text and a stream."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from .tokenizer import StreamDecoder, Tokenizer



def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Where the earliest stop at or after ``start`` begins, or -1."""
    hits = [i for i in (text.find(stop, start) for stop in stops) if i >= 0]
    return min(hits) if hits else -1


def cut_at_stop(text: str, stops: Sequence[str]) -> Tuple[str, bool]:
    """Whether one was found."""
    at = find_stop(text, stops)
    return (text[:at], True) if at >= 0 else (text, False)


def streamable(text: str, stops: Sequence[str]) -> int:
    """Leading characters a stream may show now: before a stop, and before any suffix that could
    grow into one."""
    at = find_stop(text, stops)
    if at >= 0:
        return at
    held = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:n]):
                held = n
                break
    return len(text) - held


class TextOutput:
    """One sample's text, each token decoded once as sampled (``push``, on the stepping thread):
    stop found, what a stream may show (``fresh``: never a stop or its start) and the final text."""

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int],
                 stops: Sequence[str] = ()) -> None:
        self.decoder = StreamDecoder(tokenizer, prompt)
        self.stops = list(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # decoded so far, up to an incomplete character
        self.stopped_at: Optional[int] = None  # index in ``text`` of the stop string
        self.shown = 0  # characters of the text a stream was given

    def push(self, token: int) -> bool:
        """Whether the text holds a stop now; each push searches only the new text and a stop's
        length before it."""
        if self.stopped_at is None:
            start = max(0, len(self.text) - self._longest + 1)
            self.text += self.decoder.push(token)
            at = find_stop(self.text, self.stops, start)
            self.stopped_at = at if at >= 0 else None
        return self.stopped_at is not None

    def final(self, stopped: bool) -> str:
        """Up to the stop string if it ``stopped`` on one."""
        text = self.text + self.decoder.held()
        if "\ufffd" in text:  # invalid UTF-8, which reads differently in the whole text
            text = self.decoder.whole()
        return cut_at_stop(text, self.stops)[0] if stopped else text

    def fresh(self) -> str:
        return self._show(self.text[:streamable(self.text, self.stops)])

    def rest(self, final: str) -> str:
        return self._show(final)

    def _show(self, text: str) -> str:
        new = text[self.shown:]
        self.shown = max(self.shown, len(text))
        return new
