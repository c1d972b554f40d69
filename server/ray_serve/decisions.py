"""The Ray Serve request router's decisions, for the ingress's /metrics.

Ray Serve ships the request-router class to the ingress by value (cloudpickle), so state kept in the
router's own module would be a private copy; this module is imported by reference from both sides.
One router per deployment handle per process; the ingress holds one handle.
"""
from __future__ import annotations

_decisions: dict[str, int] = {}
_cost: dict[str, float] = {}


def record(replica: str) -> None:
    _decisions[replica] = _decisions.get(replica, 0) + 1


def record_costs(costs: dict[str, float]) -> None:
    _cost.update(costs)


def snapshot() -> dict[str, dict[str, float]]:
    return {"decisions": dict(_decisions), "cost": dict(_cost)}


def render() -> bytes:
    lines = ["# TYPE namazu_router_decisions_total counter"]
    lines += [f'namazu_router_decisions_total{{replica="{r}"}} {n}' for r, n in _decisions.items()]
    lines += ["# TYPE namazu_router_replica_cost gauge"]
    lines += [f'namazu_router_replica_cost{{replica="{r}"}} {c}' for r, c in _cost.items()]
    return ("\n".join(lines) + "\n").encode()
