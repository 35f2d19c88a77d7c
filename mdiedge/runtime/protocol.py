"""The control plane's typed bodies, one JSON mapping each, for both ends. Parsing never trusts the
network: every field type- and range-checked, a bad one a ``ValueError`` naming it (a 400)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..base import defaults
from ..base.codecs import Compression
from ..base.dtypes import QUANTIZERS, compute_dtype
from ..model.config import ModelConfig
from ..model.families import config_from_hf

MAX_SLOTS = 4096


def _field(body: Mapping[str, Any], key: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
    if key not in body or body[key] is None:
        if default is dataclasses.MISSING:
            raise ValueError(f"missing field {key!r}")
        return default
    value = body[key]
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
    if not ok or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"field {key!r} must be {kind.__name__}, got {value!r}")
    return float(value) if kind is float else value


@dataclass
class ModelRef:
    """Content hash, config and (same filesystem) path."""

    name: str
    hash: str
    config: Dict[str, Any]
    generation_config: Dict[str, Any]
    path: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: Any) -> "ModelRef":
        if not isinstance(body, dict):
            raise ValueError(f"field 'model' must be an object, got {body!r:.80}")
        digest = _field(body, "hash", str)
        if not (len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise ValueError(f"model hash {digest!r} is not a sha256 hex digest")
        return cls(_field(body, "name", str, ""), digest, _field(body, "config", dict),
                   _field(body, "generation_config", dict, {}), _field(body, "path", str, None))

    def model_config(self) -> ModelConfig:
        return config_from_hf(self.config, "assignment config", self.generation_config)


@dataclass
class ExitAssignment:
    """The criterion and one threshold per exit point (every block but the last; None: never there).
    """

    criterion: str
    thresholds: List[Optional[float]]
    classifier: str = ""  # sha256 of the exit classifier file, for ``classifier``

    @property
    def needs_head(self) -> bool:
        return self.criterion == "softmax"

    @property
    def needs_classifier(self) -> bool:
        return self.criterion == "classifier"

    def to_json(self) -> Dict[str, Any]:
        return {"criterion": self.criterion, "thresholds": list(self.thresholds),
                "classifier": self.classifier}

    @classmethod
    def from_json(cls, body: Any, n_layers: int) -> "ExitAssignment":
        if not isinstance(body, Mapping):
            raise ValueError(f"field 'early_exit' must be an object, got {body!r}")
        criterion = _field(body, "criterion", str)
        if criterion not in defaults.EARLY_EXIT_CRITERIA:
            raise ValueError(f"unknown early-exit criterion {criterion!r}")
        thresholds = _field(body, "thresholds", list)
        if len(thresholds) != n_layers - 1 or not all(
                t is None or isinstance(t, (int, float)) and not isinstance(t, bool)
                and math.isfinite(t) for t in thresholds):
            raise ValueError(f"field 'thresholds' must hold {n_layers - 1} numbers or nulls")
        classifier = _field(body, "classifier", str, "")
        if classifier and (len(classifier) != 64 or
                           any(c not in "0123456789abcdef" for c in classifier)):
            raise ValueError(f"field 'classifier' {classifier!r} is not a sha256 hex digest")
        return cls(criterion, [None if t is None else float(t) for t in thresholds], classifier)


@dataclass
class Assignment:
    """``POST /assign``: blocks ``layers`` of ``model`` for ``n_slots`` x ``context``."""

    model: ModelRef
    layers: Tuple[int, int]
    n_slots: int
    context: int
    dtype: str = "float32"
    device: str = "cpu"
    last: bool = False  # the last worker: trims prefill output to the last position
    max_payload: int = defaults.MAX_PAYLOAD
    session: str = ""
    early_exit: Optional[ExitAssignment] = None
    quantize: str = ""  # a block type its float blocks are quantized to at load ("": none)

    def to_json(self) -> Dict[str, Any]:
        return {"model": self.model.to_json(), "layers": list(self.layers),
                "n_slots": self.n_slots, "context": self.context, "dtype": self.dtype,
                "device": self.device, "last": self.last, "max_payload": self.max_payload,
                "session": self.session, "quantize": self.quantize,
                "early_exit": None if self.early_exit is None else self.early_exit.to_json()}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "Assignment":
        model = ModelRef.from_json(body.get("model"))
        cfg = model.model_config()
        layers = _field(body, "layers", list)
        if len(layers) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                       for v in layers):
            raise ValueError(f"field 'layers' must be [first, end), got {layers!r}")
        a, b = layers
        if not 0 <= a < b <= cfg.n_layers:
            raise ValueError(f"layers {[a, b]} outside the model's 0..{cfg.n_layers}")
        n_slots, context = _field(body, "n_slots", int), _field(body, "context", int)
        if not 0 < n_slots <= MAX_SLOTS or not 0 < context <= cfg.max_seq_len:
            raise ValueError(f"n_slots={n_slots} or context={context} out of range")
        dtype = _field(body, "dtype", str)
        compute_dtype(dtype)
        device = _field(body, "device", str)
        if device != "cpu" and not device.startswith("cuda"):
            raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N")
        max_payload = _field(body, "max_payload", int, defaults.MAX_PAYLOAD)
        if not 0 < max_payload <= 1 << 34:
            raise ValueError(f"max_payload {max_payload} out of range")
        early_exit = body.get("early_exit")
        exits = None if early_exit is None else ExitAssignment.from_json(early_exit, cfg.n_layers)
        quantize = _field(body, "quantize", str, "")
        if quantize and quantize not in QUANTIZERS:
            raise ValueError(f"quantize {quantize!r} is not one of {', '.join(QUANTIZERS)}")
        return cls(model, (a, b), n_slots, context, dtype, device,
                   _field(body, "last", bool, False), max_payload, _field(body, "session", str, ""),
                   exits, quantize)

    def same_weights(self, other: Optional["Assignment"]) -> bool:
        return other is not None and (self.model.hash, self.layers, self.dtype, self.device,
                                      self.quantize) == (other.model.hash, other.layers,
                                                         other.dtype, other.device,
                                                         other.quantize)


@dataclass
class AssignReply:

    need_weights: bool
    data_port: int = 0
    weight_bytes: int = 0
    kv_bytes: int = 0

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "AssignReply":
        need = _field(body, "need_weights", bool)
        if need:
            return cls(True)
        port = _field(body, "data_port", int)
        if not 0 < port < 65536:
            raise ValueError(f"data_port {port} out of range")
        return cls(False, port, _field(body, "weight_bytes", int, 0), _field(body, "kv_bytes", int, 0))


@dataclass
class ConnectRequest:
    """``POST /connect``: link to the next node's data port."""

    next_host: str
    next_port: int
    next_control: Optional[str] = None  # its control URL, for the link RTT in status
    session: str = ""
    ring: str = ""  # this set-up's tag: both ends of each link bind their handshake to it
    codecs_in: str = "none"  # the codecs of the link from the previous node (``Compression``)
    codecs_out: str = "none"  # and of the link to the next node

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "ConnectRequest":
        port = _field(body, "next_port", int)
        if not 0 < port < 65536:
            raise ValueError(f"next_port {port} out of range")
        codecs = [str(Compression.parse(_field(body, key, str, "none"), f"field {key!r}"))
                  for key in ("codecs_in", "codecs_out")]
        return cls(_field(body, "next_host", str), port, _field(body, "next_control", str, None),
                   _field(body, "session", str, ""), _field(body, "ring", str, ""), *codecs)


def busy_fraction(compute_s: float, elapsed_s: float) -> float:
    """The one meaning of ``NodeStatus.busy_fraction``: ``compute_s`` over ``elapsed_s`` of wall
    time since the stage was set up (or a run's window), rounded to 4 places; 0 before any time
    passed."""
    if elapsed_s <= 0:
        return 0.0
    return round(min(1.0, max(0.0, compute_s / elapsed_s)), 4)


@dataclass
class NodeStatus:
    """``GET /status`` of any node, the same keys for starter and worker."""

    role: str
    name: str
    state: str  # idle, loading, ready, busy, down; a starter: degraded (serving without a node)
    address: str = ""
    version: str = ""
    model: Optional[str] = None
    hash: Optional[str] = None
    device: Optional[str] = None
    layers: Optional[List[int]] = None
    rss_bytes: int = 0
    max_rss_bytes: int = 0
    weight_bytes: int = 0
    kv_bytes: int = 0
    slots_in_use: int = 0
    messages: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    kv_fill_s: float = 0.0  # early exit: KV fill of the blocks decode steps skipped
    busy_fraction: float = 0.0  # busy_fraction(): compute_s over the time since set-up
    link_rtt_ms: Optional[float] = None
    uptime_s: float = 0.0
    pid: int = 0
    data_port: int = 0
    expert_load: Dict[str, List[int]] = field(default_factory=dict)
    recoveries: int = 0  # a starter: rings rebuilt after a lost node
    lost: List[str] = field(default_factory=list)  # a starter: workers it serves without
    links: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # LinkPair.stats(): in, out
    error: Optional[str] = None
    setup: Optional[str] = None  # a starter: what setting up its ring waits for now
    sealed: Optional[bool] = None  # a worker: whether it seals its links (False: --no-encrypt)
    threads: int = 0  # compute threads
    code: Dict[str, Any] = field(default_factory=dict)  # accel.running_code(): what it runs
    decode: Dict[str, str] = field(default_factory=dict)  # transformer.route_of(): step or torch
    file_reads: Dict[str, int] = field(default_factory=dict)  # modelfile.reads(): GGUF
    #     headers parsed and model contents hashed by the node's process

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "NodeStatus":
        """Unknown keys ignored (a newer node may add some)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in body.items() if k in names}
        for key in ("role", "name", "state"):
            values.setdefault(key, "?")
        return cls(**values)

    @classmethod
    def down(cls, role: str, name: str, address: str, error: str) -> "NodeStatus":
        return cls(role, name, "down", address=address, error=error)
