"""The stream decoder: the text increments of a growing list of ids, decoded through a window
rather than from the start each time, equal to decoding every id each time (every increment,
for random ids and for real text with multi-byte characters), at a cost per token that does
not grow with the text."""
from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdiedge.model.tokenizer import (HFTokenizer, SentencePieceTokenizer, StreamDecoder,
                                     Tokenizer)

REPO = Path(__file__).resolve().parents[1]
TOKENIZERS = {"nanollama": REPO / "models" / "nanollama" / "tokenizer.model",
              "stories260k": REPO / "tests" / "data" / "stories260k" / "tok512.model"}


CORPUS = ["ROMEO: Où est-il? 北京 — naïve café, 🙂 and again.",
          "the cat sat on the mat and then it ran away.",
          "plain words after plain words, with  two spaces and a new\nline"] * 20
HF_KINDS = ("hf-bytelevel", "hf-metaspace")  # GPT-2's byte-level BPE; Llama 2's "▁" pieces


def hf_tokenizer(kind: str, folder: Path) -> Tokenizer:
    """A small Hugging Face ``tokenizer.json`` of ``kind``, trained here."""
    tokenizers = pytest.importorskip("tokenizers")
    make = (tokenizers.ByteLevelBPETokenizer if kind == "hf-bytelevel"
            else tokenizers.SentencePieceBPETokenizer)
    trained = make()
    trained.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1, show_progress=False)
    trained.save(str(folder / "tokenizer.json"))
    return HFTokenizer(folder / "tokenizer.json")


@pytest.fixture(scope="module", params=sorted(TOKENIZERS) + list(HF_KINDS))
def tokenizer(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param in HF_KINDS:
        return hf_tokenizer(request.param, tmp_path_factory.mktemp(request.param))
    path = TOKENIZERS[request.param]
    if not path.is_file():
        pytest.skip(f"{path} not here")
    return SentencePieceTokenizer(path)


def decode_all_each_time(tokenizer: Tokenizer, prefix: Sequence[int],
                         ids: Sequence[int]) -> List[str]:
    """The reference: every id decoded again at each token, the text past what was emitted
    (nothing while the text ends in an incomplete character)."""
    out, emitted, seen = [], len(tokenizer.decode(prefix)), list(prefix)
    for token in ids:
        seen.append(token)
        text = tokenizer.decode(seen)
        if text.endswith("\ufffd") or len(text) <= emitted:
            out.append("")
            continue
        out.append(text[emitted:])
        emitted = len(text)
    return out


def pushes(tokenizer: Tokenizer, prefix: Sequence[int], ids: Sequence[int]) -> List[str]:
    decoder = StreamDecoder(tokenizer, prefix)
    return [decoder.push(t) for t in ids]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_ids_give_the_increments_of_decoding_everything(tokenizer: Tokenizer,
                                                               data: st.DataObject) -> None:
    top = tokenizer.vocab_size - 1  # special ids and byte pieces are the low ones
    ids = st.one_of(st.integers(0, 8), st.integers(0, min(270, top)), st.integers(0, top))
    prefix = data.draw(st.lists(ids, max_size=12), label="prefix")
    new = data.draw(st.lists(ids, min_size=1, max_size=40), label="new")
    assert pushes(tokenizer, prefix, new) == decode_all_each_time(tokenizer, prefix, new)


def test_a_space_piece_first_in_the_window_keeps_its_space() -> None:
    """Found by Hypothesis: after an unknown id and a lone space piece, the next piece's
    space is the whole text's, which a window starting at the space piece would strip."""
    tokenizer = SentencePieceTokenizer(TOKENIZERS["stories260k"])
    got = pushes(tokenizer, [], [0, 410, 390])
    assert got == decode_all_each_time(tokenizer, [], [0, 410, 390])
    assert got[-1] == " nam"


@pytest.mark.parametrize("text", [
    "ROMEO: Où est-il? 北京 — naïve café, 🙂 and again 🙂🙂.",
    "plain words after plain words, with  two spaces and a new\nline",
])
@pytest.mark.parametrize("prompt", ["", "The end of it.", "x"])
def test_real_text_comes_back_whole(tokenizer: Tokenizer, text: str, prompt: str) -> None:
    prefix, ids = tokenizer.encode(prompt), tokenizer.encode(text)
    got = pushes(tokenizer, prefix, ids)
    assert got == decode_all_each_time(tokenizer, prefix, ids)
    whole = tokenizer.decode(prefix + ids)
    assert "".join(got) == whole[len(tokenizer.decode(prefix)):]


class Counting(Tokenizer):
    """A tokenizer that records how many ids each decode was given."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.lengths = inner, []  # type: ignore[var-annotated]

    def decode(self, ids: Sequence[int]) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids)


def test_a_token_decodes_a_few_ids_however_long_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the cat sat on the mat and then it ran away. " * 40)
    assert len(ids) > 400
    counting = Counting(tokenizer)
    decoder = StreamDecoder(counting, ids[:10])
    counting.lengths.clear()
    text = "".join(decoder.push(t) for t in ids[10:])
    assert text == tokenizer.decode(ids)[len(tokenizer.decode(ids[:10])):]
    assert max(counting.lengths) <= 2 * StreamDecoder.CONTEXT + 2
    assert len(counting.lengths) <= 1.2 * len(ids[10:])  # one decode a token, and the window's
