"""`python -m server.router --replica URL [--replica URL ...] --port P`: the KV-aware router."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from server.router.policy import DEFAULT_PREFIX_WEIGHT, DEFAULT_QUEUE_WEIGHT, DEFAULT_SPILL_FACTOR, POLICIES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server.router",
                                description="OpenAI-compatible KV-aware router over namazu replicas.")
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="a namazu server (http://host:port); repeat for each replica")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to bind (default: 8080; 0 picks a free one)")
    p.add_argument("--tokenizer", default=None, help="tokenizer (or checkpoint) directory the replicas use; "
                                                      "default: the embedded namazu-tiny model's")
    p.add_argument("--block-size", type=int, default=None,
                   help="the replicas' --block-size (default: learned from their /load)")
    p.add_argument("--policy", default="kv", choices=sorted(POLICIES),
                   help="kv = cache- and load-aware cost (default); round_robin, p2c and affinity are "
                        "baselines for benchmarks")
    p.add_argument("--prefix-weight", type=float, default=DEFAULT_PREFIX_WEIGHT,
                   help="w: cost of one prompt block the replica would have to compute, in held KV blocks "
                        f"(default {DEFAULT_PREFIX_WEIGHT:g})")
    p.add_argument("--queue-weight", type=float, default=DEFAULT_QUEUE_WEIGHT,
                   help="q: scales the queue term, the work of the requests queued on a replica (each priced "
                        f"as w x its uncached blocks + its blocks) (default {DEFAULT_QUEUE_WEIGHT:g})")
    p.add_argument("--spill-factor", type=float, default=DEFAULT_SPILL_FACTOR,
                   help="a prompt leaves the replica caching most of it only when the work waiting there "
                        "exceeds another replica's by more than this x w x the blocks it would recompute "
                        f"(default {DEFAULT_SPILL_FACTOR:g}; 0: the plain cost)")
    p.add_argument("--poll-interval", type=float, default=0.25, help="seconds between load/event polls")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    p.add_argument("--fail-threshold", type=int, default=2,
                   help="failed health checks in a row that take a replica out (default 2)")
    p.add_argument("--history-ttl", type=float, default=120.0,
                   help="seconds the router remembers what it sent where, used when a replica's events "
                        "are missing (default 120)")
    p.add_argument("--replica-api-key", default=os.environ.get("NAMAZU_REPLICA_API_KEY"),
                   help="API key the replicas were started with; the router sends it on every request it "
                        "forwards (default: $NAMAZU_REPLICA_API_KEY)")
    p.add_argument("--kv-events-key", default=os.environ.get("NAMAZU_KV_EVENTS_KEY"), metavar="SECRET",
                   help="the replicas' --kv-events-key: their events carry keyed hashes, and the router keys "
                        "its prompts' hashes the same way (default: $NAMAZU_KV_EVENTS_KEY, else unkeyed)")
    f = p.add_argument_group("front door (the clients' side; the server's flags of the same names)")
    f.add_argument("--api-key", default=os.environ.get("NAMAZU_API_KEY"),
                   help="require 'Authorization: Bearer KEY' from clients on every route but /health; several "
                        "keys, comma-separated, admit each (one per tenant) "
                        "(default: $NAMAZU_API_KEY, else none); distinct from --replica-api-key")
    f.add_argument("--cache-salt-per-key", action="store_true",
                   help="salt every request's prefix cache by the client's API key (the request's cache_salt "
                        "is rewritten before forwarding, and its blocks hashed from that salt): tenants "
                        "never share cached blocks on any replica. Run the replicas without it")
    f.add_argument("--max-request-bytes", default="8MiB", metavar="SIZE",
                   help="largest request body; larger ones get 413 (default: 8MiB)")
    f.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="close a connection whose request headers are not complete in this long (default: 10)")
    f.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="408 (then the connection is closed) when a body is not received in this long "
                        "(default: 30)")
    f.add_argument("--write-timeout", type=float, default=30.0, metavar="S",
                   help="cut off a client that has not read for this long, and close its upstream stream "
                        "(the replica then aborts the request) (default: 30)")
    f.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                   help="close an idle keep-alive connection after this long (default: 5)")
    from server.front_door import add_front_door_args
    add_front_door_args(f)
    p.add_argument("--seed", type=int, default=None, help="tie-breaking seed")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


async def serve(args: argparse.Namespace) -> None:
    import httpx
    import uvicorn

    from namazu.assets import default_model_path
    from namazu.engine_config import parse_bytes
    from namazu.tokenizer import Tokenizer
    from server.front_door import allowed_hosts, fit_connection_cap
    from server.kv_event_keys import parse_key
    from server.router.policy import make_policy
    from server.router.pool import ReplicaPool
    from server.router.proxy import FrontDoor, Router
    from server.timeouts import guarded_protocol

    headers = {"Authorization": f"Bearer {args.replica_api_key}"} if args.replica_api_key else {}
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits) as client:
        pool = ReplicaPool(args.replica, client, poll_interval=args.poll_interval,
                           health_interval=args.health_interval, fail_threshold=args.fail_threshold,
                           history_ttl=args.history_ttl, headers=headers)
        tokenizer = Tokenizer.from_pretrained(args.tokenizer or default_model_path())
        router = Router(pool, make_policy(args.policy, args.prefix_weight, args.queue_weight, args.seed,
                                             args.spill_factor),
                        tokenizer, client, headers, args.block_size,
                        FrontDoor(args.api_key, parse_bytes(args.max_request_bytes), args.body_timeout,
                                  allowed_hosts(args.host, args.allowed_hosts),
                                  kv_events_key=parse_key(args.kv_events_key), write_timeout=args.write_timeout,
                                  cache_salt_per_key=args.cache_salt_per_key))
        await pool.start()
        try:
            config = uvicorn.Config(router.app(), host=args.host, port=args.port, log_level=args.log_level,
                                    loop="none", timeout_graceful_shutdown=5,
                                    http=guarded_protocol(args.header_timeout, args.body_timeout,
                                                          fit_connection_cap(args.max_connections)),
                                    timeout_keep_alive=args.keep_alive_timeout)
            server = uvicorn.Server(config)
            started = asyncio.ensure_future(server.serve())
            while not server.started and not started.done():
                await asyncio.sleep(0.05)
            if server.started:
                port = server.servers[0].sockets[0].getsockname()[1]
                logging.getLogger("server.router").info(
                    "routing (%s) over %d replicas on http://%s:%d", args.policy, len(args.replica), args.host, port)
            await started
        finally:
            await pool.stop()
            router.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.block_size is not None and (args.block_size < 1 or args.block_size & (args.block_size - 1)):
        print(f"error: --block-size={args.block_size} must be a power of two", file=sys.stderr)
        return 2
    try:
        from namazu.engine_config import parse_bytes
        from server.front_door import check_front_door_args

        parse_bytes(args.max_request_bytes)
        from server.kv_event_keys import parse_key
        parse_key(args.kv_events_key)
        for key, flag in ((args.api_key, "--api-key"), (args.replica_api_key, "--replica-api-key")):
            if key is not None and not key.strip():
                raise ValueError(f"{flag} is empty, which would turn authentication off unnoticed")
        from server.front_door import parse_api_keys
        parse_api_keys(args.api_key)
        if args.cache_salt_per_key and args.api_key is None:
            raise ValueError("--cache-salt-per-key needs --api-key: without keys every client is one tenant")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "write_timeout"):
            if not getattr(args, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds")
        check_front_door_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvloop

    try:
        uvloop.run(serve(args))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
