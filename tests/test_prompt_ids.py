"""A prompt's token ids are transformers' for every tokenizer kind the project loads:
``TextModel(model).encode_prompt(text)`` equals ``tokenizer(text)["input_ids"]`` (its default
``add_special_tokens=True``) over a corpus of prose, code, numbers, emoji, other scripts,
whitespace, and the special tokens of both the Llama and the ChatML families typed in the text
(parsed as those tokens where the tokenizer has them, read as plain text where it has not).

The empty prompt is left out: transformers encodes it to no ids, and a generation needs one
to start from."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

from conftest import TokenizerKind

CORPUS: Dict[str, str] = {
    "prose": "The capital of France is",
    "play": "ROMEO:\nBut soft, what light through yonder window breaks?",
    "code": "def f(x):\n    return {'a': [x * 2, x ** 3]}  # ok\n",
    "numbers": "3.14159, 12345 and 1e-9; 2024-06-01 at 10:30",
    "emoji": "ok 🙂 👩‍👩‍👧 🎉!",
    "scripts": "naïve café — Привет, мир; 東京は晴れ; مرحبا; नमस्ते",
    "whitespace-runs": "a  b   c\t\td\n\n\ne    ",
    "leading-space": " leading space",
    "one-space": " ",
    "one-newline": "\n",
    "spaces-and-tab": "  \t ",
    "one-letter": "x",
    "llama-specials": "<s>hi</s>",
    "llama-specials-inside": "one <s> two</s>three <unk>",
    "chatml-turn": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "chatml-inside": "a<|im_end|>b <|endoftext|> c",
    "near-specials": "<s hi </s <|im_start| <|im_end>",
}


def model_ids(kind: TokenizerKind, text: str) -> List[int]:
    from mdiedge.engine.engine import TextModel

    return TextModel(kind.model, kind.tokenizer).encode_prompt(text)


def reference_ids(kind: TokenizerKind, text: str) -> List[int]:
    return list(kind.reference(text)["input_ids"])


@pytest.mark.parametrize("text", list(CORPUS.values()), ids=list(CORPUS))
def test_prompt_ids_are_transformers(tokenizer_kind: TokenizerKind, text: str) -> None:
    expected = reference_ids(tokenizer_kind, text)
    assert model_ids(tokenizer_kind, text) == expected, (
        f"{tokenizer_kind.name}: {text!r}: transformers' tokens "
        f"{tokenizer_kind.reference.convert_ids_to_tokens(expected)}")


def test_the_kinds_differ_where_the_rule_does(tokenizer_kind: TokenizerKind) -> None:
    """The fixtures cover both rules: a BOS first for the BOS post-processor and llama2.c,
    none for NanoLlama and SmolLM2 (so an engine that always or never adds one fails)."""
    adds_bos: Dict[str, Any] = {"sentencepiece": False, "bpe-without-bos": False,
                                "bpe-with-bos": True, "llama2c": True}
    reference = tokenizer_kind.reference
    first = reference_ids(tokenizer_kind, "Hello")[0]
    assert (first == reference.bos_token_id) is adds_bos[tokenizer_kind.name]
