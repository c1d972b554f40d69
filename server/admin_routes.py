"""Operator routes, present only when the server was started with `--admin-key`.

POST /admin/drafter {"path": DIR}: replaces the serving DFlash drafter with the checkpoint in DIR, a
directory under `--drafter-root` (a relative path is taken from the root; symlinks are followed before the
check), without a restart (`namazu/spec/drafter_swap.py`): checked as at start-up, loaded beside the serving
one, switched at a step boundary with every sequence in flight recomputed, so their outputs do not change.
Answers {"drafter_id", "previous_drafter_id", "path"}; a checkpoint that does not fit is a 422 naming the
field or tensor, and the old drafter serves on. GET /admin/drafter: the serving drafter's id and path (and a
shadow drafter's id, path and fraction, with `--shadow-drafter`).

The admin key is not the API key (the server refuses to start with the two equal): a client of the API
cannot change what the server runs, and the admin key opens no other route.
"""
from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from namazu.spec.dflash_config import DrafterCheckpointError
from namazu.spec.drafter_swap import DrafterSwapError, resolve_under_root
from server.api_error import APIError
from server.front_door import bearer_error, read_json

ADMIN_PATHS = frozenset({"/admin/drafter"})


def check_admin_args(admin_key: str | None, drafter_root: str | None, api_keys: list[str] | None) -> None:
    """ValueError naming the flag when the admin options cannot be served as given (`api_keys`: the
    parsed --api-key list, one per tenant)."""
    if admin_key is None:
        if drafter_root is not None:
            raise ValueError("--drafter-root is only read by the admin routes: give --admin-key too")
        return
    if not admin_key.strip():
        raise ValueError("--admin-key (or $NAMAZU_ADMIN_KEY) is empty; give a key, or none for no admin routes")
    if api_keys and admin_key in api_keys:
        raise ValueError("--admin-key equals --api-key: every API client could then replace the drafter; "
                         "give a distinct admin key")
    if drafter_root is None:
        raise ValueError("--admin-key needs --drafter-root DIR: the directory drafters may be loaded from")
    if not Path(drafter_root).is_dir():
        raise ValueError(f"--drafter-root {drafter_root}: not a directory")


def _admin(request: Request) -> tuple[object, Path]:
    """The server state, after the admin key check (401 without it)."""
    state = request.app.state.server
    err = bearer_error(request.scope, state.admin_key.encode(), "--admin-key")
    if err is not None:
        raise err
    return state, Path(state.drafter_root)


async def get_drafter(request: Request) -> Response:
    state, _ = _admin(request)
    engine = state.engine.engine
    answer = {"drafter_id": engine.drafter_id, "path": getattr(engine.drafter, "path", None)}
    if engine.shadow is not None:        # --shadow-drafter: the candidate drafting beside it
        answer.update(shadow_drafter_id=engine.shadow.shadow_id, shadow_path=engine.shadow.path,
                      shadow_fraction=engine.shadow.fraction)
    return JSONResponse(answer)


async def set_drafter(request: Request) -> Response:
    state, root = _admin(request)
    body = await read_json(request, state.max_request_bytes, state.body_timeout)
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object {\"path\": DIR}")
    unknown = sorted(set(body) - {"path"})
    if unknown:
        raise APIError(400, f"unknown field(s) {unknown}; the body is {{\"path\": DIR}}", param=unknown[0])
    if "path" not in body:
        raise APIError(400, "'path' is required: the drafter directory, under --drafter-root", param="path")
    try:
        path = resolve_under_root(body["path"], root)
    except DrafterSwapError as e:
        status = 403 if "outside the drafter root" in str(e) else 400
        raise APIError(status, str(e), param="path", code="invalid_drafter_path") from None
    try:
        answer = await state.engine.set_drafter(str(path))
    except DrafterCheckpointError as e:
        raise APIError(422, f"{e}; the serving drafter is unchanged", param="path",
                       code="invalid_drafter") from None
    except DrafterSwapError as e:
        raise APIError(409, str(e), code="no_drafter_to_replace") from None
    return JSONResponse(answer)
