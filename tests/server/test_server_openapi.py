"""/openapi.json describes every route and body, and a bounded schemathesis run against a live server
finds no 5xx and no response that departs from the document (status codes, content types, bodies)."""
from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from server_harness import LiveServer, make_tiny_model

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

# Not "positive data acceptance": a schema-valid body may still be refused with 400 for what a schema
# cannot say (the prompt plus max_tokens over the context length, best_of != n, stream_options without
# stream, prompts x n over --max-seqs-per-request).
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]

KEY = "schema-key"
EXAMPLES = 25           # per operation: the run stays well under a minute on 2 CPU cores
BUDGET_S = 240


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    with LiveServer(model, "--max-model-len", "128", "--max-num-seqs", "16", "--kv-cache-memory", "16MiB",
                    "--max-seqs-per-request", "8", "--strict-fields", api_key=KEY) as s:
        yield s


def test_openapi_document_covers_every_route(srv):
    r = httpx.get(srv.url + "/openapi.json", headers=srv.headers(), timeout=10)
    assert r.status_code == 200
    doc = r.json()
    assert set(doc["paths"]) == {"/health", "/metrics", "/openapi.json", "/v1/models", "/v1/models/{model}",
                                 "/v1/completions", "/v1/chat/completions", "/v1/responses",
                                 "/v1/responses/{response_id}", "/tokenize", "/detokenize", "/tokenizer_info",
                                 "/version"}
    # Run with --strict-fields: a field the document does not list is refused, as it says.
    assert doc["components"]["schemas"]["CompletionRequest"]["additionalProperties"] is False
    assert httpx.get(srv.url + "/openapi.json", timeout=10).status_code == 401     # closed like the rest


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_server_error_and_no_schema_mismatch(srv, mode):
    generation_mode = schemathesis.GenerationMode(mode)
    # Negative cases (bodies that break the document) must also be refused with a 4xx.
    checks = CHECKS + ([negative_data_rejection] if mode == "negative" else [])
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json", headers=srv.headers())
    deadline = time.monotonic() + BUDGET_S
    ran = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if time.monotonic() > deadline:
            break

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode))
        def check(case) -> None:
            if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                # Keep each generation short: the run is about shapes and status codes, not throughput.
                case.body["max_tokens"] = min(case.body["max_tokens"] or 1, 8) or None
            case.call_and_validate(base_url=srv.url, headers=srv.headers(), timeout=60, checks=checks)

        try:
            check()
        except Unsatisfiable:               # negative mode: nothing to break in a GET without parameters
            assert mode == "negative" and not operation.path_parameters.items and operation.method == "get"
            continue
        ran.append(operation.label)
    # schemathesis leaves out the operation serving the document it was loaded from (/openapi.json).
    expected = ["GET /health", "GET /metrics", "GET /v1/models", "GET /v1/models/{model}", "POST /v1/completions",
                "POST /v1/chat/completions", "POST /v1/responses", "GET /v1/responses/{response_id}",
                "POST /tokenize", "POST /detokenize", "GET /tokenizer_info", "GET /version"]
    # Negative mode has nothing to break in a GET without parameters.
    with_inputs = [op for op in expected if op.startswith("POST") or "{" in op]
    assert ran == expected if mode == "positive" else set(with_inputs) <= set(ran), ran
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
