"""lm-evaluation-harness against namazu with only `base_url`: its local-completions model, no local
tokenizer, so it probes /tokenizer_info and tokenizes through /tokenize (its remote tokenizer).

A small multiple-choice task (written to a temporary folder, loaded by lm-eval's `json` dataset loader) is
scored twice: by lm-eval, and directly here from /v1/completions echo logprobs (each choice's summed
logprob after the question, argmax = the answer). The two accuracies must agree: lm-eval talked to the
server the way it does to vLLM and read the same numbers.

    python bench/lm_eval_remote.py --lm-eval-python python3      # a Python that has lm_eval installed
    python bench/lm_eval_remote.py --lm-eval-path DIR            # lm_eval installed with pip --target DIR
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve import start_server  # noqa: E402  (bench/ is a folder of scripts, not a package)

ROWS = [{"question": f"{a} + {b} =", "choices": [f" {a + b}", f" {a + b + 1}", f" {a * b + 7}"], "answer": 0}
        for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (6, 3), (7, 2), (4, 4), (8, 1), (9, 0), (2, 5)]]
TASK = """task: namazu_arith
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def direct_accuracy(url: str) -> float:
    """Each choice scored by the server's echo logprobs of its tokens after the question."""
    right = 0
    with httpx.Client(base_url=url, timeout=60) as c:
        for row in ROWS:
            n_ctx = len(c.post("/tokenize", json={"prompt": row["question"]}).json()["tokens"])
            scores = []
            for choice in row["choices"]:
                r = c.post("/v1/completions", json={"prompt": row["question"] + choice, "max_tokens": 0, "echo": True,
                                                    "logprobs": 0}).json()
                scores.append(sum(r["choices"][0]["logprobs"]["token_logprobs"][n_ctx:]))
            right += max(range(len(scores)), key=scores.__getitem__) == row["answer"]
    return right / len(ROWS)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm-eval-python", default=sys.executable, help="the Python that runs lm_eval")
    p.add_argument("--lm-eval-path", default="", help="prepended to that Python's PYTHONPATH (pip --target dir)")
    p.add_argument("--url", help="a running server (default: start one on the embedded namazu-tiny)")
    args = p.parse_args(argv)
    proc, url = (None, args.url) if args.url else start_server(None, ["--max-model-len", "512"])
    try:
        with tempfile.TemporaryDirectory() as d:
            data = Path(d) / "data.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
            (Path(d) / "task.yaml").write_text(TASK.format(data=data))
            env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                       PYTHONPATH=args.lm_eval_path or os.environ.get("PYTHONPATH", ""))
            cmd = [args.lm_eval_python, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                   f"base_url={url}/v1/completions", "--tasks", "namazu_arith", "--include_path", d,
                   "--batch_size", "1"]
            out = subprocess.run(cmd, env=env, cwd=d, capture_output=True, text=True, timeout=900)
        log = out.stdout + out.stderr
        remote = "Using remote tokenizer" in log or "remote" in "".join(re.findall(r"Using tokenizer \S+", log))
        m = re.search(r"\|namazu_arith\|.*?\|acc\s*\|[^|]*\|\s*([0-9.]+)\|", log)
        if out.returncode != 0 or m is None:
            print(log[-3000:])
            raise SystemExit(f"lm_eval failed (exit {out.returncode})")
        lm_acc, own = float(m.group(1)), direct_accuracy(url)
        print("| run | tokenizer | acc |\n|---|---|---|")
        how = "remote (/tokenize)" if remote else "?"
        print(f"| lm-eval local-completions, base_url only | {how} | {lm_acc:.3f} |")
        print(f"| /v1/completions echo logprobs, scored here | server | {own:.3f} |")
        if not remote or abs(lm_acc - own) > 1e-9:
            raise SystemExit("lm-eval did not use the remote tokenizer, or its accuracy differs")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
