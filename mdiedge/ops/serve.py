"""The starter as a long-lived process: it owns the ring and serves generations and status
over its own control plane (``mdiedge starter``; ``mdiedge generate --starter URL`` and
``mdiedge status --starter URL`` are its clients)."""
from __future__ import annotations

import threading
from typing import Any, Dict, List

from ..runtime.control import Conflict, ControlServer
from ..model.sampling import SamplingParams
from ..roles.starter import RingEngine

_GENERATE_FIELDS = {"prompt": str, "max_new_tokens": int, "samples": int, "temperature": float,
                    "top_k": int, "top_p": float, "seed": int, "micro_batch": int}


class StarterServer:
    def __init__(self, engine: RingEngine, host: str, port: int) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.control = ControlServer(host, port, {
            ("GET", "/status"): self.status,
            ("POST", "/generate"): self.generate,
        }, auth=engine.auth)
        engine.control_url = f"http://{host}:{self.control.port}"

    def start(self) -> "StarterServer":
        self.control.start()
        return self

    def close(self) -> None:
        self.control.stop()
        self.engine.close()

    def nodes(self) -> List[Dict[str, Any]]:
        return [self.engine.own_status()] + self.engine.node_status()

    def status(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        return {"nodes": self.nodes()}

    def generate(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        for key, value in body.items():
            kind = _GENERATE_FIELDS.get(key)
            if kind is None:
                raise ValueError(f"unknown field {key!r}")
            if not isinstance(value, (int, float) if kind is float else kind) or isinstance(value, bool):
                raise ValueError(f"field {key!r} must be {kind.__name__}, got {value!r}")
        if not self.lock.acquire(blocking=False):
            raise Conflict("a generation is running on this ring; try again later")
        try:
            params = SamplingParams(float(body.get("temperature", 0.8)), body.get("top_k", 0),
                                    float(body.get("top_p", 0.95)), body.get("seed", 0))
            out = self.engine.generate(body.get("prompt", ""), body.get("max_new_tokens", 256),
                                       body.get("samples", 1), params, body.get("micro_batch", 0))
        finally:
            self.lock.release()
        result = out.as_dict()
        result["nodes"] = len(self.engine.workers) + 1
        result["model"] = str(self.engine.path)
        return result
