"""Tool calling through the OpenAI API, in the spirit of Moonshot's K2 Vendor Verifier.

Sends namazu-tiny's held-out tool prompts (schemas never seen in training, argument text from the corpus
valid split) to /v1/chat/completions with `tools` and counts what a client sees: the share of prompts
answered with `tool_calls` (trigger rate), calls naming a declared tool, calls whose `arguments` parse as
JSON and validate against the declared schema (the verifier's target: zero invalid), and calls of the
expected tool. Each `--tool-choice` (auto: free text until the model opens a tool-call section;
required: a call at once) runs over the same prompts; calls are generated under namazu's tool-call
grammar either way. It also checks the streaming path: at temperature 0 the tool calls assembled from
the SSE deltas must equal the non-streamed ones.

    python bench/tool_calls.py                      # starts a server on the embedded namazu-tiny
    python bench/tool_calls.py --url http://127.0.0.1:8000 --num-prompts 200 --tool-choice auto required
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx
import jsonschema
from results_md import write_section  # bench/ is on sys.path when run as `python bench/X.py`

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve import start_server  # noqa: E402  (bench/ is a folder of scripts, not a package)

START, END = "<!-- bench-tools:start -->", "<!-- bench-tools:end -->"


async def ask(client: httpx.AsyncClient, model: str, p, temperature: float, max_tokens: int, seed: int,
              stream: bool, tool_choice: str = "auto") -> dict:
    """The choice's message (content + tool_calls), assembled from SSE deltas when streaming."""
    body = {"model": model, "messages": p.messages, "tools": p.tools, "temperature": temperature,
            "max_tokens": max_tokens, "seed": seed, "stream": stream, "tool_choice": tool_choice}
    if not stream:
        r = await client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        msg = choice["message"]
        return {"content": msg.get("content"), "tool_calls": msg.get("tool_calls") or [],
                "finish_reason": choice["finish_reason"]}
    content, calls, finish = [], {}, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:]).get("choices", []):
                finish = c.get("finish_reason") or finish
                delta = c.get("delta") or {}
                content.append(delta.get("content") or "")
                for d in delta.get("tool_calls") or []:
                    call = calls.setdefault(d["index"], {"id": None, "type": "function",
                                                         "function": {"name": None, "arguments": ""}})
                    call["id"] = d.get("id") or call["id"]
                    fn = d.get("function") or {}
                    call["function"]["name"] = fn.get("name") or call["function"]["name"]
                    call["function"]["arguments"] += fn.get("arguments") or ""
    text = "".join(content)
    return {"content": text if text or not calls else None, "tool_calls": [calls[i] for i in sorted(calls)],
            "finish_reason": finish}


def score(prompts: list, answers: list[dict]) -> dict:
    with_call = calls = declared = parsed = valid = right = cut = 0
    for p, a in zip(prompts, answers):
        if a["finish_reason"] == "length":
            cut += 1            # max_tokens ended the answer: a call in it is incomplete, not invalid
            continue
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in p.tools}
        with_call += bool(a["tool_calls"])
        for c in a["tool_calls"]:
            calls += 1
            name = c["function"]["name"]
            right += name == p.tool_name
            if name not in schemas:
                continue
            declared += 1
            try:
                args = json.loads(c["function"]["arguments"])
            except json.JSONDecodeError:
                continue
            parsed += 1
            try:
                jsonschema.validate(args, schemas[name])
                valid += 1
            except jsonschema.ValidationError:
                pass
    n = len(prompts)
    return {"prompts": n, "cut_off": cut, "trigger_rate": with_call / max(n - cut, 1), "calls": calls,
            "declared_tool": declared / calls if calls else 0.0, "json_parses": parsed / calls if calls else 0.0,
            "schema_valid": valid / calls if calls else 0.0, "invalid_calls": calls - valid,
            "right_tool": right / calls if calls else 0.0}


async def run(args, url: str, tool_choice: str) -> tuple[dict, int, int]:
    from namazu.tiny.corpus import default_corpus_dir
    from namazu.tiny.data import heldout_tool_prompts

    prompts = heldout_tool_prompts(args.corpus or default_corpus_dir(), args.num_prompts, seed=args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(i: int, p, temperature: float, stream: bool) -> dict:
            async with sem:
                return await ask(client, model, p, temperature, args.max_tokens, args.seed + i, stream,
                                 tool_choice)

        answers = await asyncio.gather(*(one(i, p, args.temperature, False) for i, p in enumerate(prompts)))
        k = min(args.stream_checks, len(prompts))
        whole = await asyncio.gather(*(one(i, p, 0.0, False) for i, p in enumerate(prompts[:k])))
        streamed = await asyncio.gather(*(one(i, p, 0.0, True) for i, p in enumerate(prompts[:k])))
    mismatches = sum(a != b for a, b in zip(whole, streamed))
    return score(prompts, answers), k, mismatches


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one on --model)")
    p.add_argument("--model", help="checkpoint for the started server (default: the embedded namazu-tiny)")
    p.add_argument("--api-key")
    p.add_argument("--corpus", help="corpus directory (default: $NAMAZU_CORPUS or ../shared/corpus)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--stream-checks", type=int, default=20, help="prompts whose streamed calls are compared")
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--tool-choice", nargs="+", default=["auto", "required"], choices=["auto", "required"])
    p.add_argument("--results", default=str(HERE / "RESULTS.md"), help="markdown file to update ('' to skip)")
    args = p.parse_args(argv)

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model, [])
    results = {}
    try:
        for choice in args.tool_choice:
            results[choice] = asyncio.run(run(args, url.rstrip("/"), choice))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    measures = [("prompts (held-out schemas)", lambda s, k, m: f"{s['prompts']}"),
                ("cut off by max_tokens (not scored)", lambda s, k, m: f"{s['cut_off']}"),
                ("answered with tool_calls", lambda s, k, m: f"{s['trigger_rate']:.1%}"),
                ("tool calls", lambda s, k, m: f"{s['calls']}"),
                ("naming a declared tool", lambda s, k, m: f"{s['declared_tool']:.1%}"),
                ("arguments parse as JSON", lambda s, k, m: f"{s['json_parses']:.1%}"),
                ("arguments valid under the schema", lambda s, k, m: f"{s['schema_valid']:.1%}"),
                ("invalid calls (verifier target: 0)", lambda s, k, m: f"{s['invalid_calls']}"),
                ("expected tool", lambda s, k, m: f"{s['right_tool']:.1%}"),
                ("streamed == non-streamed at T=0", lambda s, k, m: f"{k - m}/{k}")]
    head = "| measure | " + " | ".join(f"tool_choice {c}" for c in results) + " |"
    rows = [head, "|---|" + "---|" * len(results)]
    rows += [f"| {name} | " + " | ".join(fn(*results[c]) for c in results) + " |" for name, fn in measures]
    mismatches = sum(m for _, _, m in results.values())
    k = sum(k for _, k, _ in results.values())
    table = "\n".join(rows)
    print(table)
    if args.results:
        command = "python bench/tool_calls.py " + " ".join(argv if argv is not None else sys.argv[1:])
        section = "\n".join(["## Tool calls through the API (`make bench-tools`)", "",
                             f"Command: `{command.strip()}`; temperature {args.temperature}; Kimi-K2 tool-call "
                             "sections generated under namazu's tool-call grammar and parsed by the server into "
                             "`tool_calls`. JSON and schema validity are counted over the calls of answers that "
                             "ended by themselves; answers cut off by max_tokens are counted apart (their last "
                             "call is incomplete by construction).", "", table])
        path = Path(args.results)
        write_section(START, END, section, path)
        print(f"\nwrote {path}")
    if mismatches:
        sys.exit(f"{mismatches} of {k} streamed answers differ from the non-streamed ones")


if __name__ == "__main__":
    main()
