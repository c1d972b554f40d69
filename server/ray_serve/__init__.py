"""namazu as a Ray Serve application: `python -m namazu.server --replicas MIN:MAX [engine flags]`.

- `deployments.py`  `NamazuEngine` (one namazu engine per replica, its own OpenAI app inside) and
                    `NamazuIngress` (the HTTP entry: tokenizes, hashes the prompt, forwards, retries);
- `request_router.py`  namazu's KV-aware cost as a Ray Serve custom request router;
- `autoscaling.py`  the custom autoscaling policy on queue depth and KV usage;
- `asgi_bridge.py`  runs an ASGI app in-process and streams its response (replica side);
- `launch.py`       `ray.init` / `serve.run` from the server's parsed flags.

Nothing in `namazu` imports this package unless `--replicas` is given, so Ray stays optional.
"""
