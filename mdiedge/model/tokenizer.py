"""Tokenizers behind one interface: SentencePiece ``tokenizer.model`` and, through the
optional ``tokenizers`` package, Hugging Face ``tokenizer.json``."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Union

from ..base.errors import TokenizerError


class Tokenizer:
    """Encodes text to ids (no BOS/EOS added) and decodes ids to text."""

    def encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: Path) -> None:
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{path}: not a SentencePiece model ({e})") from None

    def encode(self, text: str) -> List[int]:
        return list(self.sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        size = self.sp.get_piece_size()  # a model's vocab may be padded past the tokenizer's
        return str(self.sp.decode([i for i in ids if 0 <= i < size]))

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise TokenizerError(f"{path}: reading tokenizer.json needs the 'tokenizers' package "
                                 f"(pip install 'mdiedge[hf]')") from None
        try:
            self.tok = _HFTokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"{path}: not a tokenizer.json file ({e})") from None

    def encode(self, text: str) -> List[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=False))

    @property
    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size())


def load_tokenizer(model_path: Path, tokenizer: Optional[Union[str, Path]] = None) -> Tokenizer:
    """The tokenizer named by ``tokenizer``, else the model directory's ``tokenizer.model``
    or ``tokenizer.json`` (a llama2.c file looks beside itself)."""
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not path.is_file():
            raise TokenizerError(f"{path}: tokenizer file not found")
        return HFTokenizer(path) if path.suffix == ".json" else SentencePieceTokenizer(path)
    folder = model_path if model_path.is_dir() else model_path.parent
    if (folder / "tokenizer.model").is_file():
        return SentencePieceTokenizer(folder / "tokenizer.model")
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder / "tokenizer.json")
    raise TokenizerError(f"{folder}: no tokenizer.model or tokenizer.json; pass --tokenizer FILE")


def decode_continuation(tokenizer: Tokenizer, prefix: Sequence[int], ids: Sequence[int]) -> str:
    """Text of ``ids`` as it reads after ``prefix`` (keeps the leading space that decoding
    ``ids`` alone would strip)."""
    return tokenizer.decode(list(prefix) + list(ids))[len(tokenizer.decode(prefix)):]


class StreamDecoder:
    """Turns a growing list of ids into text increments after a prefix (the prompt), holding
    back an incomplete UTF-8 sequence (byte-fallback pieces) until it is complete.

    Each push decodes a window, not every id so far: ``CONTEXT`` emitted ids, then those not
    yet emitted, and takes what the latter add to the former's text. Decoding strips the
    leading space of a window's first piece and may render a piece by its neighbours, so the
    emitted ids give the new ones the context they have in the whole text; the increments
    are those of decoding every id each time, at a cost that does not grow with the text
    (the incremental detokenization of vLLM and Hugging Face's ``TextStreamer``)."""

    CONTEXT = 5  # emitted ids decoded before the new ones

    def __init__(self, tokenizer: Tokenizer, prefix: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: List[int] = list(prefix)
        self.read = len(self.ids)  # ids before this one are emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        start = max(0, self.read - self.CONTEXT)
        emitted = self.tokenizer.decode(self.ids[start:self.read])
        text = self.tokenizer.decode(self.ids[start:])
        if text.endswith("\ufffd") or len(text) <= len(emitted):
            return ""
        self.read = len(self.ids)
        return text[len(emitted):]
