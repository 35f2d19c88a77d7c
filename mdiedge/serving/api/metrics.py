"""``/metrics`` in Prometheus' text format, through prometheus-client, with the names people know
from vLLM and llama.cpp under an ``mdiedge_`` prefix.

Counters and histograms are updated as requests run (speculative decoding's ``mdiedge_spec_*`` when
a request ends, from its ``Speculation``'s stats); gauges (requests running and waiting, KV slots)
and the per-node figures (up, busy fraction, layers) are read when scraped: the nodes from
``nodes()``, the starter's and every worker's status."""
from __future__ import annotations

from typing import Any, Callable, Iterable, List

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                 0.75, 1.0, 2.5)
PASS_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)


class NodeCollector:
    """Per-node gauges, asked of ``nodes()`` at each scrape (a list of ``NodeStatus``)."""

    def __init__(self, nodes: Callable[[], List[Any]]) -> None:
        self.nodes = nodes

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["node", "role"]
        up = GaugeMetricFamily("mdiedge_node_up", "1 if the node answers its status, else 0",
                               labels=labels)
        busy = GaugeMetricFamily("mdiedge_node_busy_fraction", "Share of the node's wall time "
                                 "since its stage was set up spent computing", labels=labels)
        layers = GaugeMetricFamily("mdiedge_node_layers", "Transformer blocks the node holds",
                                   labels=labels)
        slots = GaugeMetricFamily("mdiedge_node_kv_slots_in_use", "KV slots the node holds "
                                  "for samples", labels=labels)
        for status in self.nodes():
            key = [status.name, status.role]
            up.add_metric(key, 0.0 if status.state == "down" else 1.0)
            busy.add_metric(key, float(status.busy_fraction))
            span = status.layers or [0, 0]
            layers.add_metric(key, float(span[1] - span[0]))
            slots.add_metric(key, float(status.slots_in_use))
        return [up, busy, layers, slots]


class ApiMetrics:
    """The server's metrics in a registry of its own (several servers may share a process)."""

    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series beside each counter (process-wide)
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("mdiedge_num_requests_running", "Requests holding KV slots",
                             registry=r)
        self.waiting = Gauge("mdiedge_num_requests_waiting", "Requests waiting for KV slots",
                             registry=r)
        self.slots_used = Gauge("mdiedge_kv_slots_in_use", "KV slots (samples) in use",
                                registry=r)
        self.slots_total = Gauge("mdiedge_kv_slots_total", "KV slots of the ring", registry=r)
        self.prompt_tokens = Counter("mdiedge_prompt_tokens", "Prompt tokens of admitted "
                                     "requests", registry=r)
        self.generation_tokens = Counter("mdiedge_generation_tokens", "Tokens generated",
                                         registry=r)
        self.requests = Counter("mdiedge_requests", "Finished requests by HTTP status code",
                                ["code"], registry=r)
        self.success = Counter("mdiedge_request_success", "Samples that ended, by finish "
                               "reason", ["finished_reason"], registry=r)
        self.ttft = Histogram("mdiedge_time_to_first_token_seconds", "From a request's "
                              "arrival to its first token", registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("mdiedge_inter_token_latency_seconds", "Between two tokens of a "
                             "sample", registry=r, buckets=TOKEN_BUCKETS)
        self.e2e = Histogram("mdiedge_e2e_request_latency_seconds", "From a request's arrival "
                             "to its end", registry=r, buckets=LATENCY_BUCKETS)
        self.cache_hits = Counter("mdiedge_prompt_cache_hits", "Requests whose prompt began "
                                  "with KV rows the prompt cache kept", registry=r)
        self.cached_tokens = Counter("mdiedge_prompt_cache_tokens", "Prompt tokens whose KV "
                                     "rows the prompt cache gave (not computed)", registry=r)
        self.speculation_drafted = Counter("mdiedge_spec_drafted_tokens", "Tokens drafted "
                                           "by speculative decoding", registry=r)
        self.speculation_accepted = Counter("mdiedge_spec_accepted_tokens", "Drafted tokens "
                                            "the model accepted", registry=r)
        self.speculation_steps = Counter("mdiedge_spec_verify_steps", "Steps that verified "
                                         "drafted tokens (one pass of the ring each)",
                                         registry=r)
        self.speculation_per_pass = Histogram("mdiedge_spec_tokens_per_pass", "A speculating "
                                              "request's tokens per verification pass",
                                              registry=r, buckets=PASS_BUCKETS)

    def speculated(self, stats: Any) -> None:
        """Count what a request's speculative decoding did (its ``SpeculationStats``), when it
        ends."""
        self.speculation_drafted.inc(stats.drafted)
        self.speculation_accepted.inc(stats.accepted)
        self.speculation_steps.inc(stats.steps)
        if stats.steps:
            self.speculation_per_pass.observe(stats.tokens_per_step)

    def watch(self, running: Callable[[], float], waiting: Callable[[], float],
              slots_used: Callable[[], float], slots_total: int,
              nodes: Callable[[], List[Any]]) -> None:
        """Read the gauges from these functions at each scrape."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.slots_used.set_function(slots_used)
        self.slots_total.set(slots_total)
        self.registry.register(NodeCollector(nodes))

    def render(self) -> bytes:
        return generate_latest(self.registry)
