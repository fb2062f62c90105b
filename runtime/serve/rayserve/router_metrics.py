"""What the engine replicas' routers count, exported on the Ray Serve ingress's /metrics: routing decisions, the
prefix hit rate, and per replica the ongoing requests Ray Serve sees plus the engine's own load and prefix-cache
numbers (EngineReplica.record_routing_stats).

Kept apart from the router: Ray Serve ships a request router's module by value, and this state (a lock, a registry)
must stay one per process.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

_REGISTRY = CollectorRegistry()
_ROUTED = Counter("mlcc_router_requests", "requests routed to an engine replica, by why that replica",
                  ["decision"], registry=_REGISTRY)
_routers: list[Any] = []
_routers_lock = threading.Lock()

# EngineReplica.record_routing_stats keys exported per replica: metric name, help
REPLICA_STATS = {
    "running": ("mlcc_replica_running_requests", "requests in the replica engine's running batch"),
    "waiting": ("mlcc_replica_queue_length", "requests waiting in the replica engine's queue"),
    "kv_pages_used": ("mlcc_replica_kv_pages_used", "KV-cache pages the replica's running requests hold"),
    "kv_pages_total": ("mlcc_replica_kv_pages_total", "KV-cache pages of the replica"),
    "prefix_cache_hit_rate": ("mlcc_replica_prefix_cache_hit_rate",
                              "prompt tokens the replica's prefix cache served, of all its prompt tokens"),
    "prefix_cache_cached_tokens": ("mlcc_replica_prefix_cache_cached_tokens",
                                   "prompt tokens the replica's prefix cache served"),
}


def register(router: Any) -> None:
    """A router whose counts and replicas this process's /metrics shows."""
    with _routers_lock:
        _routers.append(router)


def count(decision: str) -> None:
    _ROUTED.labels(decision).inc()


class _RouterCollector:
    """The routers' hit rate and the per-replica rows, read at scrape time."""

    def collect(self):
        with _routers_lock:
            routers = list(_routers)
        routed = sum(r.prompts_routed for r in routers)
        hit = GaugeMetricFamily("mlcc_router_prefix_hit_rate",
                                "requests routed to the replica holding their prompt's prefix, of those with a prompt")
        hit.add_metric([], sum(r.prefix_routed for r in routers) / routed if routed else 0.0)
        yield hit
        ongoing = GaugeMetricFamily("mlcc_replica_ongoing_requests", "requests at the replica as Ray Serve counts them",
                                    labels=["replica"])
        families = {k: GaugeMetricFamily(name, doc, labels=["replica"]) for k, (name, doc) in REPLICA_STATS.items()}
        for router in routers:
            for rid, load, stats in router.replica_rows():
                ongoing.add_metric([rid], load)
                for key, family in families.items():
                    if isinstance(stats.get(key), (int, float)):
                        family.add_metric([rid], stats[key])
        yield ongoing
        yield from families.values()


_REGISTRY.register(_RouterCollector())


def render_metrics() -> bytes:
    """The Prometheus text of the routers in this process."""
    return generate_latest(_REGISTRY)
