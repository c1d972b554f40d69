"""guidellm's own OpenAI request handlers against namazu: the body it formats (stream with
`stream_options.continuous_usage_stats`, `ignore_eos`, `max_tokens`) is served, and the usage it compiles
from the stream is the request's real token counts. Skipped without guidellm installed."""
from __future__ import annotations

import httpx
import pytest
from server_harness import LiveServer, make_tiny_model

handlers = pytest.importorskip("guidellm.backends.openai.request_handlers")
from guidellm.schemas.base.request import GenerationRequest, UsageMetrics  # noqa: E402


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    with LiveServer(model, "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--served-model-name",
                    "tiny") as s:
        yield s


@pytest.mark.parametrize("kind,path", [("TextCompletionsRequestHandler", "/v1/completions"),
                                       ("ChatCompletionsRequestHandler", "/v1/chat/completions")])
def test_guidellm_reads_continuous_usage(srv, kind, path):
    handler = getattr(handlers, kind)()
    req = GenerationRequest(columns={"text_column": ["Benchmark me, please."]},
                            output_metrics=UsageMetrics(text_tokens=12))
    args = handler.format(req, model="tiny", stream=True)
    assert args.body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    usages = []
    with httpx.stream("POST", srv.url + path, json=args.body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if handler.add_streaming_line(line) is None:
                break
            usages.append(handler.streaming_usage)
    res = handler.compile_streaming(req, args)
    assert res.output_metrics.text_tokens == 12 and res.input_metrics.text_tokens > 0
    seen = [u["completion_tokens"] for u in usages if u]
    assert len(seen) >= 12 and seen == sorted(seen)      # usage on every chunk, growing
