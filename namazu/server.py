"""`python -m namazu.server`: the OpenAI-compatible HTTP server.

Engine flags come from EngineConfig (one definition each, shared with `LLM(...)`); the server adds
--host, --port, --api-key, --cache-salt-per-key, --served-model-name, --max-request-bytes, --log-level, its time limits
(--shutdown-timeout, --header-timeout, --body-timeout, --write-timeout, --keep-alive-timeout) and front-door
limits (--max-connections, --allowed-hosts, --grammar-threads, --max-grammar-compiles, --kv-events-key). The
engine (and its
model-runner worker) starts before the port opens, so a bad checkpoint or an impossible --max-model-len
fails here with its own message instead of on the first request.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

from namazu.engine_config import EngineConfig, parse_bytes

logger = logging.getLogger("namazu.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m namazu.server",
                                description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                                            "/v1/models, /health, /metrics) for DeepSeek-V3 / Kimi-K2 "
                                            "class models.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 picks a free one)")
    g.add_argument("--api-key", default=os.environ.get("NAMAZU_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health; several keys, "
                        "comma-separated, admit each (one per tenant) "
                        "(default: $NAMAZU_API_KEY, else no authentication)")
    g.add_argument("--cache-salt-per-key", action="store_true",
                   help="salt every request's prefix cache by the API key it came with: tenants sharing "
                        "this server never share cached blocks, and cached_tokens says nothing about "
                        "another key's prompts (a request's own cache_salt then subdivides its key's cache)")
    g.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: the checkpoint's name)")
    g.add_argument("--max-request-bytes", default="8MiB", metavar="SIZE",
                   help="largest request body; larger ones get 413 (default: 8MiB)")
    g.add_argument("--strict-fields", action="store_true",
                   help="refuse (400) a request field the server does not know; by default it is ignored and "
                        "logged, as vLLM does (fields it knows but cannot honour are refused either way)")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="log level of namazu and uvicorn (default: info)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT: stop accepting, give requests in flight this long to finish, then "
                        "end the rest with an error (503; an error event and [DONE] in streams) and exit 0 "
                        "(default: 30)")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="close a connection whose request headers are not complete this long after it opened "
                        "or its request began (default: 10)")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="answer 408 when a request body is not fully received in this long (default: 30)")
    g.add_argument("--write-timeout", type=float, default=30.0, metavar="S",
                   help="abandon a response (and abort its request) when the client has not read for this "
                        "long (default: 30)")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                   help="close an idle keep-alive connection after this long (default: 5)")
    from server.front_door import add_front_door_args
    add_front_door_args(g)
    g.add_argument("--kv-events-key", default=os.environ.get("NAMAZU_KV_EVENTS_KEY"), metavar="SECRET",
                   help="publish /kv/events block hashes keyed with this secret (give the router the same "
                        "--kv-events-key), so a reader without it cannot confirm a guessed prompt from them "
                        "(default: $NAMAZU_KV_EVENTS_KEY, else unkeyed)")
    g.add_argument("--admin-key", default=os.environ.get("NAMAZU_ADMIN_KEY"), metavar="KEY",
                   help="enable the operator routes (POST /admin/drafter: replace the drafter without a restart) "
                        "behind 'Authorization: Bearer KEY', a key distinct from --api-key "
                        "(default: $NAMAZU_ADMIN_KEY, else no admin routes)")
    g.add_argument("--drafter-root", default=None, metavar="DIR",
                   help="with --admin-key: the only directory (and its subdirectories) drafters may be loaded from")
    g.add_argument("--grammar-threads", type=int, default=1, metavar="N",
                   help="threads that compile structured-output grammars, apart from request preparation: a "
                        "storm of schemas keeps at most this many cores busy (default: 1)")
    g.add_argument("--max-grammar-compiles", type=int, default=8, metavar="N",
                   help="distinct grammar compiles queued or running at once; one more is a 429 (identical "
                        "grammars share one compile) (default: 8)")
    r = p.add_argument_group("replicas (Ray Serve; needs `pip install ray[serve]`)")
    r.add_argument("--replicas", default=None, metavar="MIN:MAX",
                   help="serve MIN..MAX engine replicas as a Ray Serve application behind namazu's KV-aware "
                        "router, autoscaled on queue depth and KV usage (N = N:N, fixed)")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. ray://head:10001 or auto); default: start Ray locally")
    r.add_argument("--ray-num-cpus", type=float, default=None, help="CPUs of a local Ray (default: all cores)")
    r.add_argument("--replica-threads", type=int, default=1, help="torch/OpenMP threads per replica (default 1)")
    r.add_argument("--upscale-delay-s", type=float, default=5.0,
                   help="seconds queue/KV pressure must last before a replica is added (default 5)")
    r.add_argument("--downscale-delay-s", type=float, default=20.0,
                   help="seconds a replica must be spare before it is drained and removed (default 20)")
    r.add_argument("--router-policy", default="kv", choices=("kv", "round_robin", "p2c", "affinity"),
                   help="replica choice: kv = namazu's KV-aware cost (default); the others are baselines")
    EngineConfig.add_cli_args(p)
    return p


def _uvicorn_server(config: object) -> object:
    """uvicorn.Server without its signal handlers: namazu's own (in `serve`) start a graceful shutdown
    on the first SIGTERM/SIGINT and force it on the second. uvicorn's would re-raise the signal after
    serving, exiting 143 before the engine is shut down."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            yield

    return Server(config)


async def _graceful_shutdown(server: object, engine: object, timeout: float) -> None:
    from namazu.async_engine import EngineUnavailableError

    engine.begin_drain()
    server.should_exit = True            # uvicorn stops accepting and waits for open responses
    logger.info("shutting down: waiting up to %g s for %d sequence(s) in flight", timeout,
                engine.num_admitted_seqs)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.num_admitted_seqs and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if engine.num_admitted_seqs:
        logger.warning("shutdown timeout: ending %d sequence(s) still in flight", engine.num_admitted_seqs)
        engine.fail_all(EngineUnavailableError(f"the server is shutting down (--shutdown-timeout={timeout:g} s "
                                               "passed); retry on another instance"))


async def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    """Serves until a signal (returns 0 after a graceful shutdown) or until the engine gives up on its
    workers (returns 1, so a supervisor restarts the server)."""
    import uvicorn

    from namazu.async_engine import AsyncEngine
    from server.app import build_app
    from server.front_door import allowed_hosts, fit_connection_cap
    from server.kv_event_keys import parse_key
    from server.timeouts import guarded_protocol

    engine = AsyncEngine(config, grammar_threads=args.grammar_threads, max_grammar_compiles=args.max_grammar_compiles)
    exit_code = 0
    try:
        app = build_app(engine, served_model_name=args.served_model_name, api_key=args.api_key,
                        max_request_bytes=parse_bytes(args.max_request_bytes), body_timeout=args.body_timeout,
                        write_timeout=args.write_timeout, strict_fields=args.strict_fields,
                        allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
                        kv_events_key=parse_key(args.kv_events_key), cache_salt_per_key=args.cache_salt_per_key,
                        admin_key=args.admin_key, drafter_root=args.drafter_root)
        uv = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, loop="none",
                            http=guarded_protocol(args.header_timeout, args.body_timeout,
                                                 fit_connection_cap(args.max_connections)),
                            timeout_keep_alive=args.keep_alive_timeout,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
        server = _uvicorn_server(uv)
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task] = []

        def on_signal(sig: signal.Signals) -> None:
            if tasks:                    # the second signal: do not wait any longer
                logger.warning("%s again: forcing shutdown", sig.name)
                server.force_exit = True
                engine.fail_all(RuntimeError("the server was stopped"))
                return
            logger.info("%s received: graceful shutdown", sig.name)
            tasks.append(asyncio.ensure_future(_graceful_shutdown(server, engine, args.shutdown_timeout)))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        started = asyncio.ensure_future(server.serve())
        while not server.started and not started.done():
            await asyncio.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            logger.info("serving %s on http://%s:%d (auth %s)", app.state.server.served_model_name,
                        args.host, port, "on" if args.api_key else "off")
        while not started.done():
            if engine.failed.is_set() and not server.should_exit:
                logger.error("the engine cannot serve any more (%s); exiting with status 1", engine.status)
                exit_code = 1
                server.should_exit = True
            await asyncio.wait({started}, timeout=0.2)
        await started
        if engine.error is not None:
            raise EngineFailed(str(engine.error))
    finally:
        engine.shutdown()
    return exit_code


class EngineFailed(RuntimeError):
    """The engine stopped under the server (a worker rank died or hung): exit non-zero so a supervisor
    restarts the server."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig.from_cli_args(args)
        parse_bytes(args.max_request_bytes)
        if args.api_key is not None and not args.api_key.strip():
            raise ValueError("--api-key (or $NAMAZU_API_KEY) is empty, which would turn authentication off "
                             "unnoticed; give a key, or unset it to run without authentication")
        from server.front_door import parse_api_keys
        keys = parse_api_keys(args.api_key)
        if args.cache_salt_per_key and keys is None:
            raise ValueError("--cache-salt-per-key needs --api-key: without keys every client is one tenant")
        if args.replicas is not None and keys is not None and len(keys) > 1:
            raise ValueError("--replicas takes one --api-key (its ingress forwards with it)")
        if args.replicas is not None and args.cache_salt_per_key:
            raise ValueError("--cache-salt-per-key is not served with --replicas yet; give each tenant's "
                             "requests a cache_salt")
        for name in ("shutdown_timeout", "header_timeout", "body_timeout", "write_timeout", "keep_alive_timeout"):
            if not getattr(args, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds")
        from server.front_door import check_front_door_args
        check_front_door_args(args)
        from server.kv_event_keys import parse_key
        parse_key(args.kv_events_key)
        from server.admin_routes import check_admin_args
        from server.front_door import parse_api_keys
        check_admin_args(args.admin_key, args.drafter_root, parse_api_keys(args.api_key))
        if args.grammar_threads < 1 or args.max_grammar_compiles < 1:
            raise ValueError("--grammar-threads and --max-grammar-compiles must be at least 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.replicas is not None:
        return _serve_replicas(args, config)
    import uvloop

    try:
        return uvloop.run(serve(args, config))
    except (FileNotFoundError, ValueError) as e:     # bad checkpoint path, config or memory budget
        print(f"error: {e}", file=sys.stderr)
        return 1
    except EngineFailed as e:
        print(f"error: the engine failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _serve_replicas(args: argparse.Namespace, config: EngineConfig) -> int:
    """--replicas: the same server as a Ray Serve application (Ray is imported only here)."""
    from server.ray_serve.launch import ServeOptions, parse_replicas, serve_forever

    try:
        lo, hi = parse_replicas(args.replicas)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import ray  # noqa: F401
    except ImportError:
        print("error: --replicas needs Ray Serve: pip install -r requirements-dev.txt (or 'ray[serve]')",
              file=sys.stderr)
        return 2
    serve_forever(config, ServeOptions(lo, hi, host=args.host, port=args.port, ray_address=args.ray_address,
                                       ray_num_cpus=args.ray_num_cpus, replica_threads=args.replica_threads,
                                       policy=args.router_policy, served_model_name=args.served_model_name,
                                       api_key=args.api_key, upscale_delay_s=args.upscale_delay_s,
                                       downscale_delay_s=args.downscale_delay_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
