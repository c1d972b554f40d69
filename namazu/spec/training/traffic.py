"""Chat traffic for the drafter: a prompt set like users send, and its replay through a running server.

`build_requests` draws chat requests from the namazu-tiny chat generators (Japanese and English chat,
answers after a tool's result, JSON / read-back answers), each with sampling settings drawn from a mix users
send (greedy, T=0.7 with top-p, T=1). The kinds of a drifted deployment (`namazu.tiny.drift_tasks`: requests
answered by a call of a freshly composed tool, records returned as JSON under a json_schema response format,
document continuations) and the share of requests that carry a seed are flags, so a mix unlike the shipped
drafter's traffic in content is one command (`make drafter-refresh`'s REFRESH_MIX). `replay` posts them to an
OpenAI-compatible server, concurrently, and returns per-request timings; `ServerProcess` starts
`python -m namazu.server` with given flags and waits until it listens. `make drafter-model` serves namazu-tiny
with `--capture-dir`, replays a prompt set, and trains on the captured ids; `bench.replay` replays held-out
captured requests through two setups.

`python -m namazu.spec.training.traffic --out FILE -n N [--split train|valid] [mix flags] [--capture-dir DIR]`
writes a request file (JSONL), and with --capture-dir serves namazu with it and replays the file through it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (weight, sampling settings): what the replayed users send.
SAMPLING_MIX: tuple[tuple[float, dict[str, Any]], ...] = (
    (0.4, {"temperature": 0.0}),
    (0.4, {"temperature": 0.7, "top_p": 0.9}),
    (0.2, {"temperature": 1.0}),
)


def build_requests(n: int, split: str = "train", seed: int = 0, max_tokens: int = 128,
                   corpus_dir: str | Path | None = None, english_share: float = 0.3, tool_weight: float = 1.0,
                   copy_weight: float = 0.5, qa_weight: float = 1.0, call_weight: float = 0.0,
                   json_weight: float = 0.0, continue_weight: float = 0.0, seed_share: float = 1.0
                   ) -> list[dict[str, Any]]:
    """n chat requests (messages, tools, response format, sampling settings, kind) from the tiny chat
    generators; the 'valid' split draws from held-out corpus text. The mix, in exchanges per `qa_weight`
    question-answer ones: `tool_weight` tool exchanges (answered after the tool's result), `copy_weight`
    read-back / JSON-formatting ones, and the kinds the shipped drafter's traffic never had
    (`namazu.tiny.drift_tasks`): `call_weight` requests answered by a call of a fresh tool, `json_weight`
    records returned as JSON under a json_schema response format, `continue_weight` continuations of a
    document; `english_share` of every kind in English. `seed_share` of the requests carry a seed (the
    rest none, as most clients send). The shipped drafter's traffic: 0.3 English, 1, 1, 0.5, 0, 0, 0, every
    request seeded; `make drafter-refresh` serves the drifted mix of docs/speculative.md."""
    from namazu.tiny.corpus import default_corpus_dir
    from namazu.tiny.data import ChatDataConfig, generate_chat_examples

    rng = random.Random(seed)
    cfg = ChatDataConfig(seed=10_000 + seed, num_qa=int(n * qa_weight), num_tool=int(n * tool_weight),
                         num_copy=int(n * copy_weight), english_share=english_share, synthetic_tool_share=0.5,
                         num_call=int(n * call_weight), num_json=int(n * json_weight),
                         num_continue=int(n * continue_weight))
    examples = generate_chat_examples(corpus_dir or default_corpus_dir(), cfg, split=split)
    rng.shuffle(examples)
    out = []
    for ex in examples[:n]:
        # The prompt is the conversation up to its last assistant turn; the server answers it.
        msgs = list(ex.messages)
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs:
            continue
        weights = [w for w, _ in SAMPLING_MIX]
        sampling = dict(rng.choices([s for _, s in SAMPLING_MIX], weights)[0])
        sampling.update(max_tokens=max_tokens)
        seed_draw = rng.randrange(2**31)        # drawn for every request, so seed_share 1 keeps the old files
        if seed_share >= 1 or rng.random() < seed_share:
            sampling["seed"] = seed_draw
        req = {"kind": ex.kind, "messages": msgs, "tools": ex.tools, "sampling": sampling}
        if ex.response_format:
            req["response_format"] = ex.response_format
        out.append(req)
    return out


def read_requests(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@dataclass
class ReplayResult:
    ok: bool
    ttft: float            # seconds to the first streamed token (from the first attempt)
    e2e: float             # seconds to the last byte (from the first attempt)
    completion_tokens: int
    error: str = ""
    retries: int = 0       # 429 answers waited out (the server's Retry-After) before it was served


def _retry_after(err: urllib.error.HTTPError) -> float:
    """The seconds a 429 asks the client to wait (Retry-After in seconds; 1 s when absent or unreadable)."""
    try:
        return max(0.0, float(err.headers.get("Retry-After", 1.0)))
    except (TypeError, ValueError):
        return 1.0


def _post_stream(url: str, body: dict[str, Any], timeout: float) -> ReplayResult:
    """One streamed request; a 429 (the server's admission limits, e.g. --max-grammar-compiles) is retried
    after its Retry-After until `timeout` has passed since the first attempt, as a client of a loaded server
    would: a replayed mix with many schemas otherwise loses every request past the limit."""
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    retries = 0
    while True:
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"].get("completion_tokens", tokens)
                    if ttft is None and chunk.get("choices"):
                        ttft = time.perf_counter() - t0
        except urllib.error.HTTPError as e:
            wait = _retry_after(e) if e.code == 429 else None
            if wait is not None and time.perf_counter() - t0 + wait < timeout:
                retries += 1
                time.sleep(wait)
                continue
            return ReplayResult(False, 0.0, time.perf_counter() - t0, 0, str(e), retries)
        except Exception as e:       # a failed request is reported, not fatal to the replay
            return ReplayResult(False, 0.0, time.perf_counter() - t0, 0, str(e), retries)
        e2e = time.perf_counter() - t0
        return ReplayResult(True, ttft if ttft is not None else e2e, e2e, tokens, retries=retries)


def request_body(r: dict[str, Any]) -> dict[str, Any]:
    """The /v1/chat/completions body of a request of the file (streamed, with usage)."""
    body = {"messages": r["messages"], "stream": True, "stream_options": {"include_usage": True}, **r["sampling"]}
    if r.get("tools"):
        body["tools"] = r["tools"]
    if r.get("response_format"):
        body["response_format"] = r["response_format"]
    return body


def replay(base_url: str, requests: list[dict[str, Any]], concurrency: int = 8, timeout: float = 600.0
           ) -> list[ReplayResult]:
    """Posts every request (streaming, with usage) to /v1/chat/completions; results in request order."""
    url = base_url.rstrip("/") + "/v1/chat/completions"

    def one(r: dict[str, Any]) -> ReplayResult:
        return _post_stream(url, request_body(r), timeout)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, requests))


class ServerProcess:
    """`python -m namazu.server --port 0 ARGS` in a subprocess; the URL once it listens."""

    def __init__(self, args: list[str], log_path: str | Path, env: dict[str, str] | None = None,
                 start_timeout: float = 300.0):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "namazu.server", "--port", "0", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            m = re.search(r"serving .* on (http://\S+)", Path(log_path).read_text())
            if m:
                self.url = m.group(1)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): see {log_path}")
            time.sleep(0.5)
        self.close()
        raise TimeoutError(f"the server did not start within {start_timeout:.0f} s: see {log_path}")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="request file to write (JSONL)")
    ap.add_argument("-n", type=int, default=1000, help="number of requests")
    ap.add_argument("--split", default="train", choices=("train", "valid"),
                    help="corpus split the chat text comes from (valid: held-out)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--english-share", type=float, default=0.3, help="share of the chat in English")
    ap.add_argument("--tool-weight", type=float, default=1.0, help="tool exchanges per question-answer one")
    ap.add_argument("--copy-weight", type=float, default=0.5,
                    help="read-back / JSON-formatting exchanges per question-answer one")
    ap.add_argument("--qa-weight", type=float, default=1.0,
                    help="weight of the question-answer exchanges (summaries, explanations); the other weights "
                         "are per question-answer exchange at 1, and every weight is relative to their sum")
    ap.add_argument("--call-weight", type=float, default=0.0,
                    help="requests answered by a call of a freshly composed tool, per question-answer one")
    ap.add_argument("--json-weight", type=float, default=0.0,
                    help="records returned as JSON under response_format json_schema, per question-answer one")
    ap.add_argument("--continue-weight", type=float, default=0.0,
                    help="continuations of a document's opening lines, per question-answer one")
    ap.add_argument("--seed-share", type=float, default=1.0,
                    help="share of the requests that carry a seed (default 1: all, as the shipped drafter's "
                         "traffic; the rest none, verified by the lossless rule at T > 0)")
    ap.add_argument("--capture-dir", default=None,
                    help="also serve namazu with --capture-dir DIR and replay the requests through it")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--server-args", default="", help="extra server flags (one string)")
    args = ap.parse_args(argv)
    reqs = build_requests(args.n, args.split, args.seed, args.max_tokens, english_share=args.english_share,
                          tool_weight=args.tool_weight, copy_weight=args.copy_weight, qa_weight=args.qa_weight,
                          call_weight=args.call_weight, json_weight=args.json_weight,
                          continue_weight=args.continue_weight, seed_share=args.seed_share)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in reqs))
    print(f"{len(reqs)} requests -> {args.out}")
    if args.capture_dir:
        t0 = time.time()
        log = Path(args.capture_dir).with_suffix(".server.log")
        Path(args.capture_dir).mkdir(parents=True, exist_ok=True)
        with ServerProcess(["--capture-dir", args.capture_dir, *args.server_args.split()], log) as server:
            results = replay(server.url, reqs, args.concurrency)
        failed = sum(not r.ok for r in results)
        print(f"replayed {len(results)} requests ({failed} failed, {sum(r.retries for r in results)} 429s retried, "
              f"{sum(r.completion_tokens for r in results)} tokens) in {time.time() - t0:.0f} s -> {args.capture_dir}")
        if failed:
            print("first failure:", next(r.error for r in results if not r.ok), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
