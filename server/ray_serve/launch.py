"""Builds and runs namazu's Ray Serve application from the server's flags."""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from namazu.engine_config import EngineConfig

logger = logging.getLogger("namazu.ray_serve")


def parse_replicas(value: str) -> tuple[int, int]:
    """'MIN:MAX' (or 'N' for N:N) -> (min, max), 1 <= min <= max."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", value)
    if not m:
        raise ValueError(f"--replicas {value!r}: expected MIN:MAX (e.g. 1:4) or N")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1 or hi < lo:
        raise ValueError(f"--replicas {value!r}: need 1 <= MIN <= MAX")
    return lo, hi


@dataclass
class ServeOptions:
    min_replicas: int
    max_replicas: int
    host: str = "127.0.0.1"
    port: int = 8000
    ray_address: str | None = None      # None: a local Ray on this machine
    ray_num_cpus: float | None = None   # local Ray only; default: this machine's cores
    replica_cpus: float | None = None   # Ray CPUs reserved per engine replica; default: cores / max replicas
    replica_threads: int = 1            # OMP/torch threads per engine replica
    policy: str = "kv"
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 20.0
    target_queue: float = 1.0
    target_running: float = 4.0
    served_model_name: str | None = None
    api_key: str | None = None
    app_name: str = "namazu"


def build_application(config: EngineConfig, opts: ServeOptions, num_cpus: float) -> Any:
    from ray import serve
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    from server.ray_serve.deployments import NamazuEngine, NamazuIngress

    engine_kwargs = dataclasses.asdict(config)
    replica_cpus = opts.replica_cpus if opts.replica_cpus is not None else max(0.1, num_cpus / opts.max_replicas)
    router = RequestRouterConfig(
        request_router_class="server.ray_serve.request_router:NamazuRequestRouter",
        request_router_kwargs={"policy": opts.policy}, request_routing_stats_period_s=0.5)
    options: dict[str, Any] = dict(
        name="NamazuEngine", request_router_config=router, max_ongoing_requests=max(8, config.max_num_seqs * 2),
        ray_actor_options={"num_cpus": replica_cpus, "runtime_env": {"env_vars": {
            "OMP_NUM_THREADS": str(opts.replica_threads), "MKL_NUM_THREADS": str(opts.replica_threads)}}},
        graceful_shutdown_timeout_s=120, graceful_shutdown_wait_loop_s=1, health_check_period_s=2,
        health_check_timeout_s=30)
    if opts.min_replicas == opts.max_replicas:
        options["num_replicas"] = opts.min_replicas
    else:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=opts.min_replicas, max_replicas=opts.max_replicas, initial_replicas=opts.min_replicas,
            metrics_interval_s=0.5, look_back_period_s=2.0, upscale_delay_s=opts.upscale_delay_s,
            downscale_delay_s=opts.downscale_delay_s,
            policy=AutoscalingPolicy(policy_function="server.ray_serve.autoscaling:QueueAndKVPolicy",
                                     policy_kwargs={"target_queue": opts.target_queue,
                                                    "target_running": opts.target_running}))
    engine = serve.deployment(NamazuEngine).options(**options).bind(
        engine_kwargs, opts.served_model_name, opts.api_key)
    ingress = serve.deployment(NamazuIngress).options(
        name="NamazuIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
    return ingress.bind(engine, config.tokenizer or config.model, config.block_size)


def start(config: EngineConfig, opts: ServeOptions) -> None:
    """Starts Ray (or joins `opts.ray_address`) and the application; returns once it is ready."""
    import ray
    from ray import serve

    # Replicas import namazu and server from this checkout: hand them the same import path.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    if not ray.is_initialized():
        if opts.ray_address:
            ray.init(address=opts.ray_address, runtime_env={"env_vars": {"PYTHONPATH": path}})
        else:
            ray.init(num_cpus=opts.ray_num_cpus or os.cpu_count() or 1, include_dashboard=False,
                     runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=False)
    num_cpus = float(ray.cluster_resources().get("CPU", 1.0))
    serve.start(http_options={"host": opts.host, "port": opts.port})
    app = build_application(config, opts, num_cpus)
    serve.run(app, name=opts.app_name, route_prefix="/")
    logger.info("namazu on Ray Serve: %d..%d replicas behind http://%s:%d (router %s)", opts.min_replicas,
                opts.max_replicas, opts.host, opts.port, opts.policy)


def stop(opts: ServeOptions) -> None:
    import ray
    from ray import serve

    serve.shutdown()
    if not opts.ray_address:
        ray.shutdown()


def serve_forever(config: EngineConfig, opts: ServeOptions) -> None:
    start(config, opts)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop(opts)
