"""``mdiedge bench --speculate``: greedy decoding with and without a drafter, side by side.

Per ring size, one engine runs each workload plain and speculating in alternating rounds (order
swapped each round, so a slow spell falls on both): ``repeat`` quotes a passage back (drafts
accepted), ``free`` continues one (drafts mostly guesses). Each row: whether every run gave the same
tokens, the median run's decode tokens/s both ways, their ratio, acceptance and tokens per ring
pass."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from ..base import defaults
from ..base.errors import UsageError
from ..engine.opening import EngineSpec, open_engine
from ..model.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
REPEAT_REQUEST = "Repeat the following text exactly, word for word:\n\n"
FREE_REQUEST = "Write a short story about a sailor who finds a map."
WAYS = ("plain", "spec")

Render = Callable[[str], str]  # a user message as an instruct model's templated prompt


@dataclass(frozen=True)
class Workload:
    """``templated``: rendered with a chat template (nothing added)."""

    name: str
    prompt: str
    templated: bool = False


def paragraphs(text: str) -> List[str]:
    """Split at blank lines, each ending with a newline."""
    return [p.strip("\n") + "\n" for p in text.split("\n\n") if p.strip()]


def passage(parts: Sequence[str], count: Callable[[str], int], tokens: int) -> List[str]:
    """The first paragraphs holding ``tokens``, or all."""
    chosen: List[str] = []
    for part in parts:
        chosen.append(part)
        if count("\n".join(chosen)) >= tokens:
            break
    return chosen


def workloads(text: str, count: Callable[[str], int], new_tokens: int,
              render: Optional[Render] = None) -> List[Workload]:
    """A passage of about ``new_tokens`` to quote back, and another part (or with ``render`` a chat
    request) to continue."""
    parts = paragraphs(text)
    if len(parts) < 2:
        raise UsageError("--text: need at least two paragraphs (separated by a blank line)")
    chosen = passage(parts, count, new_tokens)
    quoted = "\n".join(chosen)
    rest = parts[len(chosen):] or parts[-1:]
    if render is not None:
        return [Workload("repeat", render(REPEAT_REQUEST + quoted), True),
                Workload("free", render(FREE_REQUEST), True)]
    first_line = quoted.split("\n", 1)[0] + "\n"
    return [Workload("repeat", f"{quoted}\n{first_line}"),
            Workload("free", "\n".join(passage(rest[len(rest) // 2:], count, 64)))]


def compare(nodes: int, workload: str, runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Median decode tokens/s each way, ratio, same tokens or not, speculation figures summed."""
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    speculating = statistics.median(r["tokens_per_s"] for r in runs["spec"])
    texts = [r["token_ids"] for way in WAYS for r in runs[way]]
    stats = [r["speculation"] or {} for r in runs["spec"]]
    drafted = sum(s.get("drafted", 0) for s in stats)
    accepted = sum(s.get("accepted", 0) for s in stats)
    steps = sum(s.get("verify_steps", 0) for s in stats)
    emitted = sum(s.get("tokens_per_pass", 0.0) * s.get("verify_steps", 0) for s in stats)
    return {"nodes": nodes, "workload": workload,
            "plain_tokens_per_s": round(plain, 2), "spec_tokens_per_s": round(speculating, 2),
            "speedup": round(speculating / plain, 3) if plain > 0 else 0.0,
            "same_text": all(t == texts[0] for t in texts),
            "drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
            "verify_steps": steps,
            "tokens_per_pass": round(emitted / steps, 3) if steps else 0.0,
            "runs": {way: [round(r["tokens_per_s"], 2) for r in runs[way]] for way in WAYS}}


def order(round_: int) -> Sequence[str]:
    """Plain first in even rounds."""
    return WAYS if round_ % 2 == 0 else WAYS[::-1]


def _figures(out: Any) -> Dict[str, Any]:
    return {"tokens_per_s": out.timing.decode_tokens_per_s,
            "token_ids": [s["token_ids"] for s in out.samples],
            "speculation": out.speculation}


def measure(engine: Any, nodes: int, work: Sequence[Workload], speculate: str, samples: int,
            new_tokens: int, rounds: int, device: str = "cpu") -> Iterator[Dict[str, Any]]:
    """Each row as soon as measured: a warm-up, then ``rounds`` rounds each way. Set up once for the
    largest workload (never anew between runs)."""
    longest = max(len(engine.prompt(w.prompt, w.templated).ids) for w in work)
    engine.reserve(samples, longest + new_tokens)
    try:
        for workload in work:
            def run(way: str, n: int) -> Any:
                engine.speculating(speculate if way == "spec" else None, device)
                return engine.generate(workload.prompt, n, samples, GREEDY,
                                       templated=workload.templated)

            run("spec", 4)  # warm-up: the set-up and the first steps untimed
            run("plain", 4)
            runs: Dict[str, List[Dict[str, Any]]] = {way: [] for way in WAYS}
            for r in range(rounds):
                for way in order(r):
                    runs[way].append(_figures(run(way, new_tokens)))
            yield compare(nodes, workload.name, runs)
    finally:
        engine.speculating(None)


def ring_sizes(max_nodes: int) -> List[int]:
    """One process, and a local ring of ``max_nodes``."""
    return sorted({1, max_nodes})


def run_all(model: Path, speculate: str, max_nodes: int, samples: int, new_tokens: int,
            rounds: int, text: Path, render: Optional[Render] = None,
            measuring: Optional[Callable[[str], Any]] = None) -> Iterator[Dict[str, Any]]:
    """Each row as soon as measured; ``render``: an instruct model's chat template;
    ``measuring(what)`` wraps each wait."""
    from contextlib import nullcontext

    shown = measuring or (lambda what: nullcontext())
    source = text.read_text(encoding="utf-8", errors="replace")
    for nodes in ring_sizes(max_nodes):
        spec = EngineSpec(model=model, nodes=nodes, timeout_s=defaults.RING_TIMEOUT_S)
        with open_engine(spec) as engine:
            work = workloads(source, lambda s: len(engine.encode_prompt(s)), new_tokens, render)
            rows = measure(engine, nodes, work, speculate, samples, new_tokens, rounds)
            for workload in work:
                with shown(f"measuring {workload.name} on {nodes} node"
                           f"{'s' if nodes > 1 else ''}, plain and with {speculate}"):
                    row = next(rows)
                yield row
