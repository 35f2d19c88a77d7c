"""The starter as a long-lived process: it owns the ring and serves generations and status
over its own control plane (``mdiedge starter``; ``mdiedge generate --starter URL`` and
``mdiedge status --starter URL`` are its clients). Generations go through the engine's one
scheduler, so requests that fit the ring's KV slots run together."""
from __future__ import annotations

from typing import Any, Dict, List

from ..base import defaults
from ..base.errors import GenerationError
from ..base.request import SamplingParams, named
from ..engine.engine import Engine
from ..runtime.control import ControlServer

GENERATE_FIELDS = {"prompt": str, "max_new_tokens": int, "samples": int, "temperature": float,
                   "top_k": int, "top_p": float, "seed": int, "micro_batch": int,
                   "stop": list}


def check_fields(body: Dict[str, Any], fields: Dict[str, type]) -> None:
    """ValueError naming the first unknown or mistyped field of a request body."""
    for key, value in body.items():
        kind = fields.get(key)
        if kind is None:
            raise ValueError(f"unknown field {key!r}")
        if not isinstance(value, (int, float) if kind is float else kind) or isinstance(value, bool):
            raise ValueError(f"field {key!r} must be {kind.__name__}, got {value!r}")


def status_body(engine: Engine) -> Dict[str, Any]:
    """``GET /status`` of a starter, on its control plane and on its API alike: every node of
    its ring (``mdiedge status --starter URL`` reads either)."""
    return {"nodes": [s.to_json() for s in engine.status()]}


class StarterServer:
    """Routes ``GET /status`` and ``POST /generate`` of ``control`` to ``engine``."""

    def __init__(self, engine: Engine, control: ControlServer) -> None:
        self.engine, self.control = engine, control
        control.add_routes({("GET", "/status"): self.status,
                            ("POST", "/generate"): self.generate})

    def start(self) -> "StarterServer":
        self.control.start()
        return self

    def close(self) -> None:
        self.control.stop()
        self.engine.close()

    def status(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        return status_body(self.engine)

    def generate(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        check_fields(body, GENERATE_FIELDS)
        engine = self.engine
        ring, before = engine.ring_id(), engine.link_stats()  # [] before the first ring
        try:
            params = SamplingParams(float(body.get("temperature", defaults.TEMPERATURE)),
                                    body.get("top_k", defaults.TOP_K),
                                    float(body.get("top_p", defaults.TOP_P)),
                                    body.get("seed", defaults.SEED))
            out = self.engine.generate(body.get("prompt", ""),
                                       body.get("max_new_tokens", defaults.MAX_NEW_TOKENS),
                                       body.get("samples", 1), params, body.get("micro_batch", 0),
                                       stop=body.get("stop", []))
        except GenerationError as e:  # the field as this body names it
            raise type(e)(named(e, {"n_samples": "samples"})[1], e.field) from None
        result = out.as_dict()
        result["nodes"] = engine.ring_nodes()
        result["model"] = str(engine.path)
        since = before if engine.ring_id() is ring else []  # a ring set up anew counts from 0
        result["links"] = link_deltas(since, engine.link_stats())
        return result


def link_deltas(before: List[Dict[str, Any]], after: List[Dict[str, Any]]
                ) -> List[Dict[str, Any]]:
    """A request's share of each link's frames and bytes: ``after`` less ``before`` (both
    counted since the same ring's set-up; ``before`` empty for a ring set up meanwhile). The
    totals stay in ``mdiedge status --json``. Requests that ran meanwhile are counted in."""
    earlier = {(b.get("from"), b.get("to")): b for b in before}
    out = []
    for link in after:
        then = earlier.get((link.get("from"), link.get("to")), {})
        out.append(dict(link, **{k: link[k] - then.get(k, 0) for k in ("frames", "bytes")
                                 if isinstance(link.get(k), int)}))
    return out
