"""The one dtype table: names (with aliases) accepted on the command line and in config files,
the code a frame header carries, the bytes per element, and the safetensors tag. No torch here;
``mdiedge.model.devices`` maps a name to its ``torch.dtype``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from .errors import ConfigError, FrameError


@dataclass(frozen=True)
class DType:
    name: str  # the torch attribute: torch.<name>
    aliases: Tuple[str, ...]
    code: int  # the dtype field of a frame header
    itemsize: int
    safetensors: str
    compute: bool  # a model may run in it


TABLE: Tuple[DType, ...] = (
    DType("float32", ("fp32",), 0, 4, "F32", True),
    DType("float16", ("fp16",), 1, 2, "F16", True),
    DType("bfloat16", ("bf16",), 2, 2, "BF16", True),
    DType("int64", (), 3, 8, "I64", False),
    DType("int32", (), 4, 4, "I32", False),
    DType("uint8", (), 5, 1, "U8", False),
    DType("float64", (), 6, 8, "F64", False),
)

BY_NAME: Dict[str, DType] = {n: d for d in TABLE for n in (d.name,) + d.aliases}
BY_CODE: Dict[int, DType] = {d.code: d for d in TABLE}
BY_SAFETENSORS: Dict[str, DType] = {d.safetensors: d for d in TABLE}
ITEMSIZE: Dict[int, int] = {d.code: d.itemsize for d in TABLE}  # frame dtype code -> bytes
COMPUTE_NAMES: Tuple[str, ...] = tuple(n for d in TABLE if d.compute for n in (d.name,) + d.aliases)


def compute_dtype(name: str) -> DType:
    """The dtype a model computes in, by name or alias; ConfigError names the choices."""
    found = BY_NAME.get(name)
    if found is None or not found.compute:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(COMPUTE_NAMES)}")
    return found


def by_code(code: int) -> DType:
    try:
        return BY_CODE[code]
    except KeyError:
        raise FrameError(f"unknown dtype code {code}") from None


# the block types a float weight may be quantized to on load (``--quantize``); the types
# themselves are ``mdiedge.model.quant``'s
QUANTIZERS = ("Q8_0", "Q4_0", "Q4_1")


def quantizer(name: str, option: str = "--quantize") -> str:
    """``name`` as a quantizer's type ("q8_0" -> "Q8_0"); ConfigError names the choices."""
    found = str(name).upper()
    if found not in QUANTIZERS:
        raise ConfigError(f"{option}: expected one of {', '.join(q.lower() for q in QUANTIZERS)}"
                          f", got {name!r}")
    return found
