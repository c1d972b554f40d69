"""Ray Serve pieces that need no running Ray: flag parsing, the autoscaling decision, the KubeRay manifest
(parsed and built into an application), the in-process ASGI bridge, and that namazu never imports Ray
unless --replicas is used."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from server.ray_serve.asgi_bridge import asgi_stream
from server.ray_serve.autoscaling import KV, QUEUE, RUNNING, QueueAndKVPolicy
from server.ray_serve.builder import parse_args
from server.ray_serve.launch import parse_replicas

REPO = Path(__file__).resolve().parents[3]


def test_parse_replicas():
    assert parse_replicas("1:4") == (1, 4) and parse_replicas("3") == (3, 3)
    for bad in ("0:2", "3:1", "a:b", "1:", ""):
        with pytest.raises(ValueError, match="--replicas"):
            parse_replicas(bad)


def _ctx(n, queue, running, kv):
    ids = [f"r{i}" for i in range(n)]
    return SimpleNamespace(current_num_replicas=n, policy_state={}, total_queued_requests=0.0,
                           aggregated_metrics={QUEUE: dict.fromkeys(ids, queue), RUNNING: dict.fromkeys(ids, running),
                                               KV: dict.fromkeys(ids, kv)})


def test_autoscaling_follows_queue_and_kv_usage_not_request_counts():
    policy = QueueAndKVPolicy(target_queue=1.0, target_running=4.0, max_kv_usage=0.8, min_kv_usage=0.3)
    assert policy(_ctx(1, queue=6, running=2, kv=0.1))[0] == 2            # queue pressure
    assert policy(_ctx(2, queue=0, running=1, kv=0.95))[0] == 3           # KV nearly full, few requests
    assert policy(_ctx(2, queue=10, running=4, kv=0.5))[0] == 7           # 28 sequences / 4 per replica
    assert policy(_ctx(3, queue=0, running=1, kv=0.05))[0] == 2           # idle: one fewer
    assert policy(_ctx(2, queue=0, running=3, kv=0.5))[0] == 2            # busy enough: keep
    assert policy(_ctx(1, queue=0, running=0, kv=0.0))[0] == 1
    want, state = policy(_ctx(1, queue=3, running=1, kv=0.2))
    assert want == 2 and state["namazu_last"]["queued"] == 3


def test_kuberay_manifest_parses_and_builds_the_application():
    doc = yaml.safe_load((REPO / "deploy" / "rayservice.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = serve_cfg["applications"]
    module, _, attr = app["import_path"].partition(":")
    builder = getattr(__import__(module, fromlist=[attr]), attr)
    config, opts = parse_args(app["args"])
    assert (opts.min_replicas, opts.max_replicas) == (1, 4) and opts.policy == "kv"
    assert config.model == "/models/namazu" and config.max_num_seqs == 64
    assert callable(builder)
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == _pinned("ray")
    workers = cluster["workerGroupSpecs"][0]
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    mounts = [c.get("volumeMounts", []) for c in cluster["headGroupSpec"]["template"]["spec"]["containers"]]
    assert any(m["mountPath"] == "/models" for ms in mounts for m in ms), "the ingress needs the tokenizer"
    # Built into a Serve application graph (no Ray cluster needed for that).
    from ray.serve.deployment import Application

    from server.ray_serve.launch import build_application

    assert isinstance(build_application(config, opts, 8.0), Application)
    with pytest.raises(ValueError, match="unknown namazu application args"):
        parse_args({"replicas": "1:2", "modle": "x"})


def _pinned(name: str) -> str:
    for line in (REPO / "requirements-dev.txt").read_text().splitlines():
        if line.split("[")[0].split("==")[0] == name:
            return line.split("==")[1]
    raise AssertionError(f"{name} is not pinned in requirements-dev.txt")


def test_asgi_bridge_streams_and_delivers_disconnect():
    seen = {}

    async def endpoint(request):
        async def body():
            try:
                for i in range(1000):
                    yield f"chunk{i};"
                    await asyncio.sleep(0.01)
            finally:
                seen["closed"] = True
        return StreamingResponse(body(), media_type="text/plain", headers={"x-a": "1"})

    app = Starlette(routes=[Route("/s", endpoint, methods=["POST"])])

    async def main():
        gen = asgi_stream(app, "POST", "/s", b"{}")
        head = await gen.__anext__()
        assert head["status"] == 200 and ["x-a", "1"] in head["headers"]
        assert await gen.__anext__() == b"chunk0;"
        assert await gen.__anext__() == b"chunk1;"
        t0 = time.monotonic()
        await gen.aclose()                          # the caller left: the app must stop at once
        assert time.monotonic() - t0 < 2.0, "the app kept streaming after the caller left"

    asyncio.run(main())
    assert seen.get("closed"), "the app kept streaming after the caller left"


def test_asgi_bridge_sends_body_messages_already_waiting_as_one_chunk():
    """Tokens produced faster than the caller reads them cross as one chunk (each chunk is a Ray object
    and two actor hops); nothing is held back waiting for more, and nothing is lost or reordered."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(5):                          # queued back to back: the reader has not run yet
            await send({"type": "http.response.body", "body": f"t{i};".encode(), "more_body": True})
        await asyncio.sleep(0.05)                   # the reader catches up: the next token goes alone
        await send({"type": "http.response.body", "body": b"t5;", "more_body": True})
        await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b"end", "more_body": False})

    async def main():
        return [item async for item in asgi_stream(app, "POST", "/s")][1:]

    assert asyncio.run(main()) == [b"t0;t1;t2;t3;t4;", b"t5;", b"end"]


def test_namazu_does_not_import_ray_without_replicas():
    code = ("import sys, namazu.server, namazu.async_engine, server.app; namazu.server.build_parser()\n"
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
