"""SentencePiece BPE over a GGUF ``llama`` vocabulary, in Python, with the results of the
``tokenizers`` build in ``gguf_vocab`` (whose ranks it reads from the scores directly).

That build spells every rank out: 513,511 merges for Gemma 3's 262,144 tokens took 2.7 s
and 390 MB at its peak, and the built model kept about 100 MB. Here a pair's rank is computed
when the pair is met: the merged token's score, then the longer left part, then the longer
right part, then the merged token's id (``gguf_vocab._score_merges``'s order).

Special and added tokens typed in a text are that one token (leftmost, then longest match,
as ``tokenizers``' added vocabulary); the text between them is BPE-encoded with ``▁`` for
spaces, a ``▁`` before the text's first part when ``prefix``, and a character outside the
vocabulary spelled as its UTF-8 bytes' ``<0xXX>`` tokens (else the unknown token)."""
from __future__ import annotations

import heapq
import re
from array import array
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..base.errors import TokenizerError

SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")


class Encoding:
    """What ``encode`` returns: the ids, as ``tokenizers.Encoding.ids``."""

    __slots__ = ("ids",)

    def __init__(self, ids: List[int]) -> None:
        self.ids = ids


class SpmBpe:
    """The encoder and decoder; its methods are the part of ``tokenizers.Tokenizer``'s
    interface that ``tokenizer.HFTokenizer`` calls, and ``to_str`` builds that tokenizer
    itself (``build_full``) for the one user that needs its JSON: grammars."""

    def __init__(self, tokens: List[str], scores: Sequence[float], kept: Sequence[str],
                 unk_id: Optional[int], prefix: bool,
                 build_full: Callable[[], Any]) -> None:
        self.tokens, self.prefix = tokens, prefix
        self.scores = array("d", scores)  # 8 bytes a token, not a Python float's 32
        self.ids: Dict[str, int] = {t: i for i, t in enumerate(tokens)}
        self.kept_ids = frozenset(self.ids[t] for t in kept)
        self.unk_id = unk_id
        self._build_full = build_full
        self._added = _AddedTokens(kept)

    def get_vocab_size(self) -> int:
        return len(self.tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.ids.get(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self.tokens[token_id] if 0 <= token_id < len(self.tokens) else None

    def to_str(self) -> str:
        return str(self._build_full().to_str())

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        ids: List[int] = []
        for start, part, token in self._added.split(text):
            if token:
                ids.append(self.ids[part])
                continue
            part = part.replace(" ", SPACE)
            if self.prefix and start == 0 and not part.startswith(SPACE):
                part = SPACE + part
            ids.extend(self._merged(self._symbols(part)))
        return Encoding(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        pieces = [self.tokens[i].replace(SPACE, " ") for i in ids
                  if 0 <= i < len(self.tokens)
                  and not (skip_special_tokens and i in self.kept_ids)]
        text = "".join(_bytes_fused(pieces))
        return text[1:] if self.prefix and text.startswith(" ") else text

    def _symbols(self, text: str) -> List[int]:
        """The ids of ``text``'s characters, a character outside the vocabulary as its bytes'
        tokens (all or none), else the unknown token, unknowns side by side fused."""
        found: List[int] = []
        for char in text:
            known = self.ids.get(char)
            if known is not None:
                found.append(known)
                continue
            spelled = [self.ids.get(f"<0x{b:02X}>") for b in char.encode("utf-8")]
            if all(b is not None for b in spelled):
                found.extend(spelled)  # type: ignore[arg-type]
            elif self.unk_id is None:
                raise TokenizerError(f"{char!r} is not in the vocabulary, which has no unknown "
                                     f"token")
            elif not found or found[-1] != self.unk_id:
                found.append(self.unk_id)
        return found

    def _rank(self, left: int, right: int) -> Optional[Tuple[float, int, int, int]]:
        if left in self.kept_ids or right in self.kept_ids:
            return None
        first, second = self.tokens[left], self.tokens[right]
        merged = self.ids.get(first + second)
        if merged is None or merged in self.kept_ids:
            return None
        return (-self.scores[merged], -len(first), -len(second), merged)

    def _merged(self, symbols: List[int]) -> List[int]:
        """``symbols`` merged pair by pair, the best rank first, at equal rank the leftmost
        (``tokenizers``' ``Word::merge_all``)."""
        count = len(symbols)
        after = list(range(1, count + 1))
        before = list(range(-1, count - 1))
        queue = [(rank, pos, symbols[pos], symbols[pos + 1])
                 for pos, rank in enumerate(self._rank(a, b)
                                            for a, b in zip(symbols, symbols[1:]))
                 if rank is not None]
        heapq.heapify(queue)
        while queue:
            rank, pos, left, right = heapq.heappop(queue)
            nxt = after[pos]
            if symbols[pos] != left or nxt >= count or symbols[nxt] != right:
                continue  # a stale entry: one of its symbols has merged since
            symbols[pos], symbols[nxt] = rank[3], -1
            after[pos] = after[nxt]
            if after[pos] < count:
                before[after[pos]] = pos
            for a, b in ((before[pos], pos), (pos, after[pos])):
                if a >= 0 and b < count:
                    found = self._rank(symbols[a], symbols[b])
                    if found is not None:
                        heapq.heappush(queue, (found, a, symbols[a], symbols[b]))
        return [s for s in symbols if s >= 0]


def _bytes_fused(pieces: List[str]) -> Iterator[str]:
    """``pieces`` with each run of ``<0xXX>`` tokens replaced by the UTF-8 text of its bytes,
    or by one U+FFFD per token where they are not UTF-8 (``tokenizers``' ``ByteFallback``)."""
    run: List[int] = []
    for piece in pieces + [""]:
        byte = _BYTE_TOKEN.match(piece) if len(piece) == 6 else None
        if byte is not None:
            run.append(int(byte.group(1), 16))
            continue
        if run:
            try:
                yield bytes(run).decode("utf-8")
            except UnicodeDecodeError:
                yield "\ufffd" * len(run)
            run = []
        yield piece


class _AddedTokens:
    """Finds the special and added tokens typed in a text: leftmost, then longest."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.known = frozenset(t for t in tokens if t)
        lengths: Dict[str, set] = {}
        for token in self.known:
            lengths.setdefault(token[0], set()).add(len(token))
        # a first character: the lengths of the tokens it starts, longest first
        self.by_first = {c: sorted(found, reverse=True) for c, found in lengths.items()}
        self.starts = re.compile("[" + "".join(map(re.escape, self.by_first)) + "]") \
            if self.by_first else None

    def split(self, text: str) -> Iterator[Tuple[int, str, bool]]:
        """``(offset, part, is_token)`` for the parts of ``text`` in order."""
        done = at = 0
        while self.starts is not None:
            found = self.starts.search(text, at)
            if found is None:
                break
            at = found.start()
            token = next((text[at:at + n] for n in self.by_first[text[at]]
                          if text[at:at + n] in self.known), None)
            if token is None:
                at += 1
                continue
            if at > done:
                yield done, text[done:at], False
            yield at, token, True
            done = at = at + len(token)
        if done < len(text):
            yield done, text[done:], False
