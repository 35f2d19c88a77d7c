"""Bad input gets one clear error naming the file and the key."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from mdiedge.model.checkpoint import load_config, load_model
from mdiedge.base.errors import CheckpointError, ConfigError, GenerationError, MdiedgeError
from mdiedge.base.request import ids_request
from mdiedge.runtime.generation import Generation
from mdiedge.model.sampling import SamplingParams


@pytest.fixture()
def ckpt(tiny_llama: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama, dst)
    return dst


def edit_config(path: Path, change: Callable[[dict], None]) -> None:
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, change: Callable[[dict], None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nowhere: model directory or file not found"):
        load_model(tmp_path / "nowhere")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config.json: file not found"):
        load_model(tmp_path)


@pytest.mark.parametrize("change,message", [
    (lambda c: c.pop("hidden_size"), r"config.json: missing required key 'hidden_size'"),
    (lambda c: c.update(num_hidden_layers="four"),
     r"n_layers must be a positive integer, got 'four'"),
    (lambda c: c.update(model_type="gpt2"), r"unsupported model_type 'gpt2'"),
], ids=["missing-key", "wrong-type", "unsupported-model-type"])
def test_bad_config(ckpt: Path, change: Callable[[dict], None], message: str) -> None:
    edit_config(ckpt, change)
    with pytest.raises(ConfigError, match=message):
        load_config(ckpt)


def test_missing_tensor(ckpt: Path) -> None:
    edit_tensors(ckpt, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.2.mlp.up_proj.weight'"):
        load_model(ckpt)
    load_model(ckpt, layers=(0, 2), head=False)  # a chunk without that layer still loads


def test_wrong_shape(ckpt: Path) -> None:
    edit_tensors(ckpt, lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \(7,\), expected \(32,\)"):
        load_model(ckpt)


def test_dtype_outside_the_table(ckpt: Path) -> None:
    int8 = torch.ones(32, dtype=torch.int8)  # safetensors "I8": not in mdiedge.base.dtypes
    edit_tensors(ckpt, lambda t: t.update({"model.norm.weight": int8}))
    with pytest.raises(CheckpointError, match=r"bad header entry for tensor 'model.norm.weight': "
                                              r".*'dtype': 'I8'"):
        load_model(ckpt)


def test_truncated_safetensors(ckpt: Path) -> None:
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors"):
        load_model(ckpt)


def test_no_weights_file(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model.safetensors"):
        load_model(ckpt)


def test_pytorch_bin_fallback(ckpt: Path, tiny_llama: Path) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    torch.save(tensors, ckpt / "pytorch_model.bin")
    ids, slot = torch.tensor([[1, 5, 9]]), torch.tensor([0])
    a, b = load_model(ckpt), load_model(tiny_llama)
    a.setup_cache(1, 8)
    b.setup_cache(1, 8)
    assert torch.equal(a(ids, slot, [0]), b(ids, slot, [0]))


def test_truncated_llama2c(stories: Path, tmp_path: Path) -> None:
    data = (stories / "stories260K.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:50_000])
    with pytest.raises(CheckpointError, match=r"cut.bin: truncated llama2.c file \(50000 bytes"):
        load_model(tmp_path / "cut.bin")
    (tmp_path / "tiny.bin").write_bytes(data[:10])
    with pytest.raises(CheckpointError, match=r"tiny.bin: truncated llama2.c header"):
        load_model(tmp_path / "tiny.bin")


@pytest.mark.parametrize("chunk_bytes", [16 << 20, 100], ids=["one-chunk", "many-chunks"])
def test_bf16_checkpoint_is_cast_to_fp32(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                         chunk_bytes: int) -> None:
    from mdiedge.model import checkpoint
    from mdiedge.model.checkpoint import hf_state_dict

    monkeypatch.setattr(checkpoint, "READ_CHUNK_BYTES", chunk_bytes)
    edit_tensors(ckpt, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    stored = load_file(str(ckpt / "model.safetensors"))
    model = load_model(ckpt)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for name, tensor in hf_state_dict(model):
        assert torch.equal(tensor, stored[name].float()), name


def test_transformers5_rope_parameters_layout(ckpt: Path) -> None:
    def to_v5(c: dict) -> None:
        c["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32}
        c.pop("rope_theta", None)
        c.pop("rope_scaling", None)
    edit_config(ckpt, to_v5)
    cfg = load_config(ckpt)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None
    assert cfg.rope_scaling.factor == 8.0


def test_eos_list_from_generation_config(ckpt: Path) -> None:
    (ckpt / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 5]}))
    assert load_config(ckpt).eos_ids == (2, 5)


def test_prompt_longer_than_context() -> None:
    with pytest.raises(GenerationError, match=r"prompt of 150 tokens plus 20 new tokens exceeds the context of 160"):
        Generation(ids_request([1] * 150, 20, 1, SamplingParams(temperature=0), 160), (2,))


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-1.0), "temperature: expected a number in [0, 2], got -1.0"),
    (dict(temperature=float("inf")), "temperature: expected a number in [0, 2], got inf"),
    (dict(temperature=float("nan")), "temperature: expected a number in [0, 2], got nan"),
    (dict(temperature=2.5), "temperature: expected a number in [0, 2], got 2.5"),
    (dict(top_p=0.0), "top_p: expected a number in (0, 1], got 0.0"),
    (dict(top_k=-3), "top_k: expected an integer >= 0, got -3"),
    (dict(seed=2 ** 40), "seed: expected an integer in [0, 2**40), got 1099511627776"),
])
def test_bad_sampling_parameters(kwargs: Any, message: str) -> None:
    with pytest.raises(MdiedgeError) as e:
        SamplingParams(**kwargs)
    assert str(e.value) == message
