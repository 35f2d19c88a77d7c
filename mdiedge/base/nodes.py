"""The one record of a node: where its control plane answers and what share of the model it
declares. Ring files, the starter, the partitioner and status all use ``NodeSpec``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from . import defaults


@dataclass(frozen=True)
class NodeSpec:
    name: str
    host: str = "127.0.0.1"
    control_port: int = 0
    weight: float = 1.0  # relative compute speed: layers are split in proportion
    memory: Optional[int] = None  # bytes the node may hold (weights + KV); None: unlimited
    layers: Optional[Tuple[int, int]] = None  # a pinned block range [a, b)
    device: str = "cpu"
    spare: bool = False  # held back, to take the layers of a node that is lost
    compression: Optional[str] = None  # codecs of the link into this node; None: the starter's

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.control_port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.control_port}"


@dataclass(frozen=True)
class StarterOptions:
    """The starter's own settings: its share of the ring (as a ``NodeSpec``) and how it runs
    the ring. Ring files, ``mdiedge starter`` and the library fill the same record."""

    host: str = "127.0.0.1"  # the address the last worker connects back to
    device: str = "cpu"
    dtype: str = "float32"
    quantize: str = ""  # quantize the blocks' float weights to this type on load ("": no)
    weight: float = 1.0
    memory: Optional[int] = None
    layers: Optional[Tuple[int, int]] = None
    max_payload: int = defaults.MAX_PAYLOAD
    prefill_chunk: int = defaults.PREFILL_CHUNK  # see defaults.PREFILL_CHUNK
    compression: str = "none"  # codecs of every link whose worker names none (``Compression``)
    timeout_s: float = defaults.RING_TIMEOUT_S
    stall_s: float = defaults.STALL_S  # see defaults.STALL_S
    recover: bool = True  # a lost node's layers move to a spare or the survivors
    rebalance_margin: float = defaults.REBALANCE_MARGIN  # 0: never re-split by measurements
    busy_poll_us: int = defaults.BUSY_POLL_US  # of the link back from the last worker
    encrypt: bool = True  # seal the ring's links (False: --no-encrypt, for measurements only)
    share_path: bool = True  # tell workers where the model lies (a shared filesystem)
    secret: Optional[bytes] = None
    control_url: Optional[str] = None  # set when the starter serves a control plane
    name: str = ""  # a starter restarted under its name (and secret) takes its workers over
#                     at once ("": never; a long-lived starter's is its host and control port)

    @property
    def spec(self) -> NodeSpec:
        return NodeSpec("starter", self.host, 0, self.weight, self.memory, self.layers,
                        self.device)
