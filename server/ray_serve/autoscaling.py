"""The autoscaling policy of namazu's Ray Serve deployment: queue depth and KV usage, not request counts.

Each engine replica reports (`NamazuEngine.record_autoscaling_stats`) its waiting sequences, running
sequences and KV-cache usage; Ray Serve averages them over its look-back window and calls this policy
on the controller. Scale up when requests queue or the KV cache fills, down when a replica's worth of
work would fit on the others; Ray Serve then applies the deployment's upscale/downscale delays and its
min/max bounds, and drains a replica before stopping it. Ongoing-request counts alone would not see a
replica whose few requests hold all its KV blocks.
"""
from __future__ import annotations

import math
from typing import Any

QUEUE, RUNNING, KV = "namazu_queue_depth", "namazu_num_running", "namazu_kv_usage"


class QueueAndKVPolicy:
    def __init__(self, target_queue: float = 1.0, target_running: float = 4.0, max_kv_usage: float = 0.8,
                 min_kv_usage: float = 0.3):
        self.target_queue, self.target_running = target_queue, target_running
        self.max_kv_usage, self.min_kv_usage = max_kv_usage, min_kv_usage

    def desired(self, n: int, queued: float, running: float, kv_mean: float) -> int:
        """Replicas wanted for `queued` waiting and `running` running sequences and a mean KV usage."""
        if n == 0:
            return 1 if queued + running > 0 else 0
        load = queued + running
        if queued / n > self.target_queue or kv_mean > self.max_kv_usage:
            return max(n + 1, math.ceil(load / self.target_running))
        if queued == 0 and kv_mean < self.min_kv_usage and n > 1 and load <= self.target_running * (n - 1) / 2:
            return n - 1     # the others absorb this replica's work at half their target load
        return n

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        queued = sum((metrics.get(QUEUE) or {}).values())
        running = sum((metrics.get(RUNNING) or {}).values())
        kv = list((metrics.get(KV) or {}).values())
        kv_mean = sum(kv) / len(kv) if kv else 0.0
        # Requests queued at the handles (not yet on a replica) are queue pressure too.
        queued += float(getattr(ctx, "total_queued_requests", 0.0) or 0.0)
        n = ctx.current_num_replicas
        want = self.desired(n, queued, running, kv_mean)
        state = dict(ctx.policy_state or {})
        state["namazu_last"] = {"queued": queued, "running": running, "kv_mean": kv_mean, "want": want}
        return want, state
