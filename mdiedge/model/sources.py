"""Torch-free tensor sources reading numpy arrays (``get_array``; ``get`` wraps them as tensors):
safetensors (``SafetensorsArrays``) and llama2.c (``Llama2cSource``); GGUF's is torch-free too."""
from __future__ import annotations

import json
import math
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..base.dtypes import BY_SAFETENSORS
from ..base.errors import CheckpointError
from .config import read_json
from .modelfile import LLAMA2C_HEADER, llama2c_config
from .tensors import BLOCK_NAMES, GLOBAL_NAMES, TensorSource

if TYPE_CHECKING:
    from torch import Tensor

_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
QTYPE_KEY = "mdiedge.qtype."  # + a tensor's name: the block type a chunk keeps it in
_NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def regular_file_size(file: Path) -> int:
    """A FIFO or device would block a read."""
    try:
        info = file.stat()
    except OSError:
        raise CheckpointError(f"{file}: file not found") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{file}: not a regular file")
    return info.st_size



class SafetensorsArrays(TensorSource):
    """Our own header parse, tensors read as numpy with ``readinto`` (no memory map, so the file's
    pages never count in RSS); F16 and BF16 widened to float32."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._headers: Dict[Path, Dict[str, Any]] = {}
        self._data_start: Dict[Path, int] = {}
        self._files: Dict[Path, BinaryIO] = {}
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: missing 'weight_map'")
            self.file_of = {k: path / v for k, v in weight_map.items()}
        else:
            single = path / "model.safetensors"
            self.file_of = {k: single for k in self._header(single) if k != "__metadata__"}

    def names(self) -> Sequence[str]:
        return list(self.file_of)

    def qtype(self, name: str) -> str:
        """A pushed chunk's block type of ``name`` (``QTYPE_KEY`` metadata), else "F32"."""
        if name not in self.file_of:  # missing: the float read names it
            return "F32"
        meta = self._header(self.file_of[name]).get("__metadata__")
        found = meta.get(QTYPE_KEY + name) if isinstance(meta, dict) else None
        return str(found) if isinstance(found, str) else "F32"

    def shape(self, name: str) -> Optional[Tuple[int, ...]]:
        if name not in self.file_of or self.qtype(name) != "F32":
            return None
        return self._array_entry(name)[2]

    def stored_bytes(self, name: str) -> Optional[int]:
        return self._array_entry(name)[4] if name in self.file_of else None

    def _array_entry(self, name: str) -> Tuple[Path, str, Tuple[int, ...], int, int]:
        """File, dtype tag, shape, start and size in bytes, all checked."""
        file = self.file_of[name]
        entry = self._header(file).get(name)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{file}: header has no entry for tensor {name!r}")
        dtype = BY_SAFETENSORS.get(entry.get("dtype"))  # type: ignore[arg-type]
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if dtype is None or not isinstance(shape, list) or not isinstance(offsets, list) \
                or len(offsets) != 2 or not all(isinstance(n, int) and n >= 0
                                                for n in shape + offsets):
            raise CheckpointError(f"{file}: bad header entry for tensor {name!r}: {entry!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(f"{file}: tensor {name!r} spans {offsets[1] - offsets[0]} "
                                  f"bytes, expected {nbytes}")
        return file, dtype.safetensors, tuple(shape), self._data_start[file] + offsets[0], nbytes

    def _bytes(self, name: str) -> Tuple[np.ndarray, str, Tuple[int, ...]]:
        file, tag, shape, start, nbytes = self._array_entry(name)
        fh = self._files.get(file)
        if fh is None:
            fh = self._files[file] = open(file, "rb")
        fh.seek(start)
        data = np.empty(nbytes, np.uint8)
        got = fh.readinto(memoryview(data)) if nbytes else 0
        if got != nbytes:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} (file truncated: "
                                  f"{got} of {nbytes} bytes)")
        return data, tag, shape

    def read_array(self, name: str) -> np.ndarray:
        """Float32, BF16 widened by shifting."""
        data, tag, shape = self._bytes(name)
        if tag == "BF16":
            values = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif tag in _NUMPY:
            values = data.view(_NUMPY[tag]).astype(np.float32)
        else:
            raise CheckpointError(f"{self.path}: tensor {name!r} is {tag}, not a float")
        return values.reshape(shape)

    def get_array(self, name: str) -> np.ndarray:
        self.read_names.append(name)
        if self.qtype(name) != "F32":  # a pushed chunk's blocks, for a float read
            from .qtypes import dequantize_array, qtype_of

            raw, t = self.raw_array(name), qtype_of(self.qtype(name))
            return dequantize_array(raw, t.name, raw.shape[1] // t.block_bytes * t.block)
        return self.read_array(name)

    def raw_array(self, name: str) -> np.ndarray:
        """uint8 (rows, bytes per row)."""
        data, tag, shape = self._bytes(name)
        if tag != "U8" or len(shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {name!r} of {self.qtype(name)} blocks "
                                  f"has {tuple(shape)} {tag}, not whole uint8 blocks")
        return data.reshape(shape)

    def _header(self, file: Path) -> Dict[str, Any]:
        """8-byte little-endian length, then JSON, checked against the file's size so a truncated
        file fails before any read."""
        if file not in self._headers:
            size = regular_file_size(file)
            with open(file, "rb") as fh:
                prefix = fh.read(8)
                length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
                if not 0 < length <= min(size - 8, _MAX_HEADER_BYTES):
                    raise CheckpointError(f"{file}: not a readable safetensors file (header "
                                          f"length {length}, file size {size})")
                try:
                    header = json.loads(fh.read(length))
                except ValueError as e:
                    raise CheckpointError(f"{file}: not a readable safetensors file "
                                          f"({e})") from None
                except RecursionError:
                    raise CheckpointError(f"{file}: not a readable safetensors file (its "
                                          f"header is nested too deeply)") from None
            if not isinstance(header, dict):
                raise CheckpointError(f"{file}: not a readable safetensors file (header is "
                                      f"not an object)")
            data_end = max((e["data_offsets"][1] for e in header.values() if isinstance(e, dict)
                            and isinstance(e.get("data_offsets"), list)
                            and len(e["data_offsets"]) == 2
                            and isinstance(e["data_offsets"][1], int)), default=0)
            if 8 + length + data_end > size:
                raise CheckpointError(f"{file}: not a readable safetensors file (truncated: "
                                      f"its tensors end at byte {8 + length + data_end}, the "
                                      f"file has {size})")
            self._headers[file], self._data_start[file] = header, 8 + length
        return self._headers[file]

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()


def _llama2c_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Interleaved RoPE rows to rotate-half rows, as Hugging Face's converter does."""
    rows, cols = w.shape
    grouped = w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(grouped).reshape(rows, cols)


class Llama2cSource(TensorSource):
    """A llama2.c "legacy" (version 0) file under Hugging Face names."""

    HEADER = LLAMA2C_HEADER

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.cfg = llama2c_config(path)
        cfg = self.cfg
        d, h, n, kv, v = cfg.dim, cfg.intermediate_size, cfg.n_layers, cfg.kv_dim, cfg.vocab_size
        half_head = cfg.head_dim // 2
        layout: List[Tuple[str, Tuple[int, ...]]] = [
            ("embed", (v, d)), ("attn_norm", (n, d)), ("wq", (n, d, d)), ("wk", (n, kv, d)),
            ("wv", (n, kv, d)), ("wo", (n, d, d)), ("mlp_norm", (n, d)), ("gate", (n, h, d)),
            ("down", (n, d, h)), ("up", (n, h, d)), ("norm", (d,)),
            ("rope_real", (cfg.max_seq_len, half_head)),
            ("rope_imag", (cfg.max_seq_len, half_head)),
        ]
        if not cfg.tie_embeddings:
            layout.append(("lm_head", (v, d)))
        offset = self.HEADER.size
        self.arrays: Dict[str, Tuple[int, Tuple[int, ...]]] = {}
        for key, shape in layout:
            self.arrays[key] = (offset, shape)
            offset += 4 * int(np.prod(shape))
        size = path.stat().st_size
        if size < offset:
            raise CheckpointError(f"{path}: truncated llama2.c file ({size} bytes, the header "
                                  f"implies {offset})")
        self.map = np.memmap(path, dtype="<f4", mode="r")
        hf = {"embed": GLOBAL_NAMES["embed.weight"], "norm": GLOBAL_NAMES["norm.weight"],
              "lm_head": GLOBAL_NAMES["lm_head.weight"]}
        self.index: Dict[str, Tuple[str, Optional[int]]] = {
            name: (key, None) for key, name in hf.items() if key in self.arrays}
        per_layer = {"attn_norm": "attn_norm.weight", "wq": "attn.wq.weight",
                     "wk": "attn.wk.weight", "wv": "attn.wv.weight", "wo": "attn.wo.weight",
                     "mlp_norm": "mlp_norm.weight", "gate": "mlp.gate.weight",
                     "down": "mlp.down.weight", "up": "mlp.up.weight"}
        for key, ours in per_layer.items():
            for i in range(n):
                self.index[f"model.layers.{i}.{BLOCK_NAMES[ours]}"] = (key, i)

    def names(self) -> Sequence[str]:
        return list(self.index)

    def _read(self, name: str) -> Tensor:
        import torch

        return torch.from_numpy(self.read_array(name))

    def get_array(self, name: str) -> np.ndarray:
        self.read_names.append(name)
        return self.read_array(name)

    def read_array(self, name: str) -> np.ndarray:
        key, layer = self.index[name]
        offset, shape = self.arrays[key]
        if layer is not None:
            shape = shape[1:]
            offset += 4 * layer * int(np.prod(shape))
        start = offset // 4
        count = int(np.prod(shape))
        t = np.array(self.map[start: start + count], dtype=np.float32).reshape(shape)
        if key == "wq":
            t = _llama2c_permute(t, self.cfg.n_heads)
        elif key == "wk":
            t = _llama2c_permute(t, self.cfg.n_kv_heads)
        return t
