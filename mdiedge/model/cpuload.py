"""Loading a chunk for the torch-free CPU path (``CpuModel``): tensors read as numpy from a
torch-free source (GGUF memory-mapped, llama2.c), each matrix stored in a kernel type kept in its
blocks (``QuantMatrix`` over the mapped bytes, no copy: Llama's Q/K rows in the file's RoPE-pair
order, which the step puts in order per row, ``BlockWeights.qk_pairs``), the rest
float32; Q/K/V and gate/up stacked as ``fuse_projections`` does; ``quantize`` as
``qlayers.quantize_blocks``. What the compiled step cannot run is refused (``CpuPathRefused``)
before weights are read."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from ..base.cpudot import dot_code
from ..base.errors import CheckpointError, CpuPathRefused, QuantError
from ..base.memory import give_back_free_memory
from ..base.threads import kernel_threads
from ._stepconstants import ACTIVATIONS, QuantMatrix, StackedMatrix
from .checks import check_finite, check_memory, check_plan, chunk_bytes, describe
from .config import ModelConfig
from .cpumodel import BlockParts, CpuModel, Weights
from .families import family_of
from .kernels import QUANT
from .modelfile import model_file
from .qtypes import (QUANTIZERS, check_blocks, dequantize_array, kernel_qtype, qtype_of,
                     quantize_array)
from .tensors import TensorSource, tensor_plan

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
PACK_BYTES = 8 << 20  # of a matrix's rows packed at a time: the most held twice while packing
PathLike = Union[str, Path]
Matrix = Any  # float32 (out, in) numpy, or a QuantMatrix
_quant = QUANT.select()


def load_cpu_model(model: Optional[PathLike] = None, layers: Optional[Tuple[int, int]] = None,
                   embedding: bool = True, head: bool = True, quantize: Optional[str] = None,
                   on_source: Optional[Callable[[TensorSource], None]] = None) -> CpuModel:
    """``checkpoint.load_model``'s arguments; reads only the chunk's tensors."""
    from .hub import resolve_model

    path = resolve_model(model)
    cfg = model_file(path).cfg
    layers = layers if layers is not None else (0, cfg.n_layers)
    _check_runs(cfg, layers, head, quantize)
    source = open_array_source(path)
    try:
        plan = _checked_plan(cfg, source, layers, embedding, head)
        reader = _Reader(cfg, source, quantize)
        embed = reader.matrix(plan["embed.weight"]) if embedding else None
        if isinstance(embed, QuantMatrix) and head and cfg.tie_embeddings:
            embed = reader.packed(embed)  # the head's product reads the layout
        elif isinstance(embed, QuantMatrix):
            source.release(embed.data)  # checked; read a row at a time from here on
        weights = Weights(
            embed=embed, blocks=[_block(reader, cfg, plan, i) for i in range(*layers)],
            norm=reader.vector(plan["norm.weight"], True) if head else None,
            head=_head(reader, cfg, plan, embedding) if head else None)
        if on_source is not None:
            on_source(source)
    finally:
        source.close()
    give_back_free_memory()  # what reading the tensors took for a while
    return CpuModel(cfg, layers, weights)


def open_array_source(path: Path) -> TensorSource:
    """Reads numpy arrays (``get_array``, ``raw_array``) without torch."""
    if path.is_file():
        file = model_file(path)
        if file.is_gguf:
            from .gguf import GGUFSource

            return GGUFSource(path, file)
        from .sources import Llama2cSource

        return Llama2cSource(path)
    from .sources import SafetensorsArrays

    if not any((path / name).exists() for name in SAFETENSORS_FILES) \
            and (path / "pytorch_model.bin").exists():
        raise CpuPathRefused(f"{path}: a pytorch_model.bin is read through torch")
    return SafetensorsArrays(path)


def check_checkpoint(path: Path, cfg: ModelConfig) -> None:
    """The whole config against the whole checkpoint from the headers alone, before any node loads
    (``checks.check_source``); torch only for a pytorch_model.bin."""
    from .checks import check_source

    try:
        source = open_array_source(path)
    except CpuPathRefused as e:
        from ..base.torchcheck import require_torch
        from .checkpoint import open_source

        require_torch(str(e))
        source = open_source(path)
    try:
        check_source(cfg, source)
    finally:
        source.close()


def _check_runs(cfg: ModelConfig, layers: Tuple[int, int], head: bool,
                quantize: Optional[str]) -> None:
    """Where the family or options ask what the step has not."""
    family = family_of(cfg)
    if layers[1] > layers[0] and not family.step_blocks:
        raise CpuPathRefused(f"the compiled step does not run {family.name} blocks")
    if head and not family.step_head:
        raise CpuPathRefused(f"the compiled step does not run the {family.name} head")
    if family.activation not in ACTIVATIONS or family.moe and family.activation != "silu":
        raise CpuPathRefused(f"activation {family.activation!r} of {family.name} is not one "
                             f"the step has here")
    if quantize and qtype_of(quantize).name not in QUANTIZERS:
        raise CpuPathRefused(f"--quantize {quantize!r}: only {', '.join(QUANTIZERS)}")


def _checked_plan(cfg: ModelConfig, source: TensorSource, layers: Tuple[int, int],
                  embedding: bool, head: bool) -> Dict[str, str]:
    """Every tensor there in its shape, the bytes within free memory (as ``load_model`` checks)."""
    if not 0 <= layers[0] <= layers[1] <= cfg.n_layers:
        raise CheckpointError(f"{source.path}: blocks [{layers[0]}, {layers[1]}) are not "
                              f"blocks of a model of {cfg.n_layers}")
    plan = tensor_plan(cfg, layers, embedding, head)
    check_plan(cfg, source, plan)
    check_memory(chunk_bytes(cfg, source, plan, 4, True), "cpu",
                 f"{source.path}: {describe(layers, embedding, head)} in float32")
    return plan


class _Reader:

    def __init__(self, cfg: ModelConfig, source: TensorSource,
                 quantize: Optional[str]) -> None:
        self.cfg, self.source, self.quantize = cfg, source, quantize
        self.offset = np.float32(family_of(cfg).norm_offset)
        self.names = set(source.names())

    def has(self, theirs: str) -> bool:
        return theirs in self.names

    def floats(self, theirs: str) -> np.ndarray:
        if theirs not in self.names:
            raise CheckpointError(f"{self.source.path}: missing tensor {theirs!r}")
        values = np.ascontiguousarray(self.source.get_array(theirs), dtype=np.float32)
        check_finite(values, theirs, self.source.path)
        return values

    def vector(self, theirs: str, norm: bool = False) -> np.ndarray:
        """An RMSNorm weight with the family's offset added (as the torch model)."""
        values = self.floats(theirs)
        return values + self.offset if norm and self.offset else values

    def in_pairs(self, theirs: str) -> bool:
        """Whether Q or K ``theirs`` is read in its file's RoPE-pair order (no gathered copy):
        blocks of a kernel type whose source stores them so."""
        return self.source.rope_pairs(theirs) and kernel_qtype(self.source, theirs) is not None

    def matrix(self, theirs: str, quantizable: bool = False, pairs: bool = False) -> Matrix:
        """In its kernel type (``QuantMatrix``), else float32; ``quantizable`` with ``quantize``: a
        float one of whole blocks quantized; ``pairs``: rows in RoPE-pair order (``in_pairs``)."""
        qtype = kernel_qtype(self.source, theirs)
        if qtype is None:
            values = self.floats(theirs)
            if quantizable and self.quantize and values.shape[1] % qtype_of(
                    self.quantize).block == 0:
                return QuantMatrix(quantize_array(values, self.quantize), self.quantize)
            return values
        raw = np.ascontiguousarray(self.source.raw_array(theirs, hf_order=False) if pairs
                                   else self.source.raw_array(theirs))
        try:
            check_blocks(raw, qtype)
        except QuantError as e:
            raise CheckpointError(f"{self.source.path}: tensor {theirs!r}: {e}") from None
        return self.packed(QuantMatrix(raw, qtype)) if quantizable else QuantMatrix(raw, qtype)

    def packed(self, matrix: QuantMatrix) -> QuantMatrix:
        """``matrix`` also in the kernels' x8 layout where ``x8_pays``, its rows' file pages
        dropped from resident memory as each slice of ``PACK_BYTES`` is packed (the q8 mode
        reads the layout; the embedding's lookups and anything else reading the rows map
        them again)."""
        data, qtype = matrix.data, matrix.qtype
        if not x8_pays(qtype, data.shape[0], dot_code(), _quant.x8_types()):
            return matrix
        rows = max(8, PACK_BYTES // data.shape[1] // 8 * 8)
        group_bytes = _quant.pack_x8(data[:8], qtype).shape[1]
        x8 = np.empty((data.shape[0] // 8, group_bytes), np.uint8)
        for first in range(0, data.shape[0], rows):  # each slice packed in place
            part = data[first:first + rows]
            _quant.pack_x8(part, qtype, kernel_threads(), x8[first // 8:(first + len(part)) // 8])
            self.source.release(part)
        return QuantMatrix(data, qtype, x8)


def x8_pays(qtype: str, rows: int, dot: int, x8_types: Tuple[str, ...]) -> bool:
    """Whether a matrix (a block's, the head) of ``rows`` rows of ``qtype`` is packed in the
    x8 layout on load: the q8 mode (``dot``) is in force and the kernels in use multiply that
    type's layout (``x8_types``: ``_cquant.x8_types()``), in whole groups of 8 rows. Measured
    on Qwen2.5's Q4_K shapes (AVX512-VNNI, 1 thread): one row 1.5-1.7x the row-by-row
    kernels' speed, 512 rows 1.4-1.6x."""
    return bool(dot) and qtype in x8_types and rows % 8 == 0


def stacked(parts: List[Matrix]) -> Matrix:
    """Quantized: a ``StackedMatrix`` over their blocks; float: one float32 copy; mixed: widened to
    float32."""
    if all(isinstance(p, QuantMatrix) for p in parts):
        return StackedMatrix(parts)
    return np.ascontiguousarray(np.concatenate([
        dequantize_array(p.data, p.qtype, p.shape[1]) if isinstance(p, QuantMatrix) else p
        for p in parts]))


def _block(reader: _Reader, cfg: ModelConfig, plan: Dict[str, str], i: int) -> BlockParts:
    """``CpuModel`` makes its ``BlockWeights`` when its caches are set up."""
    name = (lambda ours: plan[f"layers.{i}.{ours}"])
    maybe = (lambda ours: f"layers.{i}.{ours}" in plan)
    family = family_of(cfg)
    pairs = all(reader.in_pairs(name(f"attn.{w}.weight")) for w in ("wq", "wk"))
    qkv = stacked([reader.matrix(name(f"attn.{w}.weight"), True, pairs and w != "wv")
                   for w in ("wq", "wk", "wv")])
    bias = [name(f"attn.{w}.bias") for w in ("wq", "wk", "wv") if maybe(f"attn.{w}.bias")]
    options: Dict[str, Any] = {key: reader.vector(name(_norm_name(key)), True)
                               for key in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")
                               if maybe(_norm_name(key))}
    if pairs:
        options["qk_pairs"] = True
    if bias:
        options["qkv_bias"] = np.concatenate([reader.vector(b) for b in bias])
    experts = None
    if cfg.is_moe:
        experts = _experts(reader, cfg, plan, i)
        gate_up = down = None
    else:
        gate_up = stacked([reader.matrix(name(f"mlp.{w}.weight"), True) for w in ("gate", "up")])
        down = reader.matrix(name("mlp.down.weight"), True)
    return BlockParts(
        attn_norm=reader.vector(name("attn_norm.weight"), True), qkv=qkv,
        wo=reader.matrix(name("attn.wo.weight"), True),
        mlp_norm=reader.vector(name("mlp_norm.weight"), True), gate_up=gate_up, down=down,
        experts=experts, options=dict(
            options, activation=family.activation,
            attn_scale=(cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar
                        else None),
            window=cfg.sliding_window if i in cfg.sliding_layers else 0))


def _norm_name(key: str) -> str:
    """``BlockWeights``' keyword of an optional norm."""
    return {"q_norm": "attn.q_norm.weight", "k_norm": "attn.k_norm.weight",
            "post_attn_norm": "post_attn_norm.weight",
            "post_mlp_norm": "post_mlp_norm.weight"}[key]


def _experts(reader: _Reader, cfg: ModelConfig, plan: Dict[str, str], i: int
             ) -> Tuple[Matrix, List[Matrix], List[Matrix]]:
    """Router, each expert's stacked gate/up and down."""
    name = (lambda ours: plan[f"layers.{i}.{ours}"])
    gate_up = [stacked([reader.matrix(name(f"mlp.experts.{e}.{w}.weight")) for w in
                        ("gate", "up")]) for e in range(cfg.n_experts)]
    down = [reader.matrix(name(f"mlp.experts.{e}.down.weight")) for e in range(cfg.n_experts)]
    return reader.matrix(name("mlp.router.weight")), gate_up, down


def _head(reader: _Reader, cfg: ModelConfig, plan: Dict[str, str], embedding: bool) -> Matrix:
    """None where it is the chunk's tied embedding (``CpuModel`` shares it)."""
    if cfg.tie_embeddings and embedding:
        return None
    matrix = reader.matrix(plan["lm_head.weight"])
    return reader.packed(matrix) if isinstance(matrix, QuantMatrix) else matrix
