"""Early exit: the criteria, the sticky batch rule, KV fill, the exiting path through
in-process stages and a real ring, the files beside a model, and bad input."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any, List

import pytest
import torch

from mdiedge.base.errors import ConfigError
from mdiedge.model.checkpoint import content_hash, load_config, load_model
from mdiedge.model.earlyexit.files import (CLASSIFIER_FILE, ExitSettings,
                                     exit_settings, load_classifier, save_classifier)
from mdiedge.model.earlyexit.policy import (NEVER, ExitClassifier, ExitPolicy, ExitStep, cosine,
                                            softmax_margin)
from mdiedge.model.sampling import SamplingParams
from mdiedge.engine.local import LocalEngine
from tolerance import assert_close, model_path_length
from commands import MDIEDGE

GREEDY = SamplingParams(temperature=0)


def settings(criterion: str, threshold: float, n_layers: int = 6) -> ExitSettings:
    return ExitSettings(criterion, [threshold] * (n_layers - 1) + [NEVER])


def tokens_of(out: Any) -> List[List[int]]:
    return [s["token_ids"] for s in out.samples]


@pytest.mark.parametrize("logits, expected", [
    ([0.0, 0.0], 0.0),
    ([20.0, 0.0, 0.0], 1.0),
    ([math.log(3.0), 0.0], 0.5),  # probabilities 0.75 and 0.25
])
def test_softmax_margin(logits: List[float], expected: float) -> None:
    assert softmax_margin(torch.tensor([logits]))[0].item() == pytest.approx(expected, abs=1e-4)


def test_cosine_rows() -> None:
    h = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    prev = torch.tensor([[2.0, 0.0], [-1.0, -1.0]])
    assert cosine(h, prev).tolist() == pytest.approx([1.0, -1.0])


class Scripted:
    """A criterion whose confidence after block i is ``scores[i]`` (one per row)."""

    def __init__(self, scores: List[List[float]]) -> None:
        self.scores = scores

    def policy(self, threshold: float, n_layers: int) -> ExitPolicy:
        policy = ExitPolicy("similarity", [threshold] * (n_layers - 1) + [NEVER])
        policy.confidence = lambda layer, h, prev: torch.tensor(self.scores[layer])  # type: ignore
        return policy


@pytest.mark.parametrize("scores, depth", [
    ([[0.9, 0.1], [0.1, 0.1], [0.1, 0.9], [0.1, 0.1]], 3),  # row 0 stays eligible (sticky)
    ([[0.9, 0.1], [0.1, 0.1], [0.1, 0.1], [0.1, 0.1]], 0),  # row 1 never: no exit
    ([[0.9, 0.9], [0.1, 0.1], [0.1, 0.1], [0.1, 0.1]], 1),  # both at once
    ([[0.1, 0.1], [0.1, 0.1], [0.1, 0.1], [0.9, 0.9]], 0),  # only after the last block
])
def test_sticky_batch_rule(scores: List[List[float]], depth: int) -> None:
    policy = Scripted(scores).policy(0.5, 4)
    step = ExitStep.start(policy, 2)
    h = torch.zeros(2, 1, 8)
    for layer in range(4):
        if step.after_block(layer, h, h):
            break
    assert step.depth == depth


def test_eligibility_travels_to_the_next_node() -> None:
    scores = [[0.9, 0.1], [0.1, 0.1], [0.1, 0.9], [0.1, 0.1]]
    policy = Scripted(scores).policy(0.5, 4)
    first = ExitStep.start(policy, 2)
    h = torch.zeros(2, 1, 8)
    for layer in range(2):  # node one: blocks 0 and 1
        assert not first.after_block(layer, h, h)
    assert first.eligible_list() == [True, False]
    second = ExitStep.start(policy, 2, first.eligible_list())  # node two: blocks 2 and 3
    assert second.after_block(2, h, h) and second.depth == 3


def test_kv_fill_writes_each_skipped_blocks_projections(ring_model: Path) -> None:
    """After an exit, each skipped block's cached K/V equal its own projections (after its
    norm, with RoPE on K) of the exit state."""
    from mdiedge.model.layers import apply_rope

    model = load_model(ring_model)
    model.setup_cache(2, 32)
    policy = ExitPolicy("similarity", [-2.0] * 5 + [NEVER])  # every row exits after block 0
    slots, positions = torch.tensor([1, 0]), [3, 7]
    x = torch.randn(2, 1, model.cfg.dim)
    step = ExitStep.start(policy, 2)
    with torch.no_grad():
        out = model.run_blocks(x, slots, positions, step)
        assert step.depth == 1
        exit_state = model.layers["0"](x, *model._attention_inputs(x, positions)[0], slots,
                                        positions)  # block 0 again: the same keys rewritten
        assert_close(out, exit_state, model_path_length(model.cfg))
        for i in range(1, 6):
            block = model.layers[str(i)]
            normed = block.attn_norm(out)
            k = block.attn.wk(normed).view(2, 1, model.cfg.n_kv_heads, -1).transpose(1, 2)
            v = block.attn.wv(normed).view(2, 1, model.cfg.n_kv_heads, -1).transpose(1, 2)
            cos, sin, _ = model._attention_inputs(out, positions)[0]
            k = apply_rope(k, cos, sin)
            for row, (slot, pos) in enumerate(zip(slots.tolist(), positions)):
                for cache, own in ((block.attn.cache.k, k), (block.attn.cache.v, v)):
                    assert_close(cache[slot, :, pos], own[row, :, 0], 2 * model.cfg.dim)


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("criterion", ["softmax", "similarity"])
def test_a_threshold_no_token_passes_changes_nothing(ring_model: Path, stages: int,
                                                      criterion: str) -> None:
    base = LocalEngine(ring_model, stages=stages).generate("hello ring", 12, 3, GREEDY)
    exits = LocalEngine(ring_model, stages=stages, early_exit=settings(criterion, 2.0))
    out = exits.generate("hello ring", 12, 3, GREEDY, micro_batch=2)
    assert tokens_of(out) == tokens_of(base)
    assert out.early_exit["exited"] == 0 and out.early_exit["mean_layers"] == 6.0


def test_exits_are_counted_and_change_the_path(ring_model: Path) -> None:
    engine = LocalEngine(ring_model, early_exit=settings("similarity", -2.0))
    out = engine.generate("hello ring", 10, 2, GREEDY)
    e = out.early_exit
    assert e["criterion"] == "similarity" and e["tokens"] == 18 and e["exited"] == 18
    assert e["exit_rate"] == {"1": 1.0} and e["mean_layers"] == 1.0 and e["kv_fill_s"] > 0
    assert json.loads(json.dumps(out.as_dict()))["early_exit"] == e


@pytest.mark.parametrize("nodes, criterion, threshold", [
    (2, "similarity", 0.2), (3, "softmax", 0.02), (4, "similarity", 0.5), (3, "classifier", 0.5)])
def test_the_ring_exits_like_in_process_stages(ring_model: Path, tmp_path: Path, nodes: int,
                                               criterion: str, threshold: float) -> None:
    """A real ring (messages that exited on one node, filled on the next) gives the tokens of
    in-process stages with the same split, and reports the same exits."""
    from mdiedge.roles.local_ring import LocalRing
    from mdiedge.engine.ring import RingEngine

    model = copy_model(ring_model, tmp_path)
    if criterion == "classifier":
        train_tiny_classifier(model)
    cfg = load_config(model)
    chosen = exit_settings(model, cfg, content_hash(model), criterion, str(threshold))
    local = LocalRing(nodes - 1)
    with local as workers:
        engine = RingEngine(workers, model, secret=local.secret, early_exit=chosen,
                            share_path=nodes != 3)  # 3 nodes: the tensors are sent
        try:
            out = engine.generate("hello ring", 16, 3, GREEDY, micro_batch=1)
            placements = [p.layers for p in engine.starter.placements]
        finally:
            engine.close()
    reference = LocalEngine(model, early_exit=chosen)
    reference.ranges = placements
    reference.chunks = [load_model(model, layers=r, embedding=i == 0, head=i == 0)
                        for i, r in enumerate(placements)]
    reference.model = reference.chunks[0]
    ref = reference.generate("hello ring", 16, 3, GREEDY, micro_batch=1)
    assert tokens_of(out) == tokens_of(ref)
    assert out.early_exit["exit_rate"] == ref.early_exit["exit_rate"]
    assert out.early_exit["exited"] > 0


def copy_model(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def train_tiny_classifier(model: Path) -> None:
    cfg = load_config(model)
    torch.manual_seed(0)
    classifier = ExitClassifier(cfg.n_layers, cfg.dim)
    with torch.no_grad():
        for p in classifier.parameters():
            p.normal_(0, 0.5)
    save_classifier(classifier, model / CLASSIFIER_FILE, content_hash(model))


def test_calibration_files_round_trip(ring_model: Path, tmp_path: Path) -> None:
    from mdiedge.tools.earlyexit.calibrate import write_calibration

    model = copy_model(ring_model, tmp_path)
    digest = content_hash(model)
    train_tiny_classifier(model)
    assert content_hash(model) == digest  # the classifier is not part of the model's identity
    write_calibration(model, digest, 0.95, {"similarity": {
        "thresholds": [None, 0.9, 0.8, None, 0.7]}}, {"text": "x"})
    cfg = load_config(model)
    found = exit_settings(model, cfg, digest, "similarity")
    assert found.thresholds == [NEVER, 0.9, 0.8, NEVER, 0.7, NEVER]
    with pytest.raises(ConfigError, match="no calibrated thresholds for 'softmax'"):
        exit_settings(model, cfg, digest, "softmax")
    assert load_classifier(model / CLASSIFIER_FILE, cfg, digest).n_layers == 6


@pytest.mark.parametrize("body, message", [
    ([0.5, 0.5], "2 thresholds, but the model has 6 blocks, so 5 exit points"),
    ({"thresholds": [0.5, "x", 0.5, 0.5, 0.5]}, "threshold 1 is 'x'"),
    ({"other": 1}, "thresholds must be a list"),
])
def test_bad_threshold_files(ring_model: Path, tmp_path: Path, body: Any, message: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(body))
    cfg = load_config(ring_model)
    with pytest.raises(ConfigError, match=message):
        exit_settings(ring_model, cfg, content_hash(ring_model), "softmax", str(path))


def test_a_classifier_of_another_model_is_refused(ring_model: Path, tiny_llama: Path,
                                                  tmp_path: Path) -> None:
    model = copy_model(ring_model, tmp_path)
    other = ExitClassifier(6, load_config(model).dim)
    save_classifier(other, model / CLASSIFIER_FILE, content_hash(tiny_llama))
    with pytest.raises(ConfigError, match="exit classifier of another model"):
        exit_settings(model, load_config(model), content_hash(model), "classifier", "0.5")


def test_unknown_criterion_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown early-exit criterion 'fast'"):
        ExitPolicy("fast", [0.5])


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MDIEDGE, *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["--early-exit", "fast"], "--early-exit: expected one of softmax, similarity, classifier"),
    (["--exit-threshold", "0.5"], "--exit-threshold: expected given with --early-exit"),
    (["--early-exit", "softmax", "--exit-threshold", "nope"],
     "--exit-threshold 'nope' is neither a number nor a file"),
])
def test_cli_bad_input_is_one_line(args: List[str], message: str) -> None:
    out = run_cli("generate", "ROMEO:", "-n", "4", "--nodes", "1", *args)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_cli_threshold_file_for_other_layers(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("[0.5, 0.5, 0.5]")
    out = run_cli("generate", "ROMEO:", "-n", "4", "--nodes", "3", "--early-exit", "similarity",
                  "--exit-threshold", str(path))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"mdiedge: error: {path}: 3 thresholds, but the model has 12 blocks, so 11 exit points"]


def test_cli_generate_reports_early_exit(ring_model: Path) -> None:
    out = run_cli("generate", "hello ring", "-n", "6", "--nodes", "2", "--model",
                  str(ring_model), "--early-exit", "similarity", "--exit-threshold", "-2",
                  "--json")
    assert out.returncode == 0, out.stderr
    e = json.loads(out.stdout)["early_exit"]
    assert e["criterion"] == "similarity" and e["exit_rate"] == {"1": 1.0}


@pytest.mark.parametrize("value, message", [
    ("-inf", "is not a finite number"), ("nan", "is not a finite number")])
def test_non_finite_threshold_is_refused(ring_model: Path, value: str, message: str) -> None:
    cfg = load_config(ring_model)
    with pytest.raises(ConfigError, match=message):
        exit_settings(ring_model, cfg, content_hash(ring_model), "similarity", value)


def test_workers_get_exact_thresholds_and_the_classifier_digest(ring_model: Path,
                                                               tmp_path: Path) -> None:
    from mdiedge.roles.earlyexit import cache_suffix, exit_assignment, file_sha256, has_parts
    from mdiedge.runtime.protocol import ExitAssignment

    model = copy_model(ring_model, tmp_path)
    train_tiny_classifier(model)
    chosen = exit_settings(model, load_config(model), content_hash(model), "classifier",
                           "0.1234567")
    spec = exit_assignment(chosen)
    assert spec.thresholds == [0.1234567] * 5
    assert spec.classifier == file_sha256(model / CLASSIFIER_FILE)
    assert ExitAssignment.from_json(spec.to_json(), 6) == spec
    assert cache_suffix(spec).endswith(spec.classifier[:16]) and has_parts(model, spec)
    other = ExitAssignment("classifier", spec.thresholds, "0" * 64)  # a retrained classifier
    assert not has_parts(model, other)
    with pytest.raises(ValueError, match="not a sha256"):
        ExitAssignment.from_json(dict(spec.to_json(), classifier="zz"), 6)
