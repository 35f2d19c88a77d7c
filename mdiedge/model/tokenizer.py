"""Tokenizers behind one interface: SentencePiece ``tokenizer.model`` and, through the
optional ``tokenizers`` package, Hugging Face ``tokenizer.json``.

Which special tokens a prompt gets around its text is the tokenizer's own rule, decided once
by :func:`prompt_rule` as transformers does:

1. ``tokenizer_config.json`` naming ``add_bos_token`` or ``add_eos_token``: those two flags
   (each false when not named) with its ``bos_token``/``eos_token``;
2. else a ``tokenizer.json``'s post-processor (SmolLM2's adds nothing, Llama 3's a BOS);
3. else a SentencePiece model alone: its BOS when it has one, no EOS, as Llama's reference
   tokenizer, llama.cpp and llama2.c's ``run.c`` do.

Special tokens typed in a text are those tokens, not their characters, in every kind.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, TypeVar, Union

from ..base.errors import CheckpointError, TokenizerError
from ..base.smallfiles import kind_of
from . import gguf_vocab
from .modelfile import model_file

CONFIG_FILE = "tokenizer_config.json"
T = TypeVar("T")


@dataclass(frozen=True)
class PromptRule:
    """The special ids around a prompt's text; None: the tokenizer's post-processor adds
    what it adds (``tokenizer.json``)."""

    bos: Optional[int]
    eos: Optional[int]


def token_text(value: Any) -> Optional[str]:
    """A special token of tokenizer_config.json: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(folder: Path) -> Dict[str, Any]:
    """``tokenizer_config.json`` of ``folder`` (``{}`` when there is none)."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: not a JSON file ({e})") from None
    except RecursionError:
        raise TokenizerError(f"{path}: not a JSON file (nested too deeply)") from None
    if not isinstance(found, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(found).__name__}")
    return found


def prompt_rule(config: Dict[str, Any], ids: Dict[str, Optional[int]],
                own_bos: Optional[bool]) -> Optional[PromptRule]:
    """The rule of the module docstring. ``config``: tokenizer_config.json; ``ids``: the ids
    of its ``bos_token``/``eos_token`` (None when unnamed or not in the vocabulary);
    ``own_bos``: whether the tokenizer adds BOS by itself (a SentencePiece model), None when
    its post-processor decides. None: the post-processor decides."""
    if "add_bos_token" in config or "add_eos_token" in config:
        for flag, key in (("add_bos_token", "bos"), ("add_eos_token", "eos")):
            if config.get(flag) and ids[key] is None:
                raise TokenizerError(f"{CONFIG_FILE}: {flag} is true but its {key}_token "
                                     f"{token_text(config.get(key + '_token'))!r} is not a token "
                                     f"of the vocabulary")
        return PromptRule(ids["bos"] if config.get("add_bos_token") else None,
                          ids["eos"] if config.get("add_eos_token") else None)
    if own_bos is None:
        return None
    return PromptRule(ids["bos"] if own_bos else None, None)


class Tokenizer:
    """Encodes text to ids and decodes ids to text. ``encode`` parses special tokens typed in
    the text and adds none; ``encode_prompt`` adds what the tokenizer's rule adds."""

    bos_id: Optional[int] = None  # the BOS token, whether or not prompts get it
    eos_id: Optional[int] = None
    rule: Optional[PromptRule] = None

    def encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def encode_prompt(self, text: str) -> List[int]:
        """A prompt's ids: the text's, with the special tokens the tokenizer adds."""
        rule = self.rule if self.rule is not None else PromptRule(None, None)
        return ([rule.bos] if rule.bos is not None else []) + self.encode(text) + \
            ([rule.eos] if rule.eos is not None else [])

    @property
    def adds_bos(self) -> bool:
        return self.bos_id is not None and self.encode_prompt("")[:1] == [self.bos_id]

    def token(self, token_id: int) -> str:
        """The text of one token (a special token's own spelling, such as ``<s>``)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError


def _special_ids(config: Dict[str, Any], lookup: Any) -> Dict[str, Optional[int]]:
    """The ids of tokenizer_config.json's ``bos_token``/``eos_token`` (``lookup``: a token's
    text to its id or None)."""
    found: Dict[str, Optional[int]] = {}
    for key in ("bos", "eos"):
        text = token_text(config.get(key + "_token"))
        found[key] = lookup(text) if text is not None else None
    return found


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: Path, config: Optional[Dict[str, Any]] = None) -> None:
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{path}: not a SentencePiece model ({e})") from None
        size = self.sp.get_piece_size()
        # the pieces a text may name: control (<s>, </s>) and unknown (<unk>), longest first
        specials = sorted((self.sp.id_to_piece(i) for i in range(size)
                           if self.sp.is_control(i) or self.sp.is_unknown(i)), key=len,
                          reverse=True)
        self._special = re.compile("(" + "|".join(map(re.escape, specials)) + ")") \
            if specials else None
        config = config or {}
        ids = _special_ids(config, self._piece_id)
        own = {"bos": self.sp.bos_id(), "eos": self.sp.eos_id()}
        for key, value in own.items():
            if ids[key] is None and token_text(config.get(key + "_token")) is None:
                ids[key] = value if value >= 0 else None
        self.bos_id, self.eos_id = ids["bos"], ids["eos"]
        self.rule = prompt_rule(config, ids, own_bos=True)

    def _piece_id(self, piece: str) -> Optional[int]:
        found = int(self.sp.piece_to_id(piece))
        return found if found != self.sp.unk_id() or piece == self.sp.id_to_piece(found) \
            else None

    def encode(self, text: str) -> List[int]:
        if self._special is None:
            return list(self.sp.encode(text))
        ids: List[int] = []
        for i, part in enumerate(self._special.split(text)):  # odd parts: special tokens
            if i % 2:
                ids.append(int(self.sp.piece_to_id(part)))
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def token(self, token_id: int) -> str:
        return str(self.sp.id_to_piece(token_id))

    def decode(self, ids: Sequence[int]) -> str:
        size = self.sp.get_piece_size()  # a model's vocab may be padded past the tokenizer's
        return str(self.sp.decode([i for i in ids if 0 <= i < size]))

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path, config: Optional[Dict[str, Any]] = None) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise TokenizerError(f"{path}: reading tokenizer.json needs the 'tokenizers' package "
                                 f"(pip install 'mdiedge[hf]')") from None
        try:
            self.tok = _HFTokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"{path}: not a tokenizer.json file ({e})") from None
        ids = _special_ids(config or {}, self.tok.token_to_id)
        self.bos_id, self.eos_id = ids["bos"], ids["eos"]
        self.rule = prompt_rule(config or {}, ids, own_bos=None)

    @classmethod
    def from_tokenizer(cls, tok: Any, bos_id: Optional[int], eos_id: Optional[int],
                       rule: Optional[PromptRule]) -> "HFTokenizer":
        """One around a ``tokenizers.Tokenizer`` built in memory (a GGUF file's), with its
        BOS/EOS ids and prompt rule."""
        self = cls.__new__(cls)
        self.tok, self.bos_id, self.eos_id, self.rule = tok, bos_id, eos_id, rule
        return self

    def encode(self, text: str) -> List[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, text: str) -> List[int]:
        if self.rule is None:  # the post-processor's own rule
            return list(self.tok.encode(text, add_special_tokens=True).ids)
        return super().encode_prompt(text)

    def token(self, token_id: int) -> str:
        return str(self.tok.id_to_token(token_id) or "")

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=False))

    @property
    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size())


def _from_gguf(path: Path, key: str, build: Callable[[Dict[str, Any], Path], T]) -> T:
    """``build(metadata, path)`` once per GGUF file and process (``ModelFile.memo``), from
    the metadata of the header that the config and the tensors come from too; a file that
    cannot be read is a TokenizerError."""
    file = model_file(path)
    try:
        return file.memo(key, lambda: build(file.vocab, path))
    except CheckpointError as e:
        raise TokenizerError(str(e)) from None


def gguf_chat(path: Path) -> Dict[str, Any]:
    """The chat template (None when it has none) and special tokens' texts of a GGUF file."""
    return _from_gguf(path, "chat", gguf_vocab.read_chat)


def gguf_tokenizer(path: Path) -> HFTokenizer:
    """The tokenizer a GGUF file carries (BOS/EOS as its flags say), built once per file: it
    takes most of a second, a command opens a model's text side more than once, and use does not
    change it."""
    return _from_gguf(path, "tokenizer", _gguf_built)


def _gguf_built(meta: Dict[str, Any], path: Path) -> HFTokenizer:
    found = gguf_vocab.read_vocab(meta, path)
    rule = PromptRule(found.bos_id if found.add_bos else None,
                      found.eos_id if found.add_eos else None)
    return HFTokenizer.from_tokenizer(found.tokenizer, found.bos_id, found.eos_id, rule)


def load_tokenizer(model_path: Path, tokenizer: Optional[Union[str, Path]] = None) -> Tokenizer:
    """The tokenizer named by ``tokenizer``, else the model's: a GGUF file's own, or the
    model directory's ``tokenizer.json`` or ``tokenizer.model`` (a llama2.c file looks beside
    itself); the ``tokenizer_config.json`` beside the file it reads gives its special-token
    rule (a GGUF file's flags are its own)."""
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not path.is_file():
            raise TokenizerError(f"{path}: not a regular file ({kind_of(path.stat())})"
                                 if path.exists() else f"{path}: tokenizer file not found")
        if gguf_vocab.is_gguf(path):
            return gguf_tokenizer(path)
        config = read_tokenizer_config(path.parent)
        return HFTokenizer(path, config) if path.suffix == ".json" else \
            SentencePieceTokenizer(path, config)
    if model_path.is_file() and gguf_vocab.is_gguf(model_path):
        return gguf_tokenizer(model_path)
    folder = model_path if model_path.is_dir() else model_path.parent
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder / "tokenizer.json", read_tokenizer_config(folder))
    if (folder / "tokenizer.model").is_file():
        return SentencePieceTokenizer(folder / "tokenizer.model", read_tokenizer_config(folder))
    raise TokenizerError(f"{folder}: no tokenizer.model or tokenizer.json; pass --tokenizer FILE")


class StreamDecoder:
    """Turns a growing list of ids into text increments after a prefix (the prompt), holding
    back an incomplete UTF-8 sequence until it completes.

    Each push decodes one window, not all ids: ``CONTEXT`` to ``2 * CONTEXT`` emitted ids, then
    the new ones, and takes what the latter add (the emitted ids give the new ones the context a
    whole-text decode gives them: a window's first piece loses its leading space, pieces render
    by their neighbours). The cost does not grow with the text (vLLM's incremental
    detokenization, Hugging Face's ``TextStreamer``)."""

    CONTEXT = 5  # emitted ids decoded before the new ones, at least

    def __init__(self, tokenizer: Tokenizer, prefix: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: List[int] = list(prefix)
        self.read = self.prefix = len(self.ids)  # ids before ``read`` are emitted
        self.start = max(0, self.read - self.CONTEXT)  # the window's first id
        self.emitted = self.window = tokenizer.decode(self.ids[self.start:])

    def push(self, token: int) -> str:
        self.ids.append(token)
        if self.read - self.start > 2 * self.CONTEXT:
            self.start = self.read - self.CONTEXT
            self.emitted = self.tokenizer.decode(self.ids[self.start:self.read])
        self.window = text = self.tokenizer.decode(self.ids[self.start:])
        if text.endswith("\ufffd") or len(text) <= len(self.emitted):
            return ""
        self.read = len(self.ids)
        new, self.emitted = text[len(self.emitted):], text
        return new

    def held(self) -> str:
        """The text of the ids not emitted yet (an incomplete character reads U+FFFD)."""
        return self.window[len(self.emitted):] if self.read < len(self.ids) else ""

    def whole(self) -> str:
        decode = self.tokenizer.decode
        return decode(self.ids)[len(decode(self.ids[:self.prefix])):]
