"""`python -m namazu.server`: the OpenAI-compatible HTTP server.

Engine flags come from EngineConfig (one definition each, shared with `LLM(...)`); the server adds
--host, --port, --api-key, --served-model-name, --max-request-bytes and --log-level. The engine (and its
model-runner worker) starts before the port opens, so a bad checkpoint or an impossible --max-model-len
fails here with its own message instead of on the first request.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
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
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $NAMAZU_API_KEY, else no authentication)")
    g.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: the checkpoint's name)")
    g.add_argument("--max-request-bytes", default="8MiB", metavar="SIZE",
                   help="largest request body; larger ones get 413 (default: 8MiB)")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="log level of namazu and uvicorn (default: info)")
    EngineConfig.add_cli_args(p)
    return p


async def serve(args: argparse.Namespace, config: EngineConfig) -> None:
    import uvicorn

    from namazu.async_engine import AsyncEngine
    from server.app import build_app

    engine = AsyncEngine(config)
    try:
        app = build_app(engine, served_model_name=args.served_model_name, api_key=args.api_key,
                        max_request_bytes=parse_bytes(args.max_request_bytes))
        uv = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, loop="none",
                            timeout_graceful_shutdown=5)
        server = uvicorn.Server(uv)
        # Announce the real port (with --port 0 the OS picks it) once uvicorn is listening.
        started = asyncio.ensure_future(server.serve())
        while not server.started and not started.done():
            await asyncio.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            logger.info("serving %s on http://%s:%d (auth %s)", app.state.server.served_model_name,
                        args.host, port, "on" if args.api_key else "off")
        watch = asyncio.ensure_future(_stop_when_engine_fails(engine, server))
        await started
        watch.cancel()
        if engine.error is not None:
            raise EngineFailed(str(engine.error))
    finally:
        engine.shutdown()


class EngineFailed(RuntimeError):
    """The engine stopped under the server (a worker rank died or hung): exit non-zero so a supervisor
    restarts the server."""


async def _stop_when_engine_fails(engine, server) -> None:
    while engine.error is None:
        await asyncio.sleep(0.25)
    logger.error("engine failed, shutting the server down: %s", engine.error)
    server.should_exit = True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig.from_cli_args(args)
        parse_bytes(args.max_request_bytes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvloop

    try:
        uvloop.run(serve(args, config))
    except (FileNotFoundError, ValueError) as e:     # bad checkpoint path, config or memory budget
        print(f"error: {e}", file=sys.stderr)
        return 1
    except EngineFailed as e:
        print(f"error: the engine failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
