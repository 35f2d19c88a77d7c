"""Checkpoints: Hugging Face directories, llama2.c files and GGUF files, read one block range at a
time: a node reads only its blocks' tensors (safetensors: each header parsed once, each tensor read
at its offset straight into its parameter, never a whole-file load or map)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..base.dtypes import BY_SAFETENSORS
from ..base.errors import CheckpointError, ConfigError
from .config import ModelConfig
from .families import config_to_hf
from .checks import check_finite
from .modelfile import model_file
from .sources import QTYPE_KEY, Llama2cSource, SafetensorsArrays, regular_file_size
from .tensors import GLOBAL_NAMES, TensorSource, tensor_plan

# with QTYPE_KEY (.sources) and GLOBAL_NAMES (.tensors: GGUF's source needs them too), which
# callers know from this module
__all__ = ["GLOBAL_NAMES", "QTYPE_KEY", "READ_CHUNK_BYTES", "PathLike", "SafetensorsSource",
           "TorchBinSource", "content_hash", "hf_state_dict", "load_config", "load_model",
           "open_source", "resolve_model_path", "save_hf_checkpoint"]

PathLike = Union[str, Path]

# --------------------------------------------------------------------------- sources

_SAFETENSORS_DTYPES: Dict[str, torch.dtype] = {tag: getattr(torch, d.name)
                                               for tag, d in BY_SAFETENSORS.items()}
READ_CHUNK_BYTES = 4 << 20  # the temporary of a tensor read that converts dtype or layout


class SafetensorsSource(SafetensorsArrays):
    """Our own header parse (``sources.SafetensorsArrays``) and ``readinto`` straight into tensors
    (no memory map)."""

    def raw(self, name: str) -> Tensor:
        """uint8 (rows, bytes per row)."""
        return self.get(name)

    def _dequantized(self, name: str) -> Optional[Tensor]:
        """None unless the chunk keeps it quantized."""
        qtype = self.qtype(name)
        if qtype == "F32":
            return None
        from .quant import dequantize, qtype_of

        raw, t = self.raw(name), qtype_of(qtype)
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % t.block_bytes:
            raise CheckpointError(f"{self.path}: tensor {name!r} of {qtype} blocks has "
                                  f"{tuple(raw.shape)} {raw.dtype}, not whole uint8 blocks")
        return dequantize(raw, qtype, raw.shape[1] // t.block_bytes * t.block)

    def _entry(self, name: str) -> Tuple[Path, torch.dtype, Tuple[int, ...], int, int]:
        """File, dtype, shape, start and size in bytes, all checked."""
        file, tag, shape, start, nbytes = self._array_entry(name)
        return file, _SAFETENSORS_DTYPES[tag], shape, start, nbytes

    def _read(self, name: str) -> Tensor:
        entry = self._entry(name)
        out = torch.empty(entry[2], dtype=entry[1])
        self._fill(name, entry, out)
        return out

    def read_into(self, name: str, out: Tensor) -> None:
        """Straight into ``out``, or where dtype or layout differ through a temporary of at most
        ``READ_CHUNK_BYTES``: no memory map, so the file's pages never count in RSS, and the peak is
        the model plus one chunk."""
        floats = self._dequantized(name)
        if floats is not None:  # a pushed chunk's blocks, for a float model (not the CPU)
            self._check_shape(name, tuple(floats.shape), tuple(out.shape))
            out.copy_(floats)
            return
        entry = self._entry(name)
        self._check_shape(name, entry[2], tuple(out.shape))
        self.read_names.append(name)
        self._fill(name, entry, out)

    def _fill(self, name: str, entry: Tuple[Path, torch.dtype, Tuple[int, ...], int, int],
              out: Tensor) -> None:
        file, dtype, _, start, nbytes = entry
        fh = self._files.get(file)
        if fh is None:
            fh = self._files[file] = open(file, "rb")
        fh.seek(start)
        if out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu":
            self._read_exact(fh, out, file, name, 0, nbytes)
            return
        rows = out.shape[0] if out.dim() else 1
        row_bytes = nbytes // rows if rows else 0
        step = max(1, READ_CHUNK_BYTES // max(1, row_bytes))
        for first in range(0, rows, step):
            last = min(rows, first + step)
            chunk = torch.empty((last - first,) + tuple(out.shape[1:]), dtype=dtype)
            self._read_exact(fh, chunk, file, name, first * row_bytes, nbytes)
            if out.dim():
                out[first:last].copy_(chunk)
            else:
                out.copy_(chunk.view(()))

    @staticmethod
    def _read_exact(fh: BinaryIO, into: Tensor, file: Path, name: str, done: int,
                    total: int) -> None:
        """``done``: bytes of the tensor before it (for the error message)."""
        size = into.numel() * into.element_size()
        if not size:
            return
        got = fh.readinto(memoryview(into.reshape(-1).view(torch.uint8).numpy()).cast("B"))
        if got != size:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} (file truncated: "
                                  f"{done + got} of {total} bytes)")



class TorchBinSource(TensorSource):
    """``pytorch_model.bin`` (weights-only unpickling, memory-mapped where torch can)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        file = path / "pytorch_model.bin"
        regular_file_size(file)
        kwargs = {"map_location": "cpu", "weights_only": True}
        try:
            try:
                self.state = torch.load(str(file), mmap=True, **kwargs)
            except TypeError:  # torch < 2.1 has no mmap
                self.state = torch.load(str(file), **kwargs)
        except Exception as e:
            raise CheckpointError(f"{file}: not a readable weights file ({e})") from None

    def names(self) -> Sequence[str]:
        return list(self.state)

    def shape(self, name: str) -> Optional[Tuple[int, ...]]:
        found = self.state.get(name)
        return tuple(found.shape) if isinstance(found, Tensor) else None

    def _read(self, name: str) -> Tensor:
        return self.state[name]


# --------------------------------------------------------------------------- model loading


def resolve_model_path(model: Optional[PathLike]) -> Path:
    from .hub import resolve_model

    return resolve_model(model)


def load_config(model: Optional[PathLike]) -> ModelConfig:
    return model_file(resolve_model_path(model)).cfg


def content_hash(model: PathLike) -> str:
    """sha256 of config.json and the weight files (not the exit classifier), or the file; once per
    process while unchanged."""
    return model_file(model).content_hash()


def open_source(path: Path) -> TensorSource:
    if path.is_file():
        file = model_file(path)
        if file.is_gguf:
            from .gguf import GGUFSource
            return GGUFSource(path, file)
        return Llama2cSource(path)
    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        return SafetensorsSource(path)
    if (path / "pytorch_model.bin").exists():
        return TorchBinSource(path)
    raise CheckpointError(f"{path}: no model.safetensors, model.safetensors.index.json or "
                          f"pytorch_model.bin")


def load_model(model: Optional[PathLike] = None, layers: Optional[Tuple[int, int]] = None,
               embedding: bool = True, head: bool = True, device: str = "cpu",
               dtype: torch.dtype = torch.float32,
               on_source: Optional[Callable[[TensorSource], None]] = None,
               quantize: Optional[str] = None):  # -> Transformer
    """The chunk ``[layers)`` (+ embedding, + head), reading only its tensors; ``on_source`` sees
    the source (tests). In float32, tensors stored in a kernel type (GGUF) stay in it (``qlayers``),
    and on the CPU ``quantize`` quantizes the float ones; other dtypes de-quantize as read."""
    from .transformer import Transformer

    path = resolve_model_path(model)
    cfg = load_config(path)
    layers = layers if layers is not None else (0, cfg.n_layers)
    native = torch.device(device).type == "cpu" and dtype == torch.float32
    keeps_blocks = dtype == torch.float32
    source = open_source(path)
    try:
        plan = _checked_plan(cfg, source, layers, embedding, head, device, dtype, keeps_blocks)
        with _skip_init():
            net = Transformer(cfg, layers, embedding, head).to(dtype)
        if keeps_blocks:
            from .qlayers import keep_quantized

            held = keep_quantized(net, source, plan)
            plan = {k: v for k, v in plan.items() if k not in held}
        _read_floats(net, source, plan, device)
        if native and quantize:
            from .qlayers import quantize_blocks

            quantize_blocks(net, quantize)
        if on_source is not None:
            on_source(source)
    finally:
        source.close()
    return net.to(device=device).eval()


def _checked_plan(cfg: ModelConfig, source: TensorSource, layers: Tuple[int, int],
                  embedding: bool, head: bool, device: str, dtype: torch.dtype,
                  keeps_blocks: bool) -> Dict[str, str]:
    """Once the config fits the checkpoint (blocks exist, shapes match) and the chunk the free
    memory."""
    from .checks import check_memory, check_plan, chunk_bytes, describe

    if not 0 <= layers[0] <= layers[1] <= cfg.n_layers:
        raise ConfigError(f"{source.path}: blocks [{layers[0]}, {layers[1]}) are not blocks of "
                          f"a model of {cfg.n_layers}")
    last = next(iter(tensor_plan(cfg, (layers[1] - 1, layers[1]), False, False).values()), "")
    if layers[1] > layers[0] and last not in set(source.names()):  # before a plan of every
        raise CheckpointError(f"{source.path}: num_hidden_layers = {cfg.n_layers}, but the "
                              f"checkpoint has no tensor {last!r}: the config does not match "
                              f"the weights")  # block is made: a config may name 10^9
    plan = tensor_plan(cfg, layers, embedding, head)
    check_plan(cfg, source, plan)
    itemsize = torch.empty((), dtype=dtype).element_size()
    check_memory(chunk_bytes(cfg, source, plan, itemsize, keeps_blocks), device,
                 f"{source.path}: {describe(layers, embedding, head)} in {str(dtype)[6:]}")
    return plan


def _read_floats(net: Any, source: TensorSource, plan: Dict[str, str], device: str) -> None:
    """In place."""
    net.store_head_transposed()
    if torch.device(device).type == "cpu":  # elsewhere the move would unshare the buffers
        net.fuse_projections()
    params = dict(net.named_parameters())  # a tied head is the embedding, listed once
    unplanned = set(params) - set(plan)
    if unplanned:
        raise RuntimeError(f"no checkpoint tensor planned for {sorted(unplanned)}")
    available = set(source.names())
    offset = net.family.norm_offset
    with torch.no_grad():
        for ours, theirs in plan.items():
            if ours not in params:  # a tied head read as the embedding
                continue
            if theirs not in available:
                raise CheckpointError(f"{source.path}: missing tensor {theirs!r}")
            source.read_into(theirs, params[ours])  # straight into the parameter
            check_finite(params[ours], theirs, source.path)
            if offset and ours.endswith("norm.weight"):
                params[ours] += offset


class _skip_init:
    """Skip random initialisation of parameters the checkpoint overwrites."""

    def __enter__(self) -> None:
        self._saved = (torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters)
        torch.nn.Linear.reset_parameters = lambda self: None  # type: ignore[assignment]
        torch.nn.Embedding.reset_parameters = lambda self: None  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters = self._saved


# --------------------------------------------------------------------------- writing


def hf_state_dict(net) -> Iterator[Tuple[str, Tensor]]:  # net: Transformer
    """(Hugging Face name, tensor), RMSNorm weights less ``norm_offset``, the tied head skipped."""
    cfg = net.cfg
    plan = tensor_plan(cfg, (net.first, net.last), net.has_embedding, net.has_head)
    params = dict(net.named_parameters(remove_duplicate=False))
    offset = net.family.norm_offset
    for ours, theirs in plan.items():
        held = params[ours]
        yield theirs, held - offset if offset and ours.endswith("norm.weight") else held


def save_hf_checkpoint(net, out: PathLike, dtype: torch.dtype = torch.float32,
                       tokenizer: Optional[PathLike] = None) -> None:
    """A whole model as a Hugging Face directory of its family."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg: ModelConfig = net.cfg
    tensors = {name: t.detach().to(dtype).contiguous().clone() for name, t in hf_state_dict(net)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(cfg)
    hf["torch_dtype"] = str(dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    generation = {"bos_token_id": cfg.bos_id,
                  "eos_token_id": cfg.eos_ids[0] if len(cfg.eos_ids) == 1 else list(cfg.eos_ids)}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.model")
