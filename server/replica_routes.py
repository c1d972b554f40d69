"""What a replica tells the KV-aware router (`server/router/`): its KV events and its load.

GET /kv/events?after=N[&limit=M][&replica_id=ID]: the prefix cache's events with id > N (see
`namazu.scheduler.kv_events`); a cursor that cannot be replayed gets a snapshot of every stored hash.
GET /load: queue depth, active KV blocks and the measured step rates (`namazu.engine.step_rate_fit`), cheap enough
to poll several times a second.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.errors import APIError
from server.kv_event_keys import key_events


def _int_param(request: Request, name: str, default: int, low: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise APIError(400, f"query parameter '{name}' must be an integer >= {low}, got {raw!r}", param=name)
    return value


async def kv_events(request: Request) -> Response:
    engine = request.app.state.server.engine
    after = _int_param(request, "after", 0, 0)
    limit = _int_param(request, "limit", 1024, 1)
    answer = engine.kv_events(after, min(limit, 16384), request.query_params.get("replica_id"))
    key = request.app.state.server.kv_events_key
    return JSONResponse(answer if key is None else key_events(answer, key))


async def load(request: Request) -> Response:
    state = request.app.state.server
    s = state.engine.get_stats()
    return JSONResponse({
        "alive": state.engine.is_running,
        "num_running": s.num_running, "num_waiting": s.num_waiting,
        "requests_in_flight": state.in_flight,
        "active_kv_blocks": round(s.kv_cache_usage * s.num_kv_blocks), "num_kv_blocks": s.num_kv_blocks,
        "kv_cache_usage": s.kv_cache_usage, "block_size": state.engine.config.block_size,
        "max_num_seqs": state.engine.config.max_num_seqs,
        "ms_per_decode_step": s.ms_per_decode_step, "ms_per_prefill_block": s.ms_per_prefill_block,
        "replica_id": state.engine.replica_id,
    })
