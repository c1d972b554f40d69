"""The application builder KubeRay (or `serve run`) imports: `server.ray_serve.builder:app_builder`.

`args` are the manifest's `applications[].args`: any EngineConfig field by name (`model`, `block_size`,
`max_num_seqs`, ...) plus `replicas` ("MIN:MAX"), `policy`, `replica_threads`, `replica_cpus`,
`upscale_delay_s`, `downscale_delay_s`, `target_queue`, `target_running`, `served_model_name`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from namazu.engine_config import EngineConfig
from server.ray_serve.launch import ServeOptions, build_application, parse_replicas

_SERVE_KEYS = {"policy": str, "replica_threads": int, "replica_cpus": float, "upscale_delay_s": float,
               "downscale_delay_s": float, "target_queue": float, "target_running": float,
               "served_model_name": str}


def parse_args(args: dict[str, Any]) -> tuple[EngineConfig, ServeOptions]:
    args = dict(args)
    lo, hi = parse_replicas(str(args.pop("replicas", "1:1")))
    serve_kw = {k: conv(args.pop(k)) for k, conv in _SERVE_KEYS.items() if k in args}
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ValueError(f"unknown namazu application args {unknown}; engine fields are {sorted(fields)} and "
                         f"serving options {sorted(_SERVE_KEYS)} + replicas")
    engine_kw = {}
    for k, v in args.items():
        default = fields[k].default
        if isinstance(default, bool):
            v = v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")
        elif isinstance(default, int) and not isinstance(v, int):
            v = int(v)
        elif isinstance(default, float) and not isinstance(v, float):
            v = float(v)
        engine_kw[k] = v
    return EngineConfig(**engine_kw), ServeOptions(lo, hi, **serve_kw)


def app_builder(args: dict[str, Any]) -> Any:
    config, opts = parse_args(args)
    import ray

    cpus = float(ray.cluster_resources().get("CPU", opts.max_replicas)) if ray.is_initialized() else float(
        opts.max_replicas)
    return build_application(config, opts, cpus)
