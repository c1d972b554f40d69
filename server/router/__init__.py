"""namazu's KV-aware router: an OpenAI-compatible front over several namazu replicas.

- `policy.py`  the cost of sending a request to each replica, and the baseline policies (round-robin,
               power of two choices, prefix affinity without load) the benchmark compares against;
- `index.py`   what the router believes each replica caches: an index fed by the replica's KV events,
               and the router's own routing history with a TTL for when events are missing;
- `pool.py`    the replicas: health checks, load and event polling;
- `proxy.py`   the ASGI app: picks a replica, forwards (streaming too), retries before the first byte;
- `__main__.py` `python -m server.router --replica URL [--replica URL ...] --port P`.

The policy and the index are plain Python, shared by the Ray Serve request router (`server/ray_serve.py`).
"""
