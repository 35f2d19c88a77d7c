"""Early exit on a ring's nodes: the parts beyond a node's blocks its criterion needs (final norm
and head for ``softmax``, the classifier for ``classifier``), where a worker finds them, and its
stage's policy."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..base.errors import CheckpointError, ConfigError
from ..model.modelfile import CLASSIFIER_FILE
from ..runtime.framing import MAX_EXIT_DEPTH
from ..runtime.protocol import Assignment, ExitAssignment

TYPE_CHECKING = False
if TYPE_CHECKING:  # early exit runs on the torch path: torch loads only where it is asked for
    from ..model.earlyexit.files import ExitSettings
    from ..model.earlyexit.policy import ExitPolicy

CLASSIFIER_TENSOR = "exit_classifier.file"  # the classifier file's bytes inside a sent chunk


def exit_assignment(settings: Optional[ExitSettings]) -> Optional[ExitAssignment]:
    """What a worker is told of the user's early-exit settings."""
    if settings is None:
        return None
    from ..model.earlyexit.policy import NEVER

    digest = file_sha256(settings.classifier) if settings.classifier is not None else ""
    return ExitAssignment(settings.criterion,
                    [None if t == NEVER else float(t) for t in settings.thresholds[:-1]], digest)


def file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_ring_exits(cfg: Any, settings: Optional[ExitSettings]) -> Optional[ExitSettings]:
    """A frame names the exit block in one byte."""
    if settings is not None and cfg.n_layers - 1 > MAX_EXIT_DEPTH:
        raise ConfigError(f"early exit on a ring supports models of up to "
                          f"{MAX_EXIT_DEPTH + 1} blocks; this one has {cfg.n_layers}")
    return settings


def starter_policy(settings: Optional[ExitSettings], model_hash: str,
                   model: Any) -> Optional[ExitPolicy]:
    """The policy of a stage holding the head, on its chunk's device."""
    if settings is None:
        return None
    from ..model.earlyexit.files import exit_policy

    return exit_policy(settings, model.cfg, model_hash, model.head_logits,
                       str(next(model.parameters()).device))


def cache_suffix(exits: Optional[ExitAssignment]) -> str:
    """A sent chunk's cache folder names the exit parts it holds."""
    if exits is None:
        return ""
    if exits.needs_classifier:
        return f"-classifier-{exits.classifier[:16]}"
    return "-head" if exits.needs_head else ""


def extra_bytes(request: Assignment) -> int:
    """For the weights upload's size limit."""
    exits, cfg = request.early_exit, request.model.model_config()
    if exits is None:
        return 0
    if exits.needs_head:
        return (cfg.vocab_size * cfg.dim + cfg.dim) * 4
    if exits.needs_classifier:
        return cfg.n_layers * (cfg.dim + 3) * 64 * 4
    return 0


def chunk_extras(model_dir: Path, exits: Optional[ExitAssignment]
                 ) -> "Tuple[Dict[str, Any], Dict[str, str]]":
    """The classifier file's bytes as one tensor of a sent chunk (written back verbatim, so its
    sha256 is the starter's), and the metadata saying so."""
    if exits is None or not exits.needs_classifier:
        return {}, {}
    model_dir = model_dir if model_dir.is_dir() else model_dir.parent
    import numpy as np

    raw = (model_dir / CLASSIFIER_FILE).read_bytes()
    return {CLASSIFIER_TENSOR: np.frombuffer(raw, dtype=np.uint8)}, {}


def sent_chunk(path: Path, layers: Tuple[int, int], exits: Optional[ExitAssignment]) -> bytes:
    """Its blocks and the exit parts its criterion needs."""
    from ..model.chunkfile import chunk_safetensors

    extra, metadata = chunk_extras(path, exits)
    return chunk_safetensors(path, layers, exits is not None and exits.needs_head, extra, metadata)


def keep_sent_classifier(folder: Path) -> None:
    """Write the classifier a sent chunk carries, if any, beside it."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        if CLASSIFIER_TENSOR in f.keys():
            (folder / CLASSIFIER_FILE).write_bytes(f.get_tensor(CLASSIFIER_TENSOR).tobytes())


def has_parts(source: Path, exits: Optional[ExitAssignment]) -> bool:
    if exits is None:
        return True
    folder = source if source.is_dir() else source.parent
    if exits.needs_classifier:  # the very file the starter's thresholds were chosen with
        found = folder / CLASSIFIER_FILE
        return found.is_file() and (not exits.classifier or file_sha256(found) == exits.classifier)
    if exits.needs_head:
        from ..model.checkpoint import GLOBAL_NAMES, open_source

        try:
            reader = open_source(source)
        except CheckpointError:
            return False
        try:
            return GLOBAL_NAMES["norm.weight"] in set(reader.names())
        finally:
            reader.close()
    return True


def worker_policy(source: Path, request: Assignment) -> "Optional[ExitPolicy]":
    """Parts read from ``source`` (the model or a sent chunk's folder), on the request's device and
    dtype; CheckpointError naming what is missing."""
    exits = request.early_exit
    if exits is None:
        return None
    from ..model.checkpoint import load_model
    from ..model.devices import parse_dtype
    from ..model.earlyexit.files import load_classifier, thresholds_from_json
    from ..model.earlyexit.policy import ExitPolicy
    from .devices import device_of

    device, dtype = device_of(request.device, "device"), parse_dtype(request.dtype)

    cfg = request.model.model_config()
    thresholds = thresholds_from_json(exits.thresholds, cfg, "early_exit")
    head: Any = None
    classifier = None
    if exits.needs_head:
        head = load_model(source, layers=(cfg.n_layers, cfg.n_layers), embedding=False,
                          head=True, device=device, dtype=dtype).head_logits
    if exits.needs_classifier:
        folder = source if source.is_dir() else source.parent
        if not has_parts(source, exits):
            raise CheckpointError(f"{folder}: no {CLASSIFIER_FILE} with sha256 "
                                  f"{exits.classifier[:16]}… for the classifier criterion")
        classifier = load_classifier(folder / CLASSIFIER_FILE, cfg, request.model.hash).to(device)
    return ExitPolicy(exits.criterion, thresholds, head, classifier)
