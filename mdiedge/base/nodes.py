"""The one record of a node: where its control plane answers and what share of the model it
declares. Ring files, the starter, the partitioner and status all use ``NodeSpec``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class NodeSpec:
    name: str
    host: str = "127.0.0.1"
    control_port: int = 0
    weight: float = 1.0  # relative compute speed: layers are split in proportion
    memory: Optional[int] = None  # bytes the node may hold (weights + KV); None: unlimited
    layers: Optional[Tuple[int, int]] = None  # a pinned block range [a, b)
    device: str = "cpu"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.control_port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.control_port}"
