"""The Ray Serve request router's decisions and per-replica state, for the ingress's /metrics and
/router/state.

Ray Serve ships the request-router class to the ingress by value (cloudpickle), so state kept in the
router's own module would be a private copy; this module is imported by reference from both sides.
One router per deployment handle per process; the ingress holds one handle.
"""
from __future__ import annotations

import time
from typing import Any

_decisions: dict[str, int] = {}           # a counter: kept after its replica is gone
_cost: dict[str, float] = {}
_replicas: dict[str, dict[str, Any]] = {}  # live replicas only: what the router knows about each


def record(replica: str) -> None:
    _decisions[replica] = _decisions.get(replica, 0) + 1
    _replicas.setdefault(replica, {}).setdefault("first_routed_at", time.time())


def record_costs(costs: dict[str, float]) -> None:
    _cost.update(costs)


def observe(replica: str, **fields: Any) -> None:
    """What the router currently believes about a live replica (index size, load, process, warm time)."""
    _replicas.setdefault(replica, {}).update(fields)


def forget(replica: str) -> None:
    """The replica left the deployment (died, drained): nothing believed about it survives."""
    _cost.pop(replica, None)
    _replicas.pop(replica, None)


def snapshot() -> dict[str, Any]:
    return {"decisions": dict(_decisions), "cost": dict(_cost),
            "replicas": {r: dict(v, decisions=_decisions.get(r, 0)) for r, v in _replicas.items()}}


def render() -> bytes:
    lines = ["# TYPE namazu_router_decisions_total counter"]
    lines += [f'namazu_router_decisions_total{{replica="{r}"}} {n}' for r, n in _decisions.items()]
    lines += ["# TYPE namazu_router_replica_cost gauge"]
    lines += [f'namazu_router_replica_cost{{replica="{r}"}} {c}' for r, c in _cost.items()]
    lines += ["# TYPE namazu_router_replica_indexed_blocks gauge"]
    lines += [f'namazu_router_replica_indexed_blocks{{replica="{r}"}} {v.get("indexed_blocks", 0)}'
              for r, v in _replicas.items()]
    return ("\n".join(lines) + "\n").encode()
