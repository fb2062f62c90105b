"""Ray Serve request router for the engine replicas: a request goes to the replica that last served a prompt starting
like its own (whose prefix cache likely holds that prefix), unless that replica is full or much busier than the
least-loaded one; otherwise, and for requests without a prompt, to the least-loaded replica.

It runs in the process that holds the engine deployment's handle (the ingress), so what it counts is exported on
the ingress's /metrics (runtime.serve.rayserve.router_metrics).
"""

from __future__ import annotations

import collections
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mlcc.runtime.serve.rayserve import router_metrics
from mlcc.runtime.serve.rayserve.prefix_index import PrefixIndex


class PrefixAffinityRouter(RequestRouter):
    """request_router_kwargs: block_chars (prompt characters per index block), min_match_chars (the shortest
    matched prefix worth routing for), max_imbalance (how many more ongoing requests the prefix's replica may have
    than the least-loaded one and still get it), capacity (index blocks kept)."""

    def initialize_state(self, block_chars: int = 64, min_match_chars: int = 128, max_imbalance: int = 4,
                         capacity: int = 200_000, **_: Any) -> None:
        self.index = PrefixIndex(block_chars, capacity)
        self.min_match_chars = min_match_chars
        self.max_imbalance = max_imbalance
        # request id -> (its prompt text, the replica preferred for it), until it is routed
        self._decisions: collections.OrderedDict[str, tuple[str, str | None]] = collections.OrderedDict()
        self.prefix_routed = 0
        self.prompts_routed = 0
        router_metrics.register(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        text = _prefix_of(pending_request)
        if not text or not candidate_replicas:
            return [candidate_replicas]   # the framework picks the least-loaded of a rank
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        owner, matched = self.index.match(text, set(by_id))
        preferred = None
        if owner is not None and matched >= min(self.min_match_chars, len(text)):
            loads = {rid: self._load(r) for rid, r in by_id.items()}
            if loads[owner] - min(loads.values()) <= self.max_imbalance:
                preferred = owner
        self._decisions[pending_request.metadata.internal_request_id] = (text, preferred)
        while len(self._decisions) > 10_000:   # requests cancelled before being routed never come back
            self._decisions.popitem(last=False)
        if preferred is None:
            return [candidate_replicas]
        # a full preferred replica falls through to the least-loaded of the others
        return [[by_id[preferred]], [r for rid, r in by_id.items() if rid != preferred]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        decision = self._decisions.pop(pending_request.metadata.internal_request_id, None)
        if decision is None:
            return
        text, preferred = decision
        rid = replica_id.to_full_id_str()
        self.index.insert(text, rid)
        self.prompts_routed += 1
        if preferred == rid:
            self.prefix_routed += 1
            router_metrics.count("prefix")
        else:
            router_metrics.count("least_loaded")

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget({r.to_full_id_str() for r in self._replica_id_set})

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.forget({r.replica_id.to_full_id_str() for r in replicas})

    def _load(self, replica: RunningReplica) -> int:
        """Ongoing requests at the replica as last probed (0 where not probed yet)."""
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def replica_rows(self) -> list[tuple[str, int, dict[str, Any]]]:
        """(replica id, ongoing requests, its routing stats) of every replica this router routes to."""
        return [(rid.unique_id, self._load(r), dict(r.routing_stats or {})) for rid, r in list(self._replicas.items())]


def _prefix_of(pending_request: PendingRequest | None) -> str:
    """The prompt text the ingress attached to a forwarded request ("" for anything else)."""
    if pending_request is None or not pending_request.args:
        return ""
    return getattr(pending_request.args[0], "prefix", "") or ""
