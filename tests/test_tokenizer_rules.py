"""The special tokens a prompt gets come from its tokenizer (``mdiedge.model.tokenizer``):
the decision table, each tokenizer kind, special tokens typed in a prompt, chat templates."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

from mdiedge.base.errors import TokenizerError
from mdiedge.model.tokenizer import PromptRule, load_tokenizer, prompt_rule

NANOLLAMA = Path(__file__).resolve().parent.parent / "models" / "nanollama"
IDS = {"bos": 1, "eos": 2}


@pytest.mark.parametrize("config, own_bos, expected", [
    ({}, True, PromptRule(1, None)),  # a SentencePiece model alone: its BOS
    ({}, None, None),  # a tokenizer.json alone: its post-processor decides
    ({"add_bos_token": False}, True, PromptRule(None, None)),
    ({"add_bos_token": False}, None, PromptRule(None, None)),
    ({"add_bos_token": True}, None, PromptRule(1, None)),
    ({"add_eos_token": True}, True, PromptRule(None, 2)),  # naming one flag: the other is off
    ({"add_bos_token": True, "add_eos_token": True}, None, PromptRule(1, 2)),
    ({"add_bos_token": None}, True, PromptRule(None, None)),
])
def test_the_rule_table(config: Dict[str, Any], own_bos: Optional[bool],
                        expected: Optional[PromptRule]) -> None:
    assert prompt_rule(config, IDS, own_bos) == expected


def test_a_flag_for_a_token_the_vocabulary_lacks_is_one_line() -> None:
    config = {"add_bos_token": True, "bos_token": "<start>"}
    with pytest.raises(TokenizerError, match="add_bos_token is true but its bos_token '<start>'"):
        prompt_rule(config, {"bos": None, "eos": 2}, None)


def _nanollama_copy(folder: Path, **config: Any) -> Path:
    for name in ("config.json", "tokenizer.model"):
        shutil.copy(NANOLLAMA / name, folder / name)
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_nanollama_prompts_get_no_bos_as_it_was_trained() -> None:
    tok = load_tokenizer(NANOLLAMA)
    assert tok.bos_id == 1 and not tok.adds_bos
    assert tok.encode_prompt("ROMEO:") == tok.encode("ROMEO:") == list(tok.sp.encode("ROMEO:"))


def test_a_sentencepiece_model_alone_adds_its_bos(tmp_path: Path) -> None:
    tok = load_tokenizer(_nanollama_copy(tmp_path))
    assert tok.adds_bos and tok.encode_prompt("ROMEO:") == [1] + list(tok.sp.encode("ROMEO:"))


def test_tokenizer_config_flags_decide(tmp_path: Path) -> None:
    tok = load_tokenizer(_nanollama_copy(tmp_path, add_eos_token=True, eos_token="</s>"))
    assert tok.encode_prompt("hi") == list(tok.sp.encode("hi")) + [2]


@pytest.mark.parametrize("text, pieces", [
    ("<s>x", ["<s>", "▁", "x"]),
    ("hello <s> world</s>", None),
    ("x <unk> y", None),
    ("<s><s>", ["<s>", "<s>"]),
])
def test_sentencepiece_special_tokens_typed_in_a_prompt_are_those_tokens(
        text: str, pieces: Any) -> None:
    tok = load_tokenizer(NANOLLAMA)
    ids = tok.encode(text)
    named = [tok.sp.id_to_piece(i) for i in ids]
    for special in ("<s>", "</s>", "<unk>"):
        assert named.count(special) == text.count(special)
    if pieces is not None:
        assert named == pieces
    # the text between them is encoded as SentencePiece encodes it alone
    assert [i for i in ids if i > 2] == [i for part in
                                         text.replace("</s>", "\0").replace("<s>", "\0")
                                         .replace("<unk>", "\0").split("\0")
                                         for i in tok.sp.encode(part) if part]


def test_llama2c_keeps_its_bos(request: Any) -> None:
    from conftest import stories_dir
    from mdiedge.engine.engine import TextModel

    folder = stories_dir()
    text = TextModel(folder / "stories260K.bin", folder / "tok512.model")
    assert text.encode_prompt("Once upon a time")[0] == 1
    assert text.encode_prompt("Once upon a time")[1:] == text.tokenizer.encode("Once upon a time")


def test_an_empty_prompt_starts_from_bos_alone() -> None:
    from mdiedge.engine.engine import TextModel

    assert TextModel(NANOLLAMA).encode_prompt("") == [1]


def test_a_templated_prompt_gets_nothing_added(tmp_path: Path) -> None:
    from mdiedge.engine.engine import TextModel

    text = TextModel(_nanollama_copy(tmp_path))  # a tokenizer that adds BOS to prompts
    assert text.encode_prompt("<s>USER:\nhi", templated=True) == text.tokenizer.encode(
        "<s>USER:\nhi")
    assert text.encode_prompt("<s>USER:\nhi")[:2] == [1, 1]  # typed, plus the rule's


def test_the_default_template_writes_bos_only_where_prompts_get_one(tmp_path: Path) -> None:
    from mdiedge.serving.api.chat import ChatTemplate
    from mdiedge.serving.api.schema import ChatMessage

    message = [ChatMessage("user", "hi")]
    assert ChatTemplate.for_model(NANOLLAMA, load_tokenizer(NANOLLAMA)).render(message) == \
        "USER:\nhi\n\nASSISTANT:\n"
    folder = _nanollama_copy(tmp_path)
    assert ChatTemplate.for_model(folder, load_tokenizer(folder)).render(message) == \
        "<s>USER:\nhi\n\nASSISTANT:\n"


def test_a_tokenizer_config_that_is_not_json_is_one_line(tmp_path: Path) -> None:
    folder = _nanollama_copy(tmp_path)
    (folder / "tokenizer_config.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not a JSON file"):
        load_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="expected a JSON object, got list"):
        load_tokenizer(folder)
