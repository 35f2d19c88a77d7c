"""Models checked before memory is spent, through the CLI as an operator meets them: copies of
the shipped NanoLlama with one thing corrupted each (a config naming 10^9 blocks, huge or
mismatched widths, NaN norms, a negative RoPE base, token ids out of the vocabulary, a
config of random bytes or nested 200,000 deep, a FIFO in its place, NaN or infinite
weights), a tokenizer larger than the model's vocabulary, and a model that needs more memory
than the machine has: each is one line, a non-zero exit, no traceback, within seconds."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
from commands import MDIEDGE

REPO = Path(__file__).resolve().parent.parent
NANO = REPO / "models" / "nanollama"
STORIES = REPO / "tests" / "data" / "stories260k"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.model",
         "tokenizer_config.json")


def _copy(folder: Path) -> Path:
    folder.mkdir()
    for name in FILES:
        if name == "model.safetensors":  # 17 MB: linked, never written to
            os.symlink(NANO / name, folder / name)
        else:
            shutil.copy(NANO / name, folder / name)
    return folder


def _config(**changes: object) -> Callable[[Path], None]:
    def corrupt(folder: Path) -> None:
        config = json.loads((NANO / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return corrupt


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    def corrupt(folder: Path) -> None:
        (folder / name).unlink()  # never through the link to the shipped weights
        (folder / name).write_bytes(data)
    return corrupt


def _replace(name: str, old: str, new: str) -> Callable[[Path], None]:
    def corrupt(folder: Path) -> None:
        text = (NANO / name).read_text()
        assert old in text
        (folder / name).write_text(text.replace(old, new))
    return corrupt


def _fifo(folder: Path) -> None:
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")


def _weight(tensor: str, value: float) -> Callable[[Path], None]:
    def corrupt(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(NANO / "model.safetensors"))
        tensors[tensor] = tensors[tensor].clone()
        tensors[tensor].view(-1)[5] = value
        (folder / "model.safetensors").unlink()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return corrupt


CASES: Dict[str, Tuple[Callable[[Path], None], str]] = {
    "layers-1e9": (_config(num_hidden_layers=10 ** 9),
                   "num_hidden_layers = 1000000000, but the checkpoint holds blocks 0..11 (12)"),
    "layers-13": (_config(num_hidden_layers=13),
                  "num_hidden_layers = 13, but the checkpoint holds blocks 0..11 (12)"),
    "hidden-1e6": (_config(hidden_size=10 ** 6, head_dim=125000),
                   "'model.embed_tokens.weight' has shape (2048, 256), expected (2048, 1000000)"),
    "vocab-1e9": (_config(vocab_size=10 ** 9),
                  "'model.embed_tokens.weight' has shape (2048, 256), expected (1000000000, 256)"),
    "intermediate-1e8": (_config(intermediate_size=10 ** 8),
                         "'model.layers.0.mlp.gate_proj.weight' has shape (688, 256), expected "
                         "(100000000, 256)"),
    "eps-nan": (_replace("config.json", '"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'),
                "rms_norm_eps must be a positive finite number, got nan"),
    "eps-0": (_config(rms_norm_eps=0), "rms_norm_eps must be a positive finite number, got 0"),
    "theta-negative": (_config(rope_theta=-1),
                       "rope_theta must be a positive finite number, got -1"),
    "theta-nan": (_replace("config.json", '"rope_theta": 10000.0', '"rope_theta": NaN'),
                  "rope_theta must be a positive finite number, got nan"),
    "bos-negative": (_write("generation_config.json", b'{"bos_token_id": -5, "eos_token_id": 2}'),
                     "generation_config.json: bos_token_id -5 is not a token of the vocabulary "
                     "(0..2047)"),
    "eos-1e12": (_write("generation_config.json",
                        b'{"bos_token_id": 1, "eos_token_id": 1000000000000}'),
                 "generation_config.json: eos_token_id 1000000000000 is not a token"),
    "eos-string": (_write("generation_config.json", b'{"eos_token_id": "x"}'),
                   "generation_config.json: eos_token_id must be a token id (an integer) or a "
                   "list of them, got 'x'"),
    "random-bytes": (_write("config.json", bytes(range(128, 256)) * 32),
                     "config.json: not a JSON file (not UTF-8 text: byte 0)"),
    "nested-lists": (_write("config.json", b"[" * 200000 + b"]" * 200000),
                     "config.json: invalid JSON (nested too deeply)"),
    "nested-objects": (_write("config.json", b'{"a":' * 100000 + b"1" + b"}" * 100000),
                       "config.json: invalid JSON (nested too deeply)"),
    "fifo": (_fifo, "config.json: not a regular file"),
    "nested-weights-header": (_write("model.safetensors",
                                     struct.pack("<Q", 200000) + b"[" * 200000),
                              "model.safetensors: not a readable safetensors file (its header "
                              "is nested too deeply)"),
    "nan-weight": (_weight("model.layers.3.mlp.up_proj.weight", float("nan")),
                   "tensor 'model.layers.3.mlp.up_proj.weight' holds nan (a weight that is not "
                   "a finite number)"),
    "inf-norm": (_weight("model.norm.weight", float("inf")),
                 "tensor 'model.norm.weight' holds inf (a weight that is not a finite number)"),
}


def _generate(args: List[str], timeout: float = 120) -> Tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.monotonic()
    out = subprocess.run([*MDIEDGE, "generate", "ROMEO:", "-n", "4",
                          "--temperature", "0", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return out, time.monotonic() - started


def _one_line(out: subprocess.CompletedProcess, message: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and out.stdout == "", (out.returncode, out.stdout, out.stderr)
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith("mdiedge: error: ") and message in lines[0], lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_corrupt_model_directory_is_one_line(case: str, tmp_path: Path) -> None:
    corrupt, message = CASES[case]
    folder = _copy(tmp_path / case)
    corrupt(folder)
    out, seconds = _generate(["--model", str(folder), "--nodes", "1"])
    _one_line(out, message)
    assert seconds < 60, f"{seconds:.0f} s"


@pytest.mark.slow
def test_a_config_of_1e9_blocks_fails_before_any_worker_starts(tmp_path: Path) -> None:
    folder = _copy(tmp_path / "layers")
    _config(num_hidden_layers=10 ** 9)(folder)
    out, seconds = _generate(["--model", str(folder)])  # a ring of 3: the starter refuses
    _one_line(out, "num_hidden_layers = 1000000000, but the checkpoint holds blocks 0..11")
    assert seconds < 30, f"{seconds:.0f} s: workers were started"


@pytest.mark.slow
def test_nan_weights_on_a_worker_are_one_line_over_the_ring(tmp_path: Path) -> None:
    folder = _copy(tmp_path / "nan")
    _weight("model.layers.10.self_attn.v_proj.weight", float("nan"))(folder)
    out, _ = _generate(["--model", str(folder), "--nodes", "2"])
    _one_line(out, "tensor 'model.layers.10.self_attn.v_proj.weight' holds nan")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused() -> None:
    out, _ = _generate(["--model", str(STORIES / "stories260K.bin"), "--tokenizer",
                        str(NANO / "tokenizer.model"), "--nodes", "1"])
    _one_line(out, "the tokenizer has 2048 tokens, the model's vocabulary 512: not this "
                   "model's tokenizer")


def _sparse_model(folder: Path, blocks: int, width: int) -> None:
    """A consistent model of ``blocks`` blocks of ``width``, its weights a sparse file (no disk
    space, zeros when read): what matters is what its headers say."""
    config = json.loads((NANO / "config.json").read_text())
    config.update(hidden_size=width, intermediate_size=width, num_hidden_layers=blocks,
                  num_attention_heads=width // 64, num_key_value_heads=width // 64, head_dim=64)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("generation_config.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(NANO / name, folder / name)
    shapes = {"model.embed_tokens.weight": [2048, width], "model.norm.weight": [width]}
    for i in range(blocks):
        block = {"input_layernorm": [width], "post_attention_layernorm": [width]}
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            block[name] = [width, width]
        shapes.update({f"model.layers.{i}.{k}.weight": v for k, v in block.items()})
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    data = json.dumps(header).encode()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(data)) + data)
        f.truncate(8 + len(data) + offset)


def test_a_model_larger_than_free_memory_is_refused_before_it_is_built(tmp_path: Path) -> None:
    from mdiedge.base.memory import available_bytes

    free = available_bytes()
    if free is None:
        pytest.skip("free memory unknown on this platform")
    width = 8192
    blocks = free // (7 * width * width * 4) + 2  # more than all of it
    folder = tmp_path / "huge"
    _sparse_model(folder, int(blocks), width)
    out, seconds = _generate(["--model", str(folder), "--nodes", "1"])
    _one_line(out, f"blocks [0, {blocks}), the embedding and the head in float32: ")
    assert "GiB free on this node: use more nodes, --quantize, or a smaller model" in out.stderr
    assert seconds < 60, f"{seconds:.0f} s"


def test_kv_slots_beyond_free_memory_are_refused_before_they_are_allocated() -> None:
    from mdiedge.base.memory import available_bytes

    need = 4096 * 12 * 2 * 64 * 1002 * 4  # slots x blocks x (K, V) x kv_dim x tokens x fp32
    free = available_bytes()
    if free is None or free > need:
        pytest.skip(f"this machine has {free} bytes free, more than the {need} asked for")
    out, seconds = _generate(["--samples", "4096", "-n", "1000", "--nodes", "1"])
    _one_line(out, "a KV cache of 4096 slots x 1002 tokens for blocks [0, 12): 23.48 GiB "
                   "needed, ")
    assert "GiB free on this node: fewer samples (slots) or a shorter context" in out.stderr
    assert seconds < 60, f"{seconds:.0f} s"
