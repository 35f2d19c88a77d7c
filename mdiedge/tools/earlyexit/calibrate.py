"""``mdiedge calibrate-exit``: per criterion, the thresholds after each block that reach a target
top-1 agreement with the full model on held-out text, and the exit classifier.

Teacher-forced: every block's output at every position, the head's top-1 on it and the three
confidences (``earlyexit.policy``). A token exits after the first block whose confidence reaches its
threshold, and agrees when that block's top-1 is the last block's. Each block's threshold is the
lowest whose exits agree at least a precision level of the time; the level whose whole rule reaches
``target`` with the fewest blocks per token wins (CALM's calibration, by a simpler search).

Text: the classifier trains on ``train_tokens`` before the held-out tail; thresholds are chosen on
the first half of the first ``tokens`` held-out tokens; ``mdiedge bench --early-exit`` measures on
those after (their count is in ``early_exit.json``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...base.errors import ConfigError
from ...model.earlyexit.files import (CLASSIFIER_FILE, THRESHOLDS_FILE, save_classifier,
                                      thresholds_to_json)
from ...model.earlyexit.policy import (CLASSIFIER_HIDDEN, CRITERIA, NEVER, ExitClassifier,
                                       ExitPolicy, ExitStep, cosine, softmax_margin)

MIN_EXITS = 16  # fewer calibration tokens than this past a threshold: never exit there
MIN_TOKENS = 256  # held-out tokens (each half) below which calibrating or measuring is refused


@dataclass
class LayerTrace:
    """Per block (rows) and position (columns): the head's top-1, whether it is the last block's,
    each criterion's confidence."""

    top1: Tensor  # (L, N) long
    agree: Tensor  # (L, N) bool
    scores: Dict[str, Tensor]  # criterion -> (L, N) float

    @property
    def tokens(self) -> int:
        return int(self.top1.shape[1])


def held_out_halves(tokens: List[int], what: str) -> Tuple[List[int], List[int]]:
    """(calibration, the bench's measurement); ConfigError when either is too short."""
    half = len(tokens) // 2
    if half < MIN_TOKENS:
        raise ConfigError(f"{what}: {len(tokens)} held-out tokens, fewer than the "
                          f"{2 * MIN_TOKENS} needed (a longer text, or a larger held-out share)")
    return tokens[:half], tokens[half:]


@torch.no_grad()
def block_states(model: Any, tokens: List[int], window: int) -> Tuple[Tensor, Tensor]:
    """Every block's output (L, N, dim) and the embedding (N, dim), over ``window``-token windows
    from position 0 (the last token, with no target, left out)."""
    states, embeds = [], []
    for start in range(0, len(tokens) - 1, window):
        chunk = torch.tensor(tokens[start:start + window])[None]  # (1, T)
        states.append(torch.stack(model.hidden_states(chunk))[:, 0])  # (L, T, dim)
        embeds.append(model.embed_tokens(chunk)[0])
    h = torch.cat(states, dim=1)[:, :len(tokens) - 1]
    return h, torch.cat(embeds)[:len(tokens) - 1]


@torch.no_grad()
def trace(model: Any, states: Tensor, embeds: Tensor,
          classifier: Optional[ExitClassifier] = None) -> LayerTrace:
    top1 = torch.stack([model.head_logits(h).argmax(-1) for h in states])  # (L, N)
    margins = torch.stack([softmax_margin(model.head_logits(h)) for h in states])
    previous = torch.cat([embeds[None], states[:-1]])  # each block's input
    scores = {"softmax": margins, "similarity": cosine(states, previous)}
    if classifier is not None:
        scores["classifier"] = torch.stack([classifier(i, h) for i, h in enumerate(states)])
    return LayerTrace(top1, top1 == top1[-1], scores)


def train_classifier(states: Tensor, agree: Tensor, steps: int = 300, lr: float = 3e-3,
                     seed: int = 0) -> ExitClassifier:
    """Per block, an MLP from its output to whether the head there agrees with the last block (BCE,
    Adam, full batch)."""
    n_layers, _, dim = states.shape
    torch.manual_seed(seed)
    classifier = ExitClassifier(n_layers, dim)
    with torch.no_grad():
        for p in (classifier.w1, classifier.w2):
            p.normal_(0, dim ** -0.5 if p is classifier.w1 else classifier.hidden ** -0.5)
    opt = torch.optim.Adam(classifier.parameters(), lr=lr)
    target = agree.float()
    for _ in range(steps):
        logits = torch.stack([classifier.logit(i, states[i]) for i in range(n_layers)])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return classifier.eval()


def layer_threshold(scores: Tensor, agree: Tensor, precision: float) -> float:
    """The lowest threshold whose tokens at or above it agree at least ``precision`` of the time (at
    least ``MIN_EXITS`` of them), else never."""
    order = torch.argsort(scores, descending=True)
    hits = agree[order].float().cumsum(0)
    counts = torch.arange(1, len(order) + 1, dtype=torch.float32)
    ok = (hits / counts >= precision) & (counts >= MIN_EXITS)
    ok &= torch.cat([scores[order][:-1] > scores[order][1:], torch.tensor([True])])  # ties
    if not bool(ok.any()):
        return NEVER
    last = int(torch.nonzero(ok).max())
    return float(scores[order][last])


def check_cost(criterion: str, cfg: Any) -> float:
    """Blocks' worth of weights read per check: the head for ``softmax``, a small MLP for
    ``classifier``, next to nothing for ``similarity``."""
    block = cfg.block_params()
    per_check = {"softmax": cfg.vocab_size * cfg.dim,
                 "classifier": cfg.dim * CLASSIFIER_HIDDEN}.get(criterion, 0)
    return per_check / block


def simulate(trace_: LayerTrace, criterion: str, thresholds: List[float],
             cost_per_check: float = 0.0) -> Dict[str, Any]:
    """Agreement, blocks per token, exit rates, and cost per token in blocks (run plus criteria
    checked)."""
    scores, n_layers = trace_.scores[criterion], trace_.top1.shape[0]
    limits = torch.tensor(thresholds[:n_layers - 1])[:, None]
    passes = torch.cat([scores[:-1] >= limits, torch.ones(1, trace_.tokens, dtype=torch.bool)])
    depth = passes.float().argmax(0)  # (N,) index of the first block that passes
    agreed = trace_.agree.gather(0, depth[None])[0]
    counts = torch.bincount(depth, minlength=n_layers).tolist()
    checked = torch.tensor([t < NEVER for t in thresholds[:n_layers - 1]] + [False])
    checks = (checked.cumsum(0)[depth]).float()  # checked blocks up to the exit
    return {"top1_agreement": round(float(agreed.float().mean()), 5),
            "mean_layers": round(float((depth + 1).float().mean()), 3),
            "cost": round(float((depth + 1).float().mean() + cost_per_check * checks.mean()), 3),
            "exit_rate": {str(i + 1): round(c / trace_.tokens, 4)
                          for i, c in enumerate(counts[:-1]) if c}}


PRECISIONS = [round(0.5 + 0.01 * i, 2) for i in range(51)]  # per-block precision levels tried


def prune(trace_: LayerTrace, criterion: str, thresholds: List[float], target: float,
          cost: float) -> Tuple[List[float], Dict[str, Any]]:
    """Stop checking, one block at a time, where that lowers the cost most and ``target`` is still
    reached."""
    best = simulate(trace_, criterion, thresholds, cost)
    while True:
        trials = []
        for i, t in enumerate(thresholds[:-1]):
            if t < NEVER:
                fewer = thresholds[:i] + [NEVER] + thresholds[i + 1:]
                found = simulate(trace_, criterion, fewer, cost)
                if found["top1_agreement"] >= target and found["cost"] < best["cost"]:
                    trials.append((found["cost"], fewer, found))
        if not trials:
            return thresholds, best
        _, thresholds, best = min(trials, key=lambda t: t[0])


def calibrate(trace_: LayerTrace, criterion: str, target: float,
              cost: float = 0.0) -> Dict[str, Any]:
    """The cheapest thresholds reaching ``target`` on the traced tokens: per precision level whose
    rule reaches it (tokens that never exit always agree), blocks not worth checking dropped
    (``prune``)."""
    scores, agree = trace_.scores[criterion], trace_.agree
    n_layers = scores.shape[0]
    best: Optional[Dict[str, Any]] = None
    for precision in PRECISIONS:
        thresholds = [layer_threshold(scores[i], agree[i], precision)
                      for i in range(n_layers - 1)] + [NEVER]
        if simulate(trace_, criterion, thresholds)["top1_agreement"] < target:
            continue
        thresholds, result = prune(trace_, criterion, thresholds, target, cost)
        if best is None or result["cost"] < best["cost"]:
            best = dict(result, precision=precision, thresholds=thresholds_to_json(thresholds))
    if best is None:  # not even exits at full precision: never exit
        best = dict(simulate(trace_, criterion, [NEVER] * n_layers, cost), precision=1.0,
                    thresholds=[None] * (n_layers - 1))
    return best


@torch.no_grad()
def decode_forced(model: Any, tokens: List[int], policy: Optional[ExitPolicy],
                  window: int) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
    """Top-1, next-token NLL and blocks run at every position, one decode step each
    (``window``-token windows from position 0)."""
    model.setup_cache(1, window)
    slots = torch.zeros(1, dtype=torch.long)
    preds, nlls, depths = [], [], []
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start:start + window + 1]
        for pos in range(len(chunk) - 1):
            x = model.embed_tokens(torch.tensor([[chunk[pos]]]))  # (1, 1, dim)
            step = ExitStep.start(policy, 1) if policy is not None and pos > 0 else None
            h = model.run_blocks(x, slots, [pos], step)
            logits = model.head_logits(h[:, -1])[0]  # (vocab,)
            preds.append(int(logits.argmax()))
            nlls.append(float(torch.nn.functional.cross_entropy(
                logits[None], torch.tensor([chunk[pos + 1]]))))
            depths.append(step.depth if step is not None and step.exited else model.cfg.n_layers)
    return torch.tensor(preds), torch.tensor(nlls), depths


def calibrate_decoding(model: Any, traced: LayerTrace, tokens: List[int], criterion: str,
                       target: float, classifier: Optional[ExitClassifier],
                       rounds: int = 4, window: int = 256) -> Dict[str, Any]:
    """``calibrate``, checked on real decode steps (an exit's filled KV, which later tokens attend
    to, is not in the traced states): while the decoded agreement falls short, the traced target
    rises by the shortfall."""
    aim, found = target, {}
    base, _, _ = decode_forced(model, tokens, None, window)
    for _ in range(rounds):
        found = calibrate(traced, criterion, aim, check_cost(criterion, model.cfg))
        thresholds = [NEVER if t is None else t for t in found["thresholds"]] + [NEVER]
        policy = ExitPolicy(criterion, thresholds, model.head_logits, classifier)
        pred, _, depths = decode_forced(model, tokens, policy, window)
        found["decoded_agreement"] = round(float((pred == base).float().mean()), 5)
        found["decoded_mean_layers"] = round(sum(depths) / len(depths), 3)
        if found["decoded_agreement"] >= target or aim >= 1.0:
            break
        aim = min(1.0, aim + target - found["decoded_agreement"])
    return found


def write_calibration(model_dir: Path, model_hash: str, target: float,
                      results: Dict[str, Dict[str, Any]], source: Dict[str, Any]) -> Path:
    """Keeping criteria calibrated before."""
    path = model_dir / THRESHOLDS_FILE
    body: Dict[str, Any] = {}
    if path.is_file():
        try:
            body = json.loads(path.read_text())
        except ValueError:
            body = {}
    if body.get("model_hash") != model_hash:
        body = {}
    criteria = dict(body.get("criteria", {}))
    criteria.update(results)
    body = {"model_hash": model_hash, "target_agreement": target, "calibrated_on": source,
            "criteria": {c: criteria[c] for c in CRITERIA if c in criteria}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    tmp.replace(path)
    return path


def run(model: Optional[str], text: Path, criteria: List[str], target: float,
        held_out: float = 0.1, tokens: int = 8192, window: int = 256,
        train_tokens: int = 16384) -> Dict[str, Any]:
    """The classifier first when asked for; files written beside the model; what it found."""
    from ...model.checkpoint import content_hash, load_model
    from ...engine.engine import TextModel

    text_model = TextModel(model, None)
    path = text_model.path
    model_dir = path if path.is_dir() else path.parent
    model_hash = content_hash(path)
    full = load_model(path)
    raw = text.read_text(encoding="utf-8")
    cut = int(len(raw) * (1 - held_out))
    held = text_model.tokenizer.encode(raw[cut:])
    calibration, _ = held_out_halves(held[:tokens], str(text))
    classifier = None
    if "classifier" in criteria:
        before = text_model.tokenizer.encode(raw[:cut]) if cut > 0 else held[tokens:]
        train_ids = before[:train_tokens]
        if len(train_ids) < MIN_TOKENS:
            raise ConfigError(f"{text}: {len(train_ids)} tokens to train the exit classifier "
                              f"on, fewer than {MIN_TOKENS} (a longer text)")
        states, embeds = block_states(full, train_ids, window)
        classifier = train_classifier(states, trace(full, states, embeds).agree)
        save_classifier(classifier, model_dir / CLASSIFIER_FILE, model_hash)
    states, embeds = block_states(full, calibration, window)
    traced = trace(full, states, embeds, classifier)
    results = {c: calibrate_decoding(full, traced, calibration, c, target, classifier)
               for c in criteria}
    source = {"text": text.name, "held_out": held_out, "tokens": traced.tokens,
              "held_out_tokens_used": len(calibration),
              "classifier_train_tokens": train_tokens if classifier is not None else 0}
    written = write_calibration(model_dir, model_hash, target, results, source)
    return {"model": str(path), "file": str(written), "target_agreement": target,
            "tokens": traced.tokens, "criteria": results}
