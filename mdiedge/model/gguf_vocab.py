"""The tokenizer and chat template a GGUF file (llama.cpp's format) carries in its metadata,
built with the ``tokenizers`` library as llama.cpp's ``llama-vocab.cpp`` reads them:

- ``tokenizer.ggml.model`` ``gpt2``: byte-level BPE from ``tokens`` and ``merges``, the text
  split first by the regular expressions that ``tokenizer.ggml.pre`` names (``PRE_SPLITS``);
- ``llama``: SentencePiece BPE, a merge ranked by its result's score (``spmbpe.SpmBpe``
  in Python; ``tokenizers`` with the merges spelled out for grammars), bytes as ``<0xXX>``
  pieces for what the vocabulary lacks, and a space before the text when
  ``add_space_prefix`` (absent: true) says so.

Tokens the file types CONTROL (and UNKNOWN) are special tokens, USER_DEFINED ones added
tokens: typed in a text, each is that one token. Whether prompts get a BOS or an EOS is the
file's ``add_bos_token``/``add_eos_token``, else llama.cpp's default for the vocabulary.

The metadata comes from the file's one reader (``mdiedge.model.modelfile.ModelFile.vocab``:
the header parsed once, the string arrays of the vocabulary decoded from the map in one walk).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..base.errors import TokenizerError
from .spmbpe import SpmBpe

MAGIC = b"GGUF"
TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED = 1, 2, 3, 4  # token_type values
MODELS = ("gpt2", "llama")

_GPT2 = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
# tokenizer.ggml.pre: the regular expressions that split a text, in turn, before BPE
PRE_SPLITS: Dict[str, Tuple[str, ...]] = {
    "default": _DEFAULT,
    **{name: (_GPT2,) for name in ("gpt-2", "gpt2", "mpt", "olmo", "jais", "phi-2",
                                    "roberta-bpe")},
    **{name: (_LLAMA3,) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx",
                                      "smaug-bpe")},
    **{name: (_QWEN2,) for name in ("qwen2", "stablelm2", "megrez", "deepseek-r1-qwen")},
    **{name: (r"\p{N}", _GPT2) for name in ("smollm", "starcoder", "refact", "command-r",
                                             "codeshell", "exaone", "minerva-7b")},
}
# pre-tokenizers whose vocabularies take a word that is a token whole, and give prompts a BOS
WHOLE_WORDS = {"llama3", "llama-v3", "llama-bpe", "falcon3"}


@dataclass
class GGUFVocab:
    """What a GGUF file says about its text side: the built tokenizer and its special ids."""

    tokenizer: Any  # tokenizers.Tokenizer
    bos_id: Optional[int]
    eos_id: Optional[int]
    add_bos: bool
    add_eos: bool
    chat_template: Optional[str]
    tokens: Dict[str, str]  # bos_token, eos_token, unk_token, pad_token: their texts


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("reading a GGUF file's tokenizer needs the 'tokenizers' package "
                             "(pip install 'mdiedge[hf]')") from None
    return tokenizers


def _field(meta: Dict[str, Any], path: Path, name: str, size: int) -> List[Any]:
    """The array ``tokenizer.ggml.<name>``, one entry per token ([] when absent)."""
    found = meta.get("tokenizer.ggml." + name, [])
    if not isinstance(found, list) or (found and len(found) != size):
        raise TokenizerError(f"{path}: tokenizer.ggml.{name} has "
                             f"{len(found) if isinstance(found, list) else found!r} entries "
                             f"for {size} tokens")
    return found


def _added(tokens: List[str], types: List[int]) -> Tuple[List[str], List[str]]:
    """The special tokens (CONTROL, UNKNOWN) and the added ones (USER_DEFINED)."""
    special = [t for t, k in zip(tokens, types) if k in (TYPE_CONTROL, TYPE_UNKNOWN)]
    added = [t for t, k in zip(tokens, types) if k == TYPE_USER_DEFINED]
    return special, added


def _byte_level(meta: Dict[str, Any], path: Path, tokens: List[str], keep: set) -> Any:
    """A ``gpt2`` vocabulary: byte-level BPE, split as its ``pre`` says. ``keep``: tokens
    matched whole in the text, left as the file spells them."""
    tk = _tokenizers()
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise TokenizerError(f"{path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer "
                             f"mdiedge knows (known: {', '.join(sorted(PRE_SPLITS))})")
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise TokenizerError(f"{path}: a 'gpt2' vocabulary without tokenizer.ggml.merges")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        raise TokenizerError(f"{path}: tokenizer.ggml.merges entry {bad!r} is not two tokens")
    alphabet = set(tk.pre_tokenizers.ByteLevel.alphabet())
    vocab = {(t if t in keep or set(t) <= alphabet else _spell_bytes(t)): i
             for i, t in enumerate(tokens)}
    tok = tk.Tokenizer(tk.models.BPE(vocab, pairs, ignore_merges=pre in WHOLE_WORDS))
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence(
        [tk.pre_tokenizers.Split(tk.Regex(r), behavior="isolated") for r in PRE_SPLITS[pre]]
        + [tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = tk.decoders.ByteLevel()
    return tok


def _spell_bytes(token: str) -> str:
    """``token`` in the byte-level alphabet: GPT-2's printable stand-in for each byte."""
    table = _byte_chars()
    return "".join(table[b] for b in token.encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_chars() -> Dict[int, str]:
    """GPT-2's byte to character map: printable bytes stand for themselves, the others for
    the characters from 256 on, in byte order."""
    kept = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE]
    extra = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def _spm_facts(meta: Dict[str, Any], path: Path, tokens: List[str]
               ) -> Tuple[List[float], Optional[int], bool]:
    """A ``llama`` vocabulary's scores (all 0 where absent), unknown token's id (None where
    the file's is not a token) and whether a space goes before the text."""
    scores = _field(meta, path, "scores", len(tokens)) or [0.0] * len(tokens)
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
    unk_id = unk if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    return scores, unk_id, bool(meta.get("tokenizer.ggml.add_space_prefix", True))


def _sentencepiece(meta: Dict[str, Any], path: Path, tokens: List[str], keep: set) -> Any:
    """A ``llama`` vocabulary: SentencePiece BPE with byte fallback and, when the file's
    ``add_space_prefix`` (absent: true) says so, a space before the text."""
    tk = _tokenizers()
    scores, unk_id, prefix = _spm_facts(meta, path, tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = tk.Tokenizer(tk.models.BPE(vocab, _score_merges(tokens, scores, vocab, keep),
                                     unk_token=None if unk_id is None else tokens[unk_id],
                                     fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [tk.decoders.Replace("\u2581", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    tok.decoder = tk.decoders.Sequence(steps + ([tk.decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _score_merges(tokens: List[str], scores: List[float], vocab: Dict[str, int],
                  keep: set) -> List[Tuple[str, str]]:
    """Every split of a token into two tokens, best result first: by its score, then longer
    left and right parts first, then file order (SentencePiece merges the best-scoring pair)."""
    found = []
    for token, score in zip(tokens, scores):
        if token in keep:
            continue
        local = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab
                 and token[:i] not in keep and token[i:] not in keep]
        local.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found.extend((score, len(left), len(right), left, right) for left, right in local)
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(m[3], m[4]) for m in found]


BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}


def _special_id(meta: Dict[str, Any], path: Path, name: str, size: int,
                default: Optional[int]) -> Optional[int]:
    """``tokenizer.ggml.<name>_token_id``, else ``default``; one inside the vocabulary."""
    found = meta.get(f"tokenizer.ggml.{name}_token_id", default)
    if found is not None and not (isinstance(found, int) and 0 <= found < size):
        raise TokenizerError(f"{path}: tokenizer.ggml.{name}_token_id {found!r} is not a token "
                             f"of the {size}-token vocabulary")
    return found


def _vocab_tokens(meta: Dict[str, Any], path: Path) -> List[str]:
    model = meta.get("tokenizer.ggml.model")
    if model not in BUILDERS:
        raise TokenizerError(f"{path}: tokenizer.ggml.model {model!r} is not a vocabulary "
                             f"mdiedge reads (known: {', '.join(MODELS)})")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
        raise TokenizerError(f"{path}: no tokenizer.ggml.tokens (a list of strings)")
    return tokens


def _check_size(path: Path, size: int, tokens: List[str]) -> None:
    if size != len(tokens):
        raise TokenizerError(f"{path}: the vocabulary has {size} distinct "
                             f"tokens, tokenizer.ggml.tokens {len(tokens)}")


def full_tokenizer(meta: Dict[str, Any], path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` that the metadata ``meta`` of ``path`` describes (for a
    ``llama`` vocabulary, what ``build_tokenizer`` builds only for the grammars' use)."""
    tokens = _vocab_tokens(meta, path)
    special, added = _added(tokens, _field(meta, path, "token_type", len(tokens)))
    tok = BUILDERS[meta["tokenizer.ggml.model"]](meta, path, tokens, set(special) | set(added))
    tk = _tokenizers()
    if special:
        tok.add_special_tokens([tk.AddedToken(t, normalized=False, special=True)
                                for t in special])
    if added:
        tok.add_tokens([tk.AddedToken(t, normalized=False, special=False) for t in added])
    _check_size(path, tok.get_vocab_size(), tokens)
    return tok


def build_tokenizer(meta: Dict[str, Any], path: Path) -> Any:
    """The tokenizer that the metadata ``meta`` of ``path`` describes: ``full_tokenizer``'s,
    but a ``llama`` vocabulary's in Python (``spmbpe.SpmBpe``: the same ids, none of the
    merge table's time and memory)."""
    tokens = _vocab_tokens(meta, path)
    if meta["tokenizer.ggml.model"] != "llama":
        return full_tokenizer(meta, path)
    special, added = _added(tokens, _field(meta, path, "token_type", len(tokens)))
    scores, unk_id, prefix = _spm_facts(meta, path, tokens)
    built = SpmBpe(tokens, scores, special + added, unk_id, prefix,
                   lambda: full_tokenizer(meta, path))
    _check_size(path, len(built.ids), tokens)
    return built


def _special_ids(meta: Dict[str, Any], path: Path) -> Dict[str, Optional[int]]:
    """The ids of the bos, eos, unk and pad tokens (llama.cpp's defaults for a ``llama``
    vocabulary: <s> 1, </s> 2)."""
    spm = meta.get("tokenizer.ggml.model") == "llama"
    size = len(meta.get("tokenizer.ggml.tokens") or [])
    return {"bos": _special_id(meta, path, "bos", size, 1 if spm else None),
            "eos": _special_id(meta, path, "eos", size, 2 if spm else None),
            "unk": _special_id(meta, path, "unknown", size, None),
            "pad": _special_id(meta, path, "padding", size, None)}


def _chat(meta: Dict[str, Any], ids: Dict[str, Optional[int]]) -> Dict[str, Any]:
    """The chat template and the texts of the special tokens, as ``load_model_template``."""
    template = meta.get("tokenizer.chat_template")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return {"template": template if isinstance(template, str) and template else None,
            **{f"{k}_token": tokens[v] for k, v in ids.items() if v is not None}}


def read_chat(meta: Dict[str, Any], path: Path) -> Dict[str, Any]:
    """The chat template (None when it has none) and special tokens' texts that the metadata
    ``meta`` of the GGUF file ``path`` holds."""
    return _chat(meta, _special_ids(meta, path))


def read_vocab(meta: Dict[str, Any], path: Path) -> GGUFVocab:
    """The tokenizer, special ids and prompt flags that the metadata ``meta`` of the GGUF
    file ``path`` holds (its string arrays read: ``ModelFile.vocab``): BOS before a prompt as
    ``add_bos_token`` says, else for a ``llama`` vocabulary and the pre-tokenizers of
    ``WHOLE_WORDS``; EOS after it only when ``add_eos_token`` says so."""
    tok = build_tokenizer(meta, path)
    ids = _special_ids(meta, path)
    whole = meta.get("tokenizer.ggml.pre") in WHOLE_WORDS
    add = {"bos": bool(meta.get("tokenizer.ggml.add_bos_token",
                                meta["tokenizer.ggml.model"] == "llama" or whole)),
           "eos": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    for key, wanted in add.items():
        if wanted and ids[key] is None:
            raise TokenizerError(f"{path}: tokenizer.ggml.add_{key}_token is true but the file "
                                 f"names no {key} token")
    chat = _chat(meta, ids)
    return GGUFVocab(tok, ids["bos"], ids["eos"], add["bos"], add["eos"],
                     chat.pop("template"), chat)
