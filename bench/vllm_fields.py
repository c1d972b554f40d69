"""The request fields vLLM's OpenAI server takes, each sent with a value: 200, or a 4xx naming the field, never
"unrecognized". The acceptance check of a drop-in for vLLM (issue 35).

One request per (endpoint, field, value), the way vLLM's own OpenAI-server tests send them; the table says
what came back: the status, and for a refusal the `param` the error names and the start of its message.
A row fails when the status is not 200 and the error does not name the field, or when any message says
"unrecognized". The server runs with --strict-fields, so a field the server did not read at all would be
caught as unrecognized rather than silently ignored.

    python bench/vllm_fields.py                 # starts a server on the embedded namazu-tiny
    python bench/vllm_fields.py --url http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve import start_server  # noqa: E402  (bench/ is a folder of scripts, not a package)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "天気", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}}
FUNCTION = {"name": "get_weather", "parameters": TOOL["function"]["parameters"]}
CHAT, CMPL, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MSGS = [{"role": "user", "content": "大阪の天気は?"}]

# (endpoint, field, value): both generation endpoints unless the field is one endpoint's.
CASES: list[tuple[str, str, object]] = []
for ep in (CHAT, CMPL):
    CASES += [(ep, f, v) for f, v in [
        ("guided_json", SCHEMA), ("guided_regex", "[0-9]{3}"), ("guided_choice", ["yes", "no"]),
        ("guided_grammar", 'root ::= "a" | "b"'), ("guided_decoding_backend", "xgrammar"),
        ("guided_whitespace_pattern", r"[\n ]*"), ("structured_outputs", {"choice": ["left", "right"]}),
        ("structured_outputs", {"json": SCHEMA}), ("structured_outputs", {"regex": "[a-z]+"}),
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "会議メモ", "schema": SCHEMA}}),
        ("prompt_logprobs", 2), ("truncate_prompt_tokens", 8), ("return_tokens_as_token_ids", True),
        ("request_id", "req-123"), ("cache_salt", "tenant-a"), ("bad_words", ["foo", "bar baz"]),
        ("allowed_token_ids", [65, 66, 67]), ("spaces_between_special_tokens", False),
        ("logit_bias", {"65": 5.5, "66": -100}), ("logit_bias", {"65": 1e6}), ("logit_bias", {"999999": 1}),
        ("top_k", 20), ("min_p", 0.1), ("repetition_penalty", 1.1), ("min_tokens", 2), ("ignore_eos", True),
        ("stop_token_ids", [5]), ("skip_special_tokens", False), ("include_stop_str_in_output", True),
        ("priority", 0), ("add_special_tokens", False), ("use_beam_search", True), ("use_beam_search", False),
        ("length_penalty", 0.8), ("logits_processors", ["pkg.Processor"]), ("prompt_embeds", "AAAA"),
        ("kv_transfer_params", {"do_remote_decode": True}), ("seed", 7), ("n", 2), ("best_of", 2),
        ("stream_options", {"include_usage": True, "continuous_usage_stats": True}),
    ]]
CASES += [(CHAT, f, v) for f, v in [
    ("chat_template_kwargs", {"enable_thinking": False}), ("add_generation_prompt", False),
    ("continue_final_message", True), ("echo", True), ("reasoning_effort", "low"), ("reasoning_effort", "max"),
    ("functions", [FUNCTION]), ("function_call", {"name": "get_weather"}), ("tools", [TOOL]),
    ("tool_choice", "required"), ("parallel_tool_calls", False), ("documents", [{"text": "x"}]),
    ("mm_processor_kwargs", {"a": 1}), ("include_reasoning", False), ("logprobs", True), ("top_logprobs", 3),
    ("max_completion_tokens", 4), ("structural_tag", "{}"),
]]
CASES += [(CMPL, f, v) for f, v in [("echo", True), ("logprobs", 2), ("suffix", "y")]]
CASES += [(RESP, f, v) for f, v in [
    ("instructions", "手短に"), ("text", {"format": {"type": "json_schema", "name": "会議メモ", "schema": SCHEMA}}),
    ("tools", [{"type": "function", "name": "天気", "parameters": TOOL["function"]["parameters"]}]),
    ("previous_response_id", "resp_unknown"), ("store", False), ("top_k", 5), ("reasoning", {"effort": "low"}),
    ("truncation", "auto"), ("background", True),
]]


def body_for(ep: str, field: str, value: object) -> dict:
    base: dict = {"max_tokens": 4} if ep != RESP else {"max_output_tokens": 4}
    if ep == CHAT:
        base["messages"] = MSGS
    elif ep == CMPL:
        base["prompt"] = "大阪の天気は"
    else:
        base["input"] = "大阪の天気は?"
    base[field] = value
    # Fields that only mean something together with another.
    if field == "continue_final_message":
        base.update(add_generation_prompt=False, messages=MSGS + [{"role": "assistant", "content": "晴れ"}])
    if field == "function_call":
        base["functions"] = [FUNCTION]
    if field == "tool_choice" or field == "parallel_tool_calls":
        base["tools"] = [TOOL]
    if field == "top_logprobs":
        base["logprobs"] = True
    if field == "stream_options":
        base["stream"] = True
    if field == "best_of":
        base["n"] = 2
    if field in ("functions", "function_call", "tools", "tool_choice") and ep == CHAT:
        base["max_tokens"] = 64
    return base


def run(url: str, headers: dict[str, str]) -> int:
    rows, failures = [], 0
    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        for ep, field, value in CASES:
            r = c.post(ep, json=body_for(ep, field, value))
            text = r.text
            if r.status_code == 200:
                verdict, detail = "ok", ""
            else:
                try:
                    err = r.json()["error"]
                except ValueError:
                    err = {"param": None, "message": text[:80]}
                named = (err.get("param") or "").split(".")[0].split("[")[0] == field
                verdict = "named" if named else "FAIL"
                detail = f"param={err.get('param')}: {err.get('message', '')[:70]}"
            if "unrecognized" in text.lower():
                verdict = "FAIL"
            failures += verdict == "FAIL"
            shown = repr(value) if len(repr(value)) < 40 else repr(value)[:37] + "..."
            rows.append((ep, field, shown, r.status_code, verdict, detail))
    print("| endpoint | field | value | status | verdict | error |\n|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(x).replace("|", "\\|") for x in row) + " |")
    ok = sum(r[4] == "ok" for r in rows)
    named = sum(r[4] == "named" for r in rows)
    print(f"\n{len(rows)} requests: {ok} served (200), {named} refused naming the field, {failures} failures")
    return failures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one on --model, with --strict-fields)")
    p.add_argument("--model", help="checkpoint for the started server (default: the embedded namazu-tiny)")
    p.add_argument("--api-key")
    args = p.parse_args(argv)
    proc, url = (None, args.url) if args.url else start_server(args.model, ["--strict-fields", "--max-model-len",
                                                                            "1024"])
    try:
        failures = run(url.rstrip("/"), {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
