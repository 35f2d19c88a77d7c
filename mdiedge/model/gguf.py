"""GGUF files (llama.cpp's format): the config from the metadata, the tensors memory-mapped under
Hugging Face names.

Parsing is the ``gguf`` package's, every read bounds-checked (``gguf_checks``) and the vocabulary's
string arrays skipped (the tokenizer reads them); numeric arrays become Python numbers only when
read (``Metadata``). Gemma's RMSNorm weights, stored with ``norm_offset`` added, are answered
without it; Llama's Q and K rows, interleaved by llama.cpp's converter for its RoPE, in Hugging
Face's order."""
from __future__ import annotations

import functools
import re
import struct
import sys
from collections import Counter
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from .gguf_vocab import MAGIC, is_gguf  # noqa: F401 - one magic check, re-exported

from ..base.errors import CheckpointError, ConfigError
from ..base.memory import drop_mapped_pages
from .config import ModelConfig
from .families import by_gguf_architecture, config_from_hf, family_of
from .families.family import Family
from .gguf_checks import (check_count, check_header, check_overlaps, check_tensor_info,
                          header_limit, key_limit, out_of_file, tensor_region, value_limit)
from .tensors import TensorSource, expected_shape, tensor_plan  # noqa: F401

if TYPE_CHECKING:
    from torch import Tensor

PathLike = Union[str, Path]
_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(.+)")
VERSIONS = (2, 3)  # the GGUF versions read (gguf's and llama.cpp's)


def looks_like_gguf(path: Path) -> bool:
    """Its magic, or its name (a damaged ``.gguf`` file gets GGUF's error, not another format's)."""
    return path.suffix.lower() == ".gguf" or is_gguf(path)


def _gguf_package() -> Any:
    """The gguf package without the SentencePiece library its unused ``vocab`` module loads
    (megabytes of resident memory); with it if it cannot import otherwise."""
    blocked = "sentencepiece" not in sys.modules
    if blocked:
        sys.modules["sentencepiece"] = None  # type: ignore[assignment]  # an ImportError
    try:
        import gguf
        return gguf
    except ImportError:
        pass
    finally:
        if blocked and sys.modules.get("sentencepiece", 0) is None:
            del sys.modules["sentencepiece"]
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading GGUF files needs the gguf package: pip install gguf") \
            from None
    return gguf


def _u64(byte_order: str) -> str:
    """The struct format of a length ("I": this host's byte order, "S": swapped)."""
    host = "<" if sys.byteorder == "little" else ">"
    return (host if byte_order == "I" else {"<": ">", ">": "<"}[host]) + "Q"


# GGUF headers parsed by this process, by file: ``ModelFile`` opens each file once (tests
# and ``NodeStatus.file_reads`` read it)
HEADERS_PARSED: Counter = Counter()


def _diagnosis(head: bytes) -> Optional[str]:
    """What is wrong with a file starting ``head`` (8 bytes) if its magic or version is, else None.
    """
    if head[:4] != MAGIC:
        return f"not a GGUF file (GGUF magic invalid: it starts {head[:4]!r})"
    if len(head) < 8:
        return None
    version = int.from_bytes(head[4:8], "little")
    if not version & 0xFFFF:  # written on a host of the other byte order
        version = int.from_bytes(head[4:8], "big")
    if version not in VERSIONS:
        return f"GGUF version {version} (mdiedge reads {', '.join(map(str, VERSIONS))})"
    return None


def _read_fields(reader: Any, offs: int, count: int) -> int:
    """gguf's ``_build_fields`` with errors naming the key; the offset after the fields."""
    gguf = _gguf_package()
    check_count(count, "keys")
    key, limit = "the header", None
    try:
        for index in range(int(count)):
            start = offs
            limit = key_limit(int(reader._get(offs, np.uint64)[0]), index)
            if limit is not None:
                break
            size, data = reader._get_str(offs)
            key = str(bytes(data), encoding="utf-8")
            kind = reader._get(offs + 8 + int(size[0]), np.uint32)
            offs += 12 + int(size[0])
            limit = value_limit(reader, offs, int(kind[0]), key)
            if limit is not None:
                break
            length, parts, found, types = reader._get_field_parts(offs, int(kind[0]))
            reader._push_field(gguf.ReaderField(
                start, key, [size, data, kind, *parts], [i + 3 for i in found], types),
                skip_sum=True)
            offs += length
            limit = header_limit(offs)
            if limit is not None:
                break
    except (CheckpointError, ValueError, KeyError, OverflowError) as e:
        detail = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"GGUF metadata cut short or corrupt at {key!r} "
                              f"({detail})") from None
    if limit is not None:
        raise CheckpointError(limit)
    return offs


def _skip_strings(reader: Any, offs: int, count: int) -> int:
    """The offset after ``count`` length-prefixed strings from ``offs``; the pages walked are
    dropped from resident memory (a vocabulary's strings are megabytes that a worker never
    reads again; ``string_array`` maps them again where they are decoded)."""
    view, size = memoryview(reader.data), len(reader.data)
    fmt = _u64(reader.byte_order)
    start = offs
    for _ in range(count):
        if offs + 8 > size:
            raise out_of_file(offs, offs + 8, size)
        offs += 8 + struct.unpack_from(fmt, view, offs)[0]
    if offs > size:
        raise out_of_file(offs, offs, size)
    drop_mapped_pages(reader.data, reader.data[start:offs])
    return offs


@functools.lru_cache(maxsize=None)
def _reader_class() -> type:
    """gguf's ``GGUFReader`` with bounds-checked reads, errors naming the key, string arrays skipped
    (``field.parts``: element type and length) and arrays of arrays refused, as llama.cpp does."""
    gguf = _gguf_package()
    array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
    known = {int(t) for t in gguf.GGMLQuantizationType}

    class Reader(gguf.GGUFReader):  # type: ignore[misc,name-defined]
        def __init__(self, path: PathLike, mode: str = "r") -> None:
            HEADERS_PARSED[str(path)] += 1
            try:
                super().__init__(path, mode)
            except (ValueError, CheckpointError):
                data = self.__dict__.get("data")  # the map, unless mapping failed
                found = None if data is None else _diagnosis(bytes(data[:8]))
                if found is not None:
                    raise CheckpointError(found) from None
                raise

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
                 ) -> np.ndarray:
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise out_of_file(int(offset), end, len(self.data))
            return super()._get(offset, dtype, count, override_order)

        def _build_fields(self, offs: int, count: int) -> int:
            return _read_fields(self, offs, count)

        def _get_tensor_info_field(self, orig_offs: int) -> Any:
            field = super()._get_tensor_info_field(orig_offs)
            check_tensor_info(field, known)
            return field

        def _build_tensor_info(self, offs: int, count: int) -> Tuple[int, list]:
            check_count(count, "tensors")
            end, fields = super()._build_tensor_info(offs, count)
            check_header(end)
            return end, fields

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            check_overlaps([tensor_region(gguf, field, start_offs, int(self.alignment),
                                          len(self.data)) for field in fields])
            super()._build_tensors(start_offs, fields)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Tuple[int, list, list, list]:
            if raw_type != array:
                return super()._get_field_parts(orig_offs, raw_type)
            itype, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            start, count = orig_offs + 12, int(length[0])
            types = [gguf.GGUFValueType(raw_type), gguf.GGUFValueType(int(itype[0]))]
            if types[1] == string:
                return _skip_strings(self, start, count) - orig_offs, [itype, length], [], types
            values = self._get(start, self.gguf_scalar_to_np[types[1]], count)
            return 12 + int(values.nbytes), [itype, length, values], [2], types

    return Reader


def open_reader(path: PathLike) -> Any:
    """Memory-mapped copy-on-write (never written); any parse failure is a CheckpointError naming
    the file."""
    path = Path(path)
    reader = _reader_class()  # a missing gguf package: its own CheckpointError
    try:
        return reader(path, "c")
    except CheckpointError as e:  # the reader's bounds and type checks
        raise CheckpointError(f"{path}: {e}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # gguf raises ValueError, KeyError, IndexError, ... on bad input
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: "
                              f"{e})") from None


def string_array(reader: Any, key: str) -> List[str]:
    """The metadata string array ``key`` that ``open_reader`` skipped, decoded in one walk; KeyError
    if absent."""
    field = reader.fields[key]
    if len(field.types) != 2 or field.types[1] != _gguf_package().GGUFValueType.STRING:
        raise CheckpointError(f"metadata {key!r} is not an array of strings")
    offs = field.offset + 8 + len(key.encode()) + 4 + 12  # key, value type, item type, count
    view = memoryview(reader.data)
    fmt = _u64(reader.byte_order)
    out: List[str] = []
    start = offs
    for _ in range(int(field.parts[-1][0])):
        length = struct.unpack_from(fmt, view, offs)[0]
        out.append(bytes(view[offs + 8:offs + 8 + length]).decode("utf-8", "replace"))
        offs += 8 + length
    drop_mapped_pages(reader.data, reader.data[start:offs])  # decoded: not read again
    return out


# --------------------------------------------------------------------------- config


KEPT_ARRAY = 4096  # entries of a metadata array above which a read's list is not kept


class Metadata(MutableMapping):
    """A GGUF file's metadata; a numeric array stays a view of the map until first read, so unread
    arrays (megabytes, some files) cost nothing; a long one (a vocabulary's scores or token
    types: 262,144 Python floats are 8 MiB) stays a view, made a list at each read."""

    def __init__(self) -> None:
        self._values: Dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        if isinstance(value, np.ndarray):
            if value.size > KEPT_ARRAY:
                return value.tolist()
            value = self._values[key] = value.tolist()
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def metadata(reader: Any) -> Metadata:
    """Scalars by value, numeric arrays when read, a string array as its length."""
    out = Metadata()
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if len(field.types) > 1:
            # a skipped string array, else a numeric one (``_reader_class``: parts are its
            # item type, its length, its numbers)
            out[name] = np.asarray(field.parts[-1]) if field.data else int(field.parts[-1][0])
            continue
        try:
            out[name] = field.contents()
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{reader.data.filename}: metadata {name!r} is not UTF-8 text "
                                  f"(byte {e.start})") from None
    return out


def _single(value: Any, key: str, source: str) -> Any:
    """A per-layer array whose entries are all equal is that value; else unsupported."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise CheckpointError(f"{source}: per-layer {key} {value[:8]!r} is not supported")
        return value[0]
    return value


def _hf_fields(meta: Mapping[str, Any], tensors: Sequence[str], source: str) -> Dict[str, Any]:
    """The Hugging Face config.json the ``{arch}.*`` keys describe."""
    arch = meta.get("general.architecture")
    experts = _single(meta.get(f"{arch}.expert_count", 0), "expert_count", source) or 0
    try:
        family = by_gguf_architecture(arch, bool(experts), source)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in tensors:
        raise CheckpointError(f"{source}: RoPE scaling ({scaling or 'rope_freqs.weight'}) is "
                              f"not supported for GGUF files yet")

    def get(key: str, default: Any = None) -> Any:
        return _single(meta.get(f"{arch}.{key}", default), key, source)

    heads = get("attention.head_count")
    dim = get("embedding_length")
    head_dim = get("attention.key_length") or get("rope.dimension_count") or (
        dim // heads if isinstance(dim, int) and isinstance(heads, int) and heads else None)
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise CheckpointError(f"{source}: partial RoPE ({rotary} of {head_dim} dimensions per "
                              f"head) is not supported")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if isinstance(meta.get(k), int)]
    return {
        "model_type": family.model_types[0],
        "vocab_size": get("vocab_size") or meta.get("tokenizer.ggml.tokens"),
        "hidden_size": dim, "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv"),
        "intermediate_size": get("feed_forward_length") or get("expert_feed_forward_length"),
        "max_position_embeddings": get("context_length"), "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "num_local_experts": experts, "num_experts_per_tok": get("expert_used_count", 0) or 0,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos)),
        "_name_or_path": meta.get("general.name"),
        **(family.gguf_extra(get) if family.gguf_extra is not None else {}),
    }


def config_of(reader: Any, path: PathLike) -> ModelConfig:
    """The ModelConfig of an open file (config.py's checks, errors naming the file)."""
    source = str(path)
    meta = metadata(reader)
    hf = _hf_fields(meta, [t.name for t in reader.tensors], source)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads", "intermediate_size", "max_position_embeddings")
               if hf[k] is None]
    if missing:
        arch = meta.get("general.architecture")
        raise CheckpointError(f"{source}: metadata lacks {arch}.* values for {', '.join(missing)}")
    if not hf["_name_or_path"]:
        hf["_name_or_path"] = Path(path).stem
    try:
        return config_from_hf(hf, source)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def gguf_config(path: PathLike) -> ModelConfig:
    return config_of(open_reader(path), path)


# --------------------------------------------------------------------------- tensors


class _Entry(NamedTuple):
    """Where a Hugging Face-named tensor lies in the file."""

    tensor: Any  # gguf's ReaderTensor
    expert: Optional[int]  # this expert's slice of a stacked (experts, rows, cols) tensor
    heads: int  # > 0: its rows are llama.cpp's RoPE order for this many heads
    shape: Tuple[int, ...]  # its shape as Hugging Face has it
    offset: float = 0.0  # an RMSNorm weight stored as offset + w, answered as w


def gguf_name(ours: str, family: Family) -> Tuple[str, Optional[int]]:
    """The GGUF tensor holding ``ours`` in a file of ``family``, and the expert's index in it."""
    block = _BLOCK.fullmatch(ours)
    if block is None:
        return family.gguf_global_names[ours], None
    layer, rest = block.groups()
    expert = _EXPERT.fullmatch(rest)
    if expert is not None:
        rest = "mlp.experts.{e}." + expert.group(2)
    expert_index = None if expert is None else int(expert.group(1))
    return f"blk.{layer}.{family.gguf_block_names[rest]}", expert_index


def _hf_rows(rows: int, heads: int) -> np.ndarray:
    """For each row in Hugging Face's order, the row of llama.cpp's RoPE order holding it
    (the inverse of the converter's permutation: (heads, 2, half) <- (heads, half, 2))."""
    order = np.arange(rows).reshape(heads, rows // heads // 2, 2)
    return np.ascontiguousarray(order.transpose(0, 2, 1)).reshape(rows)


class GGUFSource(TensorSource):
    """A GGUF file's tensors under Hugging Face names (``get``: float32, ``raw``: stored bytes).
    Opening checks every tensor (present, known type, expected shape), so a bad file fails before
    any read."""

    def __init__(self, path: Path, file: Any = None) -> None:
        """``file``: this process's ``ModelFile`` of ``path``, whose reader, config and index it
        takes; None: parsed anew."""
        super().__init__(path)
        self.gguf = _gguf_package()
        reader = open_reader(path) if file is None else file.reader
        self.mapped = reader.data  # the file's map (numpy memmap)
        self.cfg = config_of(reader, path) if file is None else file.cfg
        self.family = family_of(self.cfg)
        self.index: Dict[str, _Entry] = \
            self._indexed({t.name: t for t in reader.tensors}) if file is None else \
            file.memo("gguf-index", lambda: self._indexed(file.tensors))

    def _indexed(self, tensors: Mapping[str, Any]) -> Dict[str, _Entry]:
        """Every tensor of the model by its Hugging Face name, each checked."""
        from .checks import check_blocks, indices  # imports torch, which a vocabulary needs not

        cfg = self.cfg
        stacked = tensors.get("blk.0.ffn_gate_exps.weight")
        experts = set(range(int(stacked.shape.tolist()[-1]))) if stacked is not None else set()
        check_blocks(cfg, indices(tensors, _GGUF_BLOCK), self.path, "block_count",
                     experts if cfg.is_moe else None)
        return {theirs: self._entry(ours, tensors)
                for ours, theirs in tensor_plan(cfg, (0, cfg.n_layers), True, True).items()}

    def _entry(self, ours: str, tensors: Mapping[str, Any]) -> _Entry:
        name, expert = gguf_name(ours, self.family)
        tensor = tensors.get(name)
        if tensor is None:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if expert is not None:
            if len(shape) != 3 or not 0 <= expert < shape[0]:
                raise CheckpointError(f"{self.path}: tensor {name!r} has shape {shape}, not "
                                      f"({self.cfg.n_experts}, rows, columns)")
            shape = shape[1:]
        want = expected_shape(self.cfg, ours)
        if shape != want:
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {shape}, the "
                                  f"config implies {want}")
        if not _dequantizable(self.gguf, tensor.tensor_type):
            raise CheckpointError(f"{self.path}: tensor {name!r} has type "
                                  f"{tensor.tensor_type.name}, which cannot be de-quantized")
        heads = {"attn.wq.weight": self.cfg.n_heads, "attn.wk.weight": self.cfg.n_kv_heads
                 }.get(ours.split(".", 2)[-1], 0) if self.family.gguf_qk_permuted else 0
        offset = self.family.norm_offset if ours.endswith("norm.weight") else 0.0
        return _Entry(tensor, expert, heads, shape, offset)

    def names(self) -> Sequence[str]:
        return list(self.index)

    def shape(self, name: str) -> Optional[Tuple[int, ...]]:
        return self.index[name].shape if name in self.index else None

    def stored_bytes(self, name: str) -> Optional[int]:
        entry = self.index.get(name)
        if entry is None:
            return None
        whole = int(entry.tensor.n_bytes)
        return whole // self.cfg.n_experts if entry.expert is not None else whole

    def qtype(self, name: str) -> str:
        """The ggml type of tensor ``name`` as llama.cpp names it: "F32", "Q4_1", "Q6_K", ..."""
        return str(self.index[name].tensor.tensor_type.name)

    def _data(self, entry: _Entry) -> np.ndarray:
        """A plain ndarray view of the map (numpy's memmap subclass makes each slice cost a Python
        call)."""
        data = entry.tensor.data.view(np.ndarray)
        return data if entry.expert is None else data[entry.expert]

    def raw(self, name: str, hf_order: bool = True) -> Tensor:
        """Stored bytes, uint8 (rows, bytes per row), a view of the map; rows in Hugging Face's
        order (Q and K: a gathered copy). ``hf_order=False``: the file's RoPE-pair order
        (``heads``)."""
        return _tensor(self.raw_array(name, hf_order))

    def raw_array(self, name: str, hf_order: bool = True) -> np.ndarray:
        """``raw`` as numpy; gathered rows are a copy, their map pages then dropped from resident
        memory."""
        entry = self.index[name]
        self.read_names.append(name)
        rows = entry.shape[0] if len(entry.shape) == 2 else 1
        data = self._data(entry).view(np.uint8).reshape(rows, -1)
        if not (entry.heads and hf_order):
            return data
        gathered = data[_hf_rows(rows, entry.heads)]
        drop_mapped_pages(self.mapped, data)  # the file's order is not read again
        return gathered

    def rope_pairs(self, name: str) -> bool:
        return name in self.index and self.index[name].heads > 0

    def release(self, array: Any) -> None:
        drop_mapped_pages(self.mapped, array)

    def heads(self, name: str) -> int:
        """Head count of the Q and K projections (stored in llama.cpp's RoPE order); 0 for other
        tensors."""
        return self.index[name].heads

    def _read(self, name: str) -> Tensor:
        return _tensor(self.read_array(name))

    def get_array(self, name: str) -> np.ndarray:
        self.read_names.append(name)
        return self.read_array(name)

    def read_array(self, name: str) -> np.ndarray:
        entry = self.index[name]
        qtype = entry.tensor.tensor_type
        try:
            values = self.gguf.quants.dequantize(self._data(entry), qtype)
        except Exception as e:  # gguf's numpy code on bytes it cannot take
            raise CheckpointError(f"{self.path}: cannot de-quantize tensor "
                                  f"{entry.tensor.name!r} ({qtype.name}: {e})") from None
        out = np.array(values, dtype=np.float32).reshape(entry.shape)
        if entry.offset:
            out -= np.float32(entry.offset)
        return out[_hf_rows(entry.shape[0], entry.heads)] if entry.heads else out


def _tensor(array: np.ndarray) -> Tensor:
    """A CPU tensor sharing ``array`` (a read-only map's view is only ever read)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


_DEQUANTIZABLE: Dict[int, bool] = {}


def _dequantizable(gguf: Any, qtype: Any) -> bool:
    """Whether ``gguf.quants`` de-quantizes ``qtype`` (tried once on a zero block)."""
    if int(qtype) not in _DEQUANTIZABLE:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, size), np.uint8), qtype)
            _DEQUANTIZABLE[int(qtype)] = True
        except Exception:
            _DEQUANTIZABLE[int(qtype)] = False
    return _DEQUANTIZABLE[int(qtype)]
