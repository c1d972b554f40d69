"""Online serving benchmark: Poisson arrivals against the OpenAI-compatible server, in the spirit of
`vllm bench serve`.

Two workloads, each at several request rates:
- shared-prefix: many users behind one long system prompt, multi-turn. Turn k of a user carries the
  system prompt, the user's earlier turns and the model's earlier answers, plus a new question; a user's
  next turn is sent only after the previous answer arrived. The prefix cache should serve the system
  prompt and the history.
- random: independent random prompts of a fixed token length (no sharing beyond chance).
Every request streams (SSE) with ignore_eos so output lengths are exact. Per request: TTFT (send to
first content chunk), inter-token latency (gaps between content chunks), end-to-end latency, tokens and
cached prompt tokens from the final usage chunk. Per run: p50/p99 of each, output tokens/s, requests/s,
prefix-cache hit rate (cached prompt tokens / prompt tokens).

    python bench/serve.py                       # starts a server on the embedded default model
    python bench/serve.py --model DIR --rates 1,2,4 --num-requests 32
    python bench/serve.py --url http://127.0.0.1:8000 --tokenizer DIR

Writes a table to stdout, a section of bench/RESULTS.md and a latency-vs-rate plot (bench/serve_latency.png).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from results_md import write_section  # bench/ is on sys.path when run as `python bench/X.py`

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
START, END = "<!-- bench-serve:start -->", "<!-- bench-serve:end -->"

WORDS = ("the model serves many users at once and every request streams its tokens back as they are made "
         "a shared system prompt is computed once and reused by the prefix cache while each turn adds "
         "history 東京 大阪 鯰 川 魚 天気 予約 会議 資料 確認 お願い します 明日 今日 価格 注文 配送 "
         "weather booking invoice order delivery price meeting report schedule contract").split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""


class PromptMaker:
    """Random word text of an exact token length under the served model's tokenizer."""

    def __init__(self, tokenizer_dir: Path, seed: int):
        from namazu.tokenizer import Tokenizer

        self.tok = Tokenizer.from_pretrained(tokenizer_dir)
        self.rng = random.Random(seed)

    def text(self, num_tokens: int) -> str:
        words: list[str] = []
        ids: list[int] = []
        while len(ids) < num_tokens:
            words.extend(self.rng.choice(WORDS) for _ in range(max(1, (num_tokens - len(ids)) // 2)))
            ids = self.tok.encode(" ".join(words), add_special_tokens=False)
        return self.tok.decode(ids[:num_tokens])


async def stream_request(client: httpx.AsyncClient, path: str, body: dict) -> Result:
    body = dict(body, stream=True, stream_options={"include_usage": True}, ignore_eos=True)
    t0 = time.perf_counter()
    last = None
    res = Result(ok=False)
    pieces: list[str] = []
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                for c in chunk.get("choices", []):
                    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        pieces.append(piece)
                if chunk.get("usage"):
                    u = chunk["usage"]
                    res.prompt_tokens = u["prompt_tokens"]
                    res.output_tokens = u["completion_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.text = "".join(pieces)
    res.ok = res.output_tokens > 0
    if not res.ok:
        res.error = f"stream ended with {len(pieces)} content chunks and usage {res.output_tokens} tokens"
    return res


def arrivals(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Poisson process: exponential gaps with mean 1/rate (rate inf: all at t=0)."""
    if np.isinf(rate):
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


async def run_random(client: httpx.AsyncClient, model: str, pm: PromptMaker, rate: float, args) -> list[Result]:
    rng = np.random.default_rng(args.seed)
    times = arrivals(rate, args.num_requests, rng)
    prompts = [pm.text(args.random_input_len) for _ in range(args.num_requests)]
    t0 = time.perf_counter()

    async def one(i: int) -> Result:
        await asyncio.sleep(max(0.0, t0 + times[i] - time.perf_counter()))
        return await stream_request(client, "/v1/completions", {
            "model": model, "prompt": prompts[i], "max_tokens": args.random_output_len, "temperature": 0.8,
            "seed": i})

    return list(await asyncio.gather(*(one(i) for i in range(args.num_requests))))


async def run_shared_prefix(client: httpx.AsyncClient, model: str, pm: PromptMaker, rate: float,
                            args) -> list[Result]:
    rng = np.random.default_rng(args.seed)
    times = arrivals(rate, args.num_requests, rng)
    system = pm.text(args.shared_prefix_len)        # fresh per run: each rate starts with a cold cache
    histories: list[list[dict]] = [[{"role": "system", "content": system}] for _ in range(args.num_users)]
    questions = [pm.text(args.turn_input_len) for _ in range(args.num_requests)]
    previous: list[asyncio.Future | None] = [None] * args.num_users
    t0 = time.perf_counter()

    async def one(i: int, user: int, prev: asyncio.Future | None, done: asyncio.Future) -> Result:
        await asyncio.sleep(max(0.0, t0 + times[i] - time.perf_counter()))
        if prev is not None:
            await prev                               # a user asks again only after the last answer
        try:
            msgs = histories[user] + [{"role": "user", "content": questions[i]}]
            res = await stream_request(client, "/v1/chat/completions", {
                "model": model, "messages": msgs, "max_tokens": args.turn_output_len, "temperature": 0.8,
                "seed": i})
            histories[user] = msgs + [{"role": "assistant", "content": res.text}]
            if len(histories[user]) > 1 + 2 * args.max_turns:   # a finished conversation: start over
                histories[user] = histories[user][:1]
            return res
        finally:
            done.set_result(None)

    tasks = []
    for i in range(args.num_requests):
        user = i % args.num_users
        done = asyncio.get_running_loop().create_future()
        tasks.append(one(i, user, previous[user], done))
        previous[user] = done
    return list(await asyncio.gather(*tasks))


def summarize(workload: str, rate: float, results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1000 if len(xs) else float("nan")  # noqa: E731
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    return {"workload": workload, "rate": rate, "requests": len(results), "failed": len(results) - len(ok),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99), "out_tok_s": out_tokens / wall,
            "req_s": len(ok) / wall, "prefix_hit": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
            "errors": sorted({r.error for r in results if not r.ok})[:3]}


COLUMNS = [("workload", "workload", "{}"), ("rate", "rate req/s", "{:g}"), ("requests", "requests", "{}"),
           ("failed", "failed", "{}"), ("ttft_p50", "TTFT p50 ms", "{:.0f}"), ("ttft_p99", "TTFT p99 ms", "{:.0f}"),
           ("itl_p50", "ITL p50 ms", "{:.1f}"), ("itl_p99", "ITL p99 ms", "{:.1f}"),
           ("e2e_p50", "e2e p50 ms", "{:.0f}"), ("e2e_p99", "e2e p99 ms", "{:.0f}"),
           ("out_tok_s", "out tok/s", "{:.1f}"), ("req_s", "req/s done", "{:.2f}"),
           ("prefix_hit", "prefix hit", "{:.1%}")]


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(fmt.format(r[k]) for k, _, fmt in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (metric, title) in zip(axes, (("ttft", "TTFT"), ("itl", "inter-token latency"), ("e2e", "end-to-end"))):
        for wl in sorted({r["workload"] for r in rows}):
            rs = sorted((r for r in rows if r["workload"] == wl), key=lambda r: r["rate"])
            x = [r["rate"] for r in rs]
            ax.plot(x, [r[f"{metric}_p50"] for r in rs], "o-", label=f"{wl} p50")
            ax.plot(x, [r[f"{metric}_p99"] for r in rs], "s--", label=f"{wl} p99")
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_results(path: Path, rows: list[dict], command: str, setup: str, plot_path: Path | None) -> None:
    section = "\n".join([
        "## Online serving (`make bench-serve`)", "", f"Command: `{command}`", "", setup, "",
        table(rows), "", *([f"![latency vs request rate]({plot_path.name})", ""] if plot_path else []),
        "TTFT: send to first streamed content; ITL: gaps between streamed content chunks (one per token "
        "per step); e2e: send to last chunk; prefix hit: cached prompt tokens / prompt tokens from the "
        "usage chunks. Shared-prefix turns wait for the same user's previous answer, so at high rates "
        "the offered load is capped by the conversation chains."])
    write_section(START, END, section, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "namazu.server", "--port", str(port), "--served-model-name", "bench",
           "--log-level", "warning", *extra]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {shlex.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise SystemExit("the server did not become healthy in 600 s")


async def bench(args, url: str, model_name: str, pm: PromptMaker) -> list[dict]:
    rows = []
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, headers=headers) as client:
        # Warm-up: first-request costs (allocations, lazy imports) stay out of the numbers.
        await stream_request(client, "/v1/completions", {"model": model_name, "prompt": pm.text(16), "max_tokens": 4})
        for workload in args.workloads.split(","):
            runner = {"shared-prefix": run_shared_prefix, "random": run_random}.get(workload)
            if runner is None:
                raise SystemExit(f"--workloads: unknown workload {workload!r} (shared-prefix, random)")
            for rate in [float(x) for x in args.rates.split(",")]:
                t0 = time.perf_counter()
                results = await runner(client, model_name, pm, rate, args)
                row = summarize(workload, rate, results, time.perf_counter() - t0)
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
                if row["errors"]:
                    print("  errors:", row["errors"], file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="benchmark a running server instead of starting one")
    p.add_argument("--model", help="checkpoint for the server this script starts (default: embedded model)")
    p.add_argument("--tokenizer", help="tokenizer directory for building prompts (default: the model's)")
    p.add_argument("--server-args", default="", help="extra flags for the started server, e.g. '--max-num-seqs 32'")
    p.add_argument("--api-key", default=os.environ.get("NAMAZU_API_KEY"))
    p.add_argument("--workloads", default="shared-prefix,random")
    p.add_argument("--rates", default="0.5,1,2,4", help="request rates (req/s) to sweep; 'inf' sends all at once")
    p.add_argument("--num-requests", type=int, default=24, help="requests per (workload, rate)")
    p.add_argument("--random-input-len", type=int, default=64)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--shared-prefix-len", type=int, default=256, help="system-prompt tokens shared by all users")
    p.add_argument("--num-users", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=4, help="turns per conversation before a user starts over")
    p.add_argument("--turn-input-len", type=int, default=16)
    p.add_argument("--turn-output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=str(HERE / "RESULTS.md"), help="markdown file to update ('' to skip)")
    p.add_argument("--plot", default=str(HERE / "serve_latency.png"), help="latency-vs-rate plot ('' to skip)")
    args = p.parse_args(argv)

    from namazu.assets import resolve_model_path

    proc = None
    if args.url:
        url = args.url.rstrip("/")
        tok_dir = Path(args.tokenizer) if args.tokenizer else resolve_model_path(args.model)
    else:
        tok_dir = Path(args.tokenizer) if args.tokenizer else resolve_model_path(args.model)
        proc, url = start_server(args.model, shlex.split(args.server_args))
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model_name = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        pm = PromptMaker(tok_dir, args.seed)
        print(table([]).split("\n")[0] + "\n" + table([]).split("\n")[1], flush=True)
        load_before = os.getloadavg()[0]
        rows = asyncio.run(bench(args, url, model_name, pm))
        load_after = os.getloadavg()[0]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print()
    print(table(rows))
    # '' skips the plot (Path('') would name the current directory, and the writer then wrote ".png" there).
    plot_path = Path(args.plot) if args.plot else None
    if plot_path is not None:
        plot(rows, plot_path)
    if args.results:
        command = "python bench/serve.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        setup = (f"Model `{tok_dir.name}`; server `{args.server_args or 'default flags'}`; "
                 f"{os.cpu_count()} CPU threads visible ({platform.machine()}, OMP_NUM_THREADS="
                 f"{os.environ.get('OMP_NUM_THREADS', 'unset')}); {args.num_requests} requests per point; random: "
                 f"{args.random_input_len} in / {args.random_output_len} out tokens; shared-prefix: "
                 f"{args.shared_prefix_len}-token system prompt, {args.num_users} users, up to {args.max_turns} "
                 f"turns of {args.turn_input_len} in / {args.turn_output_len} out tokens. 1-minute load "
                 f"average {load_before:.1f} at the start, {load_after:.1f} at the end (other jobs on the machine "
                 "make the points noisy when it is above the core count).")
        write_results(Path(args.results), rows, command.strip(), setup, plot_path)
        print(f"\nwrote {args.results}" + (f" and {plot_path}" if plot_path else ""))


if __name__ == "__main__":
    main()
