"""Early-exit files beside a model: calibrated thresholds (``early_exit.json``, written by ``mdiedge
calibrate-exit``) and the exit classifier (``exit_classifier.safetensors``), each bound to the
model's content hash; and turning a user's ``--exit-threshold`` into one threshold per block. Every
mismatch is a one-line ``ConfigError`` before anything runs."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from ...base.errors import ConfigError
from ..config import ModelConfig
from .policy import CRITERIA, NEVER, ExitClassifier, ExitPolicy, Head
from ..modelfile import CLASSIFIER_FILE  # noqa: F401  (re-exported with the exit files)

THRESHOLDS_FILE = "early_exit.json"


def exit_layers(cfg: ModelConfig) -> int:
    """Blocks after which a step may exit: every block but the last."""
    return cfg.n_layers - 1


def thresholds_from_json(values: Any, cfg: ModelConfig, where: str) -> List[float]:
    """One threshold per exit point (``null`` or a missing value: never exit there), checked
    against the model's blocks; the last block's (never) is appended."""
    if not isinstance(values, list):
        raise ConfigError(f"{where}: thresholds must be a list, got {type(values).__name__}")
    if len(values) != exit_layers(cfg):
        raise ConfigError(f"{where}: {len(values)} thresholds, but the model has "
                          f"{cfg.n_layers} blocks, so {exit_layers(cfg)} exit points")
    out: List[float] = []
    for i, v in enumerate(values):
        if v is None or v == math.inf:
            out.append(NEVER)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
        else:
            raise ConfigError(f"{where}: threshold {i} is {v!r}, not a number or null")
    return out + [NEVER]


def thresholds_to_json(thresholds: List[float]) -> List[Optional[float]]:
    """The exit points' thresholds as stored (the last block's dropped; never as null)."""
    return [None if t == NEVER else round(float(t), 6) for t in thresholds[:-1]]


def parse_threshold(value: str, criterion: str, cfg: ModelConfig) -> List[float]:
    """``--exit-threshold``: one number for every exit point, or a JSON file holding a list
    of one per exit point (or ``{"thresholds": [...]}``, or a calibration file)."""
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is not None:
        if not math.isfinite(number):
            raise ConfigError(f"--exit-threshold {value!r} is not a finite number")
        return [number] * exit_layers(cfg) + [NEVER]
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"--exit-threshold {value!r} is neither a number nor a file")
    body = _read_json(path)
    if isinstance(body, dict) and "criteria" in body:
        return _calibrated(body, criterion, cfg, path)
    if isinstance(body, dict):
        body = body.get("thresholds")
    return thresholds_from_json(body, cfg, str(path))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({e})") from None


def _calibrated(body: Dict[str, Any], criterion: str, cfg: ModelConfig, path: Path
                ) -> List[float]:
    entry = body.get("criteria", {}).get(criterion) if isinstance(body.get("criteria"),
                                                                  dict) else None
    if not isinstance(entry, dict):
        raise ConfigError(f"{path} holds no calibrated thresholds for {criterion!r}; run "
                          f"mdiedge calibrate-exit --criterion {criterion}")
    return thresholds_from_json(entry.get("thresholds"), cfg, f"{path} ({criterion})")


def calibrated_thresholds(model_dir: Path, criterion: str, cfg: ModelConfig,
                          model_hash: str) -> List[float]:
    """The thresholds ``mdiedge calibrate-exit`` wrote beside the model for ``criterion``."""
    path = model_dir / THRESHOLDS_FILE
    if not path.is_file():
        raise ConfigError(f"no calibrated early-exit thresholds at {path}; run mdiedge "
                          f"calibrate-exit, or give --exit-threshold")
    body = _read_json(path)
    if not isinstance(body, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    if body.get("model_hash") != model_hash:
        raise ConfigError(f"{path} was calibrated for another model (hash "
                          f"{str(body.get('model_hash'))[:12]}, this one {model_hash[:12]})")
    return _calibrated(body, criterion, cfg, path)


def save_classifier(classifier: ExitClassifier, path: Path, model_hash: str) -> None:
    from safetensors.torch import save_file

    tensors = {name: p.detach().contiguous().cpu() for name, p in classifier.named_parameters()}
    save_file(tensors, str(path), metadata={
        "model_hash": model_hash, "n_layers": str(classifier.n_layers),
        "dim": str(classifier.dim), "hidden": str(classifier.hidden)})


def load_classifier(path: Path, cfg: ModelConfig, model_hash: str) -> ExitClassifier:
    """The exit classifier at ``path``, checked to be this model's."""
    from safetensors import safe_open

    if not path.is_file():
        raise ConfigError(f"no exit classifier at {path}; run mdiedge calibrate-exit")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own types for a damaged file
        raise ConfigError(f"{path}: not a readable safetensors file ({e})") from None
    if meta.get("model_hash") != model_hash:
        raise ConfigError(f"{path} is the exit classifier of another model (hash "
                          f"{str(meta.get('model_hash'))[:12]}, this one {model_hash[:12]})")
    try:
        classifier = ExitClassifier(int(meta["n_layers"]), int(meta["dim"]), int(meta["hidden"]))
        if (classifier.n_layers, classifier.dim) != (cfg.n_layers, cfg.dim):
            raise ValueError(f"{classifier.n_layers} blocks of width {classifier.dim}")
        classifier.load_state_dict(tensors)
    except (KeyError, ValueError, RuntimeError) as e:
        raise ConfigError(f"{path} does not fit this model: {e}") from None
    return classifier.eval()


@dataclass(frozen=True)
class ExitSettings:
    """What a user asked for: a criterion and its thresholds, one per block (the last block's
    never), and the classifier file for ``classifier``."""

    criterion: str
    thresholds: List[float]
    classifier: Optional[Path] = None

    def to_json(self) -> Dict[str, Any]:
        return {"criterion": self.criterion, "thresholds": thresholds_to_json(self.thresholds)}


def exit_settings(model_dir: Path, cfg: ModelConfig, model_hash: str, criterion: str,
                  threshold: Optional[Union[str, float]] = None) -> ExitSettings:
    """``--early-exit CRITERION [--exit-threshold T]`` checked against the model (the files
    live in its directory, or beside a single-file model)."""
    model_dir = model_dir if model_dir.is_dir() else model_dir.parent
    if criterion not in CRITERIA:
        raise ConfigError(f"unknown early-exit criterion {criterion!r}; choose one of "
                          f"{', '.join(CRITERIA)}")
    if threshold is None:
        thresholds = calibrated_thresholds(model_dir, criterion, cfg, model_hash)
    else:
        thresholds = parse_threshold(str(threshold), criterion, cfg)
    classifier = None
    if criterion == "classifier":
        classifier = model_dir / CLASSIFIER_FILE
        load_classifier(classifier, cfg, model_hash)  # checked now, before anything runs
    return ExitSettings(criterion, thresholds, classifier)



def exit_policy(settings: ExitSettings, cfg: ModelConfig, model_hash: str,
                head: Optional[Head] = None, device: str = "cpu") -> ExitPolicy:
    """The policy a stage on ``device`` runs with: the settings, the head (``softmax``) and
    the classifier (``classifier``, loaded, checked and moved to ``device``)."""
    classifier = None
    if settings.criterion == "classifier":
        assert settings.classifier is not None
        classifier = load_classifier(settings.classifier, cfg, model_hash).to(device)
    return ExitPolicy(settings.criterion, list(settings.thresholds),
                      head if settings.criterion == "softmax" else None, classifier)
