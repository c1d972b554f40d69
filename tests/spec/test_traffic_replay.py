"""The traffic replay's client (`namazu.spec.training.traffic._post_stream`, used by `traffic --capture-dir`,
`make drafter-refresh`'s capture and `bench.replay`): a 429 from the server's admission limits (e.g.
--max-grammar-compiles 8 under a mix of tool-call schemas) is waited out after its Retry-After and the request
sent again, within the request's timeout; other errors fail the request at once."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from namazu.spec.training.traffic import _post_stream


class _Server:
    """Answers the first `refusals` POSTs with `code` (Retry-After: 0), then one streamed completion."""

    def __init__(self, refusals: int, code: int = 429):
        self.posts = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.posts += 1
                if outer.posts <= refusals:
                    self.send_response(code)
                    self.send_header("Retry-After", "0")
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                    return
                body = "".join(f"data: {json.dumps(c)}\n\n" for c in (
                    {"choices": [{"delta": {"content": "a"}}]},
                    {"choices": [], "usage": {"completion_tokens": 3}})) + "data: [DONE]\n\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/chat/completions"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request):
    s = _Server(*request.param)
    yield s
    s.close()


@pytest.mark.parametrize("server", [(3,)], indirect=True)
def test_a_429_is_retried_after_its_retry_after_and_the_request_served(server):
    r = _post_stream(server.url, {"messages": []}, timeout=30)
    assert r.ok, r.error
    assert r.retries == 3 and server.posts == 4 and r.completion_tokens == 3


@pytest.mark.parametrize("server", [(1, 500)], indirect=True)
def test_another_error_fails_the_request_without_a_retry(server):
    r = _post_stream(server.url, {"messages": []}, timeout=30)
    assert not r.ok and "500" in r.error
    assert r.retries == 0 and server.posts == 1


@pytest.mark.parametrize("server", [(10**6,)], indirect=True)
def test_429s_past_the_timeout_fail_the_request(server):
    r = _post_stream(server.url, {"messages": []}, timeout=0.5)
    assert not r.ok and "429" in r.error and r.retries >= 1
