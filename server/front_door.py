"""What every namazu HTTP front (the server and the router) checks before a request reaches a handler.

- `AuthMiddleware`: exactly one `Authorization: Bearer KEY` on every path but /health, compared in
  constant time (several headers are refused: which one a proxy in front checked is unknowable) with
  each of the keys (`--api-key K1,K2,...`: one per tenant); the request's scope then carries that key's
  tenant id (`tenant_of`), which `--cache-salt-per-key` turns into a prefix-cache salt;
- `BrowserGuardMiddleware`: a request with a body must say `Content-Type: application/json` (a web page
  can POST `text/plain` or a form to any address without a CORS preflight; it cannot send JSON so), and
  the `Host` header must name this server (a DNS-rebinding page reaches 127.0.0.1 under its own name);
- `read_json`: the body under a size limit and a time limit, parsed with the depth, digit, surrogate and
  duplicate-key limits of `server/json_body.py`, off the event loop when large.
Connection-level limits (header and body deadlines, the connection cap) are in `server/timeouts.py`.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api_error import APIError
from server.json_body import parse_json_async
from server.prepare_pool import body_size

OPEN_PATHS = frozenset({"/health"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


TENANT_SCOPE_KEY = "namazu.tenant"     # the ASGI scope entry holding the matched key's tenant id


def parse_api_keys(value: str | None, flag: str = "--api-key") -> list[str] | None:
    """The keys of a comma-separated `--api-key` value (a Bearer token has no commas), or None: no
    authentication. An empty key anywhere is refused: it would look like authentication while letting in
    anyone who sends an empty token."""
    if value is None:
        return None
    keys = [k.strip() for k in value.split(",")]
    if not value.strip() or any(not k for k in keys):
        raise ValueError(f"the API key is empty; give a non-empty {flag} (or none, for no authentication)")
    return keys


def tenant_id(key: bytes) -> str:
    """A key's tenant id: a digest of it (the key itself never leaves the auth check)."""
    return hashlib.blake2b(key, digest_size=16, person=b"namazu-tenant").hexdigest()


def tenant_cache_salt(tenant: str, own: str | None) -> str:
    """The prefix-cache salt of a request under `--cache-salt-per-key`: its key's tenant id, with the
    request's own `cache_salt` hashed inside it (so no salt a client sends can name another tenant's
    namespace). The server and the router compute it alike."""
    if own is None:
        return f"key:{tenant}"
    return f"key:{tenant}:" + hashlib.blake2b(own.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def tenant_of(scope: Scope) -> str | None:
    """The tenant id of the key a request authenticated with (None: the server has no keys)."""
    return scope.get(TENANT_SCOPE_KEY)


class AuthMiddleware:
    """Exactly one `Authorization: Bearer KEY` on every path but /health and `exempt` (paths with a key of
    their own: /admin/drafter checks --admin-key), compared in constant time with every configured key (the
    time does not depend on which one matched). `flag` names the option the keys came from, for the error
    message."""

    def __init__(self, app: ASGIApp, api_key: str | None, flag: str = "--api-key", exempt: Iterable[str] = ()):
        keys = parse_api_keys(api_key, flag)
        self.app = app
        self.keys = [(k.encode(), tenant_id(k.encode())) for k in keys] if keys else None
        self.flag = flag
        self.open = OPEN_PATHS | frozenset(exempt)

    def _match(self, token: bytes) -> str | None:
        found = None
        for key, tenant in self.keys or ():
            if hmac.compare_digest(token, key) and found is None:
                found = tenant
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys is None or scope["type"] != "http" or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        headers = [v for k, v in scope["headers"] if k == b"authorization"]
        header = headers[0] if len(headers) == 1 else b""
        scheme, _, token = header.partition(b" ")
        tenant = self._match(token.strip()) if scheme.lower() == b"bearer" else None
        if tenant is not None:
            scope[TENANT_SCOPE_KEY] = tenant
            await self.app(scope, receive, send)
            return
        await _unauthorized(headers, header, self.flag).response()(scope, receive, send)


def bearer_error(scope: Scope, key: bytes, flag: str) -> APIError | None:
    """None when the request carries exactly one `Authorization: Bearer <key>`, else the 401 to answer."""
    headers = [v for k, v in scope["headers"] if k == b"authorization"]
    header = headers[0] if len(headers) == 1 else b""
    scheme, _, token = header.partition(b" ")
    if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key):
        return None
    return _unauthorized(headers, header, flag)


def _unauthorized(headers: list[bytes], header: bytes, flag: str) -> APIError:
    what = ("several Authorization headers sent; send exactly one" if len(headers) > 1
            else "no API key provided" if not header else "incorrect API key provided")
    return APIError(401, f"{what}; send 'Authorization: Bearer <key>' with the key the server was "
                         f"started with ({flag})", code="invalid_api_key")


def allowed_hosts(bind_host: str, allowed: str | None) -> frozenset[str] | None:
    """The host names a request's `Host` header may carry; None: any.

    `allowed` is the --allowed-hosts value: a comma-separated list, or "*" for any. By default a server
    bound to one address answers to that address (and, on loopback, to the loopback names); one bound to
    every address (0.0.0.0, ::) is reachable under names it cannot know, so it checks nothing."""
    if allowed is not None:
        names = {h.strip().lower() for h in allowed.split(",") if h.strip()}
        if not names:
            raise ValueError("--allowed-hosts is empty; give host names, or '*' to accept any Host header")
        return None if "*" in names else frozenset(names)
    host = bind_host.strip("[]").lower()
    if host in ("", "0.0.0.0", "::"):
        return None
    names = {host}
    try:
        if ipaddress.ip_address(host).is_loopback:
            names.update(_LOOPBACK_NAMES)
    except ValueError:              # a host name: that name only (and the loopback names for localhost)
        if host == "localhost":
            names.update(_LOOPBACK_NAMES)
    return frozenset(names)


def _host_name(header: str) -> str:
    """The name part of a Host header ('[::1]:8000' -> '::1', 'a.b:80' -> 'a.b')."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    name, _, port = header.rpartition(":")
    return name if name and port.isdigit() else header


class BrowserGuardMiddleware:
    """415 for a request body that is not declared JSON; 403 for a Host this server does not answer to.
    /health is exempt from the Host check (probes address a pod by whatever name they have)."""

    def __init__(self, app: ASGIApp, hosts: Iterable[str] | None):
        self.app = app
        self.hosts = None if hosts is None else frozenset(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        err = self._check(scope)
        if err is not None:
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> APIError | None:
        headers = scope["headers"]
        if self.hosts is not None and scope["path"] not in OPEN_PATHS:
            host = [v for k, v in headers if k == b"host"]
            name = _host_name(host[0].decode("latin-1")) if len(host) == 1 else ""
            if name not in self.hosts:
                shown = host[0].decode("latin-1")[:100] if len(host) == 1 else f"{len(host)} Host headers"
                return APIError(403, f"the Host header ({shown!r}) does not name this server; it answers to "
                                     f"{sorted(self.hosts)} (--allowed-hosts)", code="invalid_host",
                                type="permission_error")
        if scope["method"] in _BODY_METHODS:
            ctype = [v for k, v in headers if k == b"content-type"]
            media = ctype[0].split(b";")[0].strip().lower() if len(ctype) == 1 else b""
            if media != b"application/json":
                shown = ctype[0].decode("latin-1")[:100] if len(ctype) == 1 else "none"
                return APIError(415, f"the request body must be JSON with 'Content-Type: application/json' "
                                     f"(got {shown})", code="unsupported_media_type")
        return None


async def read_json(request: Request, limit: int, timeout: float) -> Any:
    """The request body as JSON: 413 past `limit` bytes (refused from Content-Length before any byte is
    read), 408 when it has not arrived within `timeout` seconds, 400 when it is not acceptable JSON."""
    return await parse_json_async(await read_body(request, limit, timeout))


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The raw request body under the limits of `read_json`."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(size, limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body was not received within {timeout:g} s (--body-timeout)",
                       code="request_timeout") from None
    body_size.set(size)         # the rest of this request's preparation picks its pool by it
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body ({size} bytes or more) exceeds the limit of {limit} bytes "
                         "(--max-request-bytes)", code="request_too_large")


def add_front_door_args(g: argparse._ActionsContainer) -> None:
    """The connection and browser limits the server and the router share."""
    g.add_argument("--max-connections", type=int, default=512, metavar="N",
                   help="open connections at most; one more gets 503 and is closed at once (default: 512)")
    g.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="comma-separated host names a request's Host header may carry, or '*' for any "
                        "(default: the --host address, plus the loopback names when it is a loopback "
                        "address; any when bound to 0.0.0.0 or ::)")


def check_front_door_args(args: argparse.Namespace) -> None:
    if args.max_connections < 1:
        raise ValueError("--max-connections must be at least 1")
    allowed_hosts(args.host, args.allowed_hosts)


_FD_RESERVE = 128       # descriptors kept for the server's own work: upstream connections, files, pipes


def fit_connection_cap(max_connections: int) -> int:
    """The connection cap the process's descriptor limit allows: the soft limit is raised toward the
    hard one when the cap needs it, and the cap lowered (with a warning) when even that is short, so
    that connections run out before descriptors do (past the descriptor limit /health fails too)."""
    import logging
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        cap = max(1, soft - _FD_RESERVE)
        logging.getLogger(__name__).warning(
            "--max-connections %d lowered to %d: the descriptor limit is %d", max_connections, cap, soft)
        return cap
    return max_connections

