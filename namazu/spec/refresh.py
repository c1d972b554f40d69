"""`python -m namazu.spec.refresh`: a new drafter from captured traffic, kept only if it is better.

    python -m namazu.spec.refresh --capture DIR [DIR ...] --base DRAFTER_DIR --out DIR \\
        [--from-scratch] [--since T] [--until T] [--heldout-fraction 0.15] [--margin 0.05] \\
        [--train-args "--time-budget 10 ..."] [--server URL --admin-key KEY] [--shadow-metrics SRC]

Stages, each recorded in OUT/state.json when done, so a run that crashed resumes where it stopped (a
replay resumes at its next request; training, which keeps no checkpoint of its own, starts over):

1. data: read the captures (torn or corrupt lines skipped), drop requests outside the time window, requests
   that ended in an error or an abort, and duplicates (the same prompt and outputs); hold out the newest
   requests by arrival time, whole requests (never tokens), in OUT/data/heldout.ndjson; the rest train;
2. train: fine-tune the base drafter (`--init`), or train one of its shape from scratch (`--from-scratch`),
   with `namazu.spec.training.train` into OUT/candidate;
3. calibrate: fit the candidate's `q_temperature_scale` (`namazu.spec.training.calibrate`) on the sampled
   training requests (skipped when there are none);
4. replay: every held-out request through the engine with the base drafter, then with the candidate, with its
   own sampling settings and seed, one at a time (`namazu.spec.training.replay`); with `--guard CAPTURE` the
   held-out requests of another mix too (the candidate may not be worse there beyond the margin);
5. report: acceptance length and tokens per step overall and per class, with paired bootstrap intervals, and
   the verdict (`namazu.spec.training.gate`): OUT/report.md, OUT/report.json. With `--server` a promoted
   candidate is sent to that server's POST /admin/drafter (its path must be under the server's --drafter-root).
   With `--shadow-metrics SRC` (a server's /metrics URL, a saved copy, or a JSON stats file) the live numbers
   of a shadow drafter (`--shadow-drafter`, `namazu/spec/shadow.py`) are printed beside the replay, read
   afresh on every run (`namazu/spec/shadow_report.py`).
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
import zlib
from datetime import datetime
from pathlib import Path

from namazu.spec.capture import CaptureRecord, ReadStats, read_records, write_records

logger = logging.getLogger("namazu.spec.refresh")

STAGES = ("data", "train", "calibrate", "replay-base", "replay-candidate", "replay-guard-base",
          "replay-guard-candidate", "report")
BAD_FINISH = {None, "abort", "error"}


def parse_time(value: str | None) -> float | None:
    """Unix seconds, or an ISO 8601 date/time (UTC unless it says otherwise)."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected unix seconds or an ISO 8601 time") from None
    if dt.tzinfo is None:
        from datetime import timezone

        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def arrival(rec: CaptureRecord) -> float:
    return float((rec.timings or {}).get("arrival") or 0.0)


def select(records: list[CaptureRecord], since: float | None, until: float | None) -> tuple[list, dict]:
    """The records worth training on, with the counts of what was dropped and why."""
    kept, seen = [], set()
    dropped = {"outside_window": 0, "error_or_abort": 0, "duplicate": 0, "empty": 0}
    for rec in records:
        t = arrival(rec)
        if (since is not None and t < since) or (until is not None and t >= until):
            dropped["outside_window"] += 1
            continue
        if not rec.output_token_ids or any(r in BAD_FINISH for r in rec.finish_reasons):
            dropped["error_or_abort"] += 1
            continue
        if not any(len(o) >= 2 for o in rec.output_token_ids):
            dropped["empty"] += 1
            continue
        key = zlib.crc32(json.dumps([rec.prompt_token_ids, rec.output_token_ids]).encode())
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        kept.append(rec)
    return kept, dropped


def split_newest(records: list[CaptureRecord], fraction: float, count: int | None) -> tuple[list, list]:
    """(train, held out): the newest requests by arrival are held out, whole."""
    ordered = sorted(records, key=arrival)
    n = count if count is not None else max(1, round(len(ordered) * fraction))
    n = min(n, len(ordered) - 1)
    if n < 1:
        raise SystemExit(f"{len(ordered)} usable captured request(s): too few to train on and hold some out")
    return ordered[:-n], ordered[-n:]


class Run:
    """OUT/state.json: the arguments the run started with and the stages done."""

    def __init__(self, out: Path, args: argparse.Namespace):
        self.out, self.file = out, out / "state.json"
        ident = {"capture": [str(Path(c).resolve()) for c in args.capture], "base": str(Path(args.base).resolve()),
                 "from_scratch": args.from_scratch, "since": args.since, "until": args.until,
                 "heldout_fraction": args.heldout_fraction, "heldout": args.heldout,
                 "guard": [str(Path(c).resolve()) for c in args.guard or []]}
        if self.file.is_file():
            self.state = json.loads(self.file.read_text())
            if self.state.get("run") != ident:
                raise SystemExit(f"{out} holds a refresh of other inputs ({self.state.get('run')}); use another --out "
                                 "or --restart")
            logger.info("resuming %s: done %s", out, self.state["done"])
        else:
            out.mkdir(parents=True, exist_ok=True)
            self.state = {"run": ident, "done": [], "info": {}}
            self.save()

    def save(self) -> None:
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1) + "\n")
        tmp.replace(self.file)

    def done(self, stage: str) -> bool:
        return stage in self.state["done"]

    def finish(self, stage: str, **info) -> None:
        self.state["done"].append(stage)
        self.state["info"][stage] = info
        self.save()
        logger.info("stage %s done %s", stage, json.dumps(info) if info else "")


def stage_data(run: Run, args: argparse.Namespace) -> None:
    stats = ReadStats()
    records = list(read_records(args.capture, stats))
    kept, dropped = select(records, args.since, args.until)
    train, heldout = split_newest(kept, args.heldout_fraction, args.heldout)
    write_records(run.out / "data" / "train.ndjson", train)
    write_records(run.out / "data" / "heldout.ndjson", heldout)
    run.finish("data", read=stats.records, torn_or_corrupt=stats.skipped, dropped=dropped, train=len(train),
               heldout=len(heldout), heldout_from=arrival(heldout[0]) if heldout else None)


def stage_train(run: Run, args: argparse.Namespace) -> None:
    from namazu.spec.training import train

    partial, final = run.out / "candidate.partial", run.out / "candidate"
    shutil.rmtree(partial, ignore_errors=True)
    argv = ["--data", str(run.out / "data" / "train.ndjson"), "--heldout", str(run.out / "data" / "heldout.ndjson"),
            "--out", str(partial), *(["--target", args.target] if args.target else [])]
    if args.from_scratch:
        argv += _shape_of(args.base)
    else:
        argv += ["--init", args.base]
    argv += args.train_args.split()
    t0 = time.time()
    train.train(train.build_parser().parse_args(argv))
    shutil.rmtree(final, ignore_errors=True)
    partial.replace(final)
    run.finish("train", seconds=round(time.time() - t0, 1), argv=argv)


def _shape_of(base: str) -> list[str]:
    """Trainer flags for a fresh drafter of the base's shape."""
    from namazu.spec.dflash_config import DFlashConfig

    c = DFlashConfig.load(base)
    return ["--target-layers", *map(str, c.target_layers), "--block-size", str(c.block_size), "--num-layers",
            str(c.num_layers), "--num-heads", str(c.num_heads), "--head-dim", str(c.head_dim), "--intermediate-size",
            str(c.intermediate_size), "--selector-k", str(c.selector_k), "--selector-rank", str(c.selector_rank),
            *(["--draft-vocab", str(c.draft_vocab_size)] if c.draft_vocab_size else [])]


def stage_calibrate(run: Run, args: argparse.Namespace) -> None:
    from namazu.spec.training import calibrate

    train_file = run.out / "data" / "train.ndjson"
    temps = sorted({float(r.sampling.get("temperature") or 0) for r in read_records(train_file)} - {0.0})
    if not temps or args.no_calibrate:
        run.finish("calibrate", skipped="no sampled training requests" if not temps else "--no-calibrate")
        return
    calibrate.main(["--drafter", str(run.out / "candidate"), "--data", str(train_file), "--temperatures",
                    *map(str, temps[:3]), "--limit", str(args.calibrate_limit),
                    *(["--target", args.target] if args.target else [])])
    run.finish("calibrate", temperatures=temps[:3])


def engine_kwargs(args: argparse.Namespace, drafter: str) -> dict:
    from namazu.spec.dflash_config import DFlashConfig

    k = args.k or DFlashConfig.load(args.base).num_draft_tokens
    return {"model": args.target, "speculative_model": drafter, "num_speculative_tokens": k,
            "speculative_min_confidence": args.min_confidence, "dtype": "float32"}


def heldout_records(run: Run, args: argparse.Namespace, guard: bool = False) -> list[CaptureRecord]:
    """The held-out requests replayed (`--guard`: those of the other mix)."""
    if guard:
        recs, _ = select(list(read_records(args.guard)), None, None) if args.guard else ([], {})
    else:
        recs = list(read_records(run.out / "data" / "heldout.ndjson"))
    return recs[:args.replay_limit or None]


def stage_replay(run: Run, args: argparse.Namespace, which: str, guard: bool = False) -> None:
    from namazu.spec.training.replay import replay_acceptance

    name = f"replay-guard-{which}" if guard else f"replay-{which}"
    recs = heldout_records(run, args, guard)
    path = args.base if which == "base" else str(run.out / "candidate")
    res = replay_acceptance(recs, engine_kwargs(args, path), run.out / f"{name}.ndjson", desc=name) if recs else {}
    run.finish(name, requests=len(res))


def stage_report(run: Run, args: argparse.Namespace) -> dict:
    from namazu.assets import resolve_model_path
    from namazu.spec.training.gate import judge, report_markdown
    from namazu.spec.training.replay import read_results
    from namazu.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(resolve_model_path(args.target))
    verdict = judge(heldout_records(run, args), read_results(run.out / "replay-base.ndjson"),
                    read_results(run.out / "replay-candidate.ndjson"), tok, args.margin, args.min_class_requests,
                    args.resamples)
    if args.guard:
        other = judge(heldout_records(run, args, True), read_results(run.out / "replay-guard-base.ndjson"),
                      read_results(run.out / "replay-guard-candidate.ndjson"), tok, args.margin,
                      args.min_class_requests, args.resamples)
        guard_verdict(verdict, other, args.guard)
    report = {**verdict.to_dict(), "base": args.base, "candidate": str(run.out / "candidate"),
              "data": run.state["info"].get("data", {})}
    (run.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (run.out / "report.md").write_text(report_markdown(verdict, args.base, str(run.out / "candidate")))
    run.finish("report", promote=verdict.promote)
    return report


def guard_verdict(verdict, guard, where: list[str]) -> None:
    """The other mix (`--guard`) may not be worse than the margin overall: its comparison joins the classes."""
    verdict.classes["guard"] = {"all": guard.overall}
    if guard.overall.ratio < 1 - verdict.margin:
        verdict.promote = False
        verdict.reasons.append(f"the other mix ({' '.join(where)}) is worse beyond the margin: acceptance length "
                               f"{guard.overall.a_acceptance:.3f} -> {guard.overall.b_acceptance:.3f} "
                               f"({guard.overall.ratio:.3f}x < {1 - verdict.margin:.3f}x)")
    else:
        verdict.reasons.append(f"the other mix ({' '.join(where)}): {guard.overall.ratio:.3f}x, within the margin")


def add_live_shadow(report: dict, args: argparse.Namespace, out: Path) -> None:
    """The live shadow's numbers (`--shadow-metrics`) into report.json and a section of report.md, replacing
    an earlier run's (they are read afresh each run)."""
    from types import SimpleNamespace

    from namazu.spec.drafter_swap import drafter_id
    from namazu.spec.shadow_report import read_shadow_metrics, shadow_markdown

    try:
        live = read_shadow_metrics(args.shadow_metrics)
    except (ValueError, OSError) as e:
        raise SystemExit(str(e)) from None
    ids = {drafter_id(SimpleNamespace(path=args.base)): "serving (base)"}
    if (out / "candidate").is_dir():
        ids[drafter_id(SimpleNamespace(path=str(out / "candidate")))] = "candidate"
    report["live_shadow"] = live
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    md = (out / "report.md").read_text().split("\n## Live shadow")[0].rstrip("\n") + "\n"
    (out / "report.md").write_text(md + shadow_markdown(live, report["overall"], ids))


def promote_live(server: str, admin_key: str, path: str) -> dict:
    """POST /admin/drafter on a running server; its answer (or SystemExit with the server's error)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.rstrip("/") + "/admin/drafter", data=json.dumps({"path": path}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {admin_key}"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"the server refused the candidate ({e.code}): {e.read().decode()[:500]}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m namazu.spec.refresh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--capture", nargs="+", required=True, help="capture directories or shard files")
    ap.add_argument("--base", required=True, help="the serving drafter's directory (fine-tuned, and compared with)")
    ap.add_argument("--out", required=True, help="work directory: data, candidate, replays, report, state")
    ap.add_argument("--target", default=None, help="target checkpoint (default: namazu-tiny)")
    ap.add_argument("--from-scratch", action="store_true", help="train a drafter of the base's shape afresh")
    ap.add_argument("--since", type=parse_time, default=None, help="drop requests that arrived before (unix s / ISO)")
    ap.add_argument("--until", type=parse_time, default=None, help="drop requests that arrived at or after")
    ap.add_argument("--heldout-fraction", type=float, default=0.15, help="newest share of requests held out")
    ap.add_argument("--heldout", type=int, default=None, help="hold out this many newest requests instead")
    ap.add_argument("--train-args", default="", help="more flags for namazu.spec.training.train (one string)")
    ap.add_argument("--no-calibrate", action="store_true")
    ap.add_argument("--calibrate-limit", type=int, default=500)
    ap.add_argument("--k", type=int, default=0, help="draft tokens of the replays (default: the base's block - 1)")
    ap.add_argument("--min-confidence", type=float, default=0.01,
                    help="--speculative-min-confidence of the replays (default: the shipped drafter's 0.01)")
    ap.add_argument("--replay-limit", type=int, default=0, help="replay at most this many held-out requests")
    ap.add_argument("--guard", nargs="+", default=None, metavar="CAPTURE",
                    help="held-out captures of another mix (e.g. the serving drafter's own held-out requests): "
                         "replayed through both too; the candidate may not be worse there beyond --margin")
    ap.add_argument("--margin", type=float, default=0.05, help="a class may be this much worse (relative)")
    ap.add_argument("--min-class-requests", type=int, default=20, help="smaller classes are reported, not gated")
    ap.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--restart", action="store_true", help="discard OUT's earlier run and start over")
    ap.add_argument("--server", default=None, help="on promotion, POST the candidate to this server's /admin/drafter")
    ap.add_argument("--admin-key", default=None, help="that server's --admin-key")
    ap.add_argument("--shadow-metrics", default=None, metavar="SRC",
                    help="a server's /metrics URL, a saved copy, or a JSON stats file: the live numbers of its "
                         "shadow drafter (--shadow-drafter) beside the offline replay in the report")
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if not 0 < args.heldout_fraction < 1:
        raise SystemExit("--heldout-fraction must be in (0, 1)")
    if args.server and not args.admin_key:
        raise SystemExit("--server needs --admin-key")
    from namazu.spec.dflash_config import DFlashConfig

    DFlashConfig.load(args.base)          # a bad base fails now, not after training
    out = Path(args.out)
    if args.restart:
        shutil.rmtree(out, ignore_errors=True)
    run = Run(out, args)
    t0 = time.time()
    steps = {"data": stage_data, "train": stage_train, "calibrate": stage_calibrate,
             "replay-base": lambda r, a: stage_replay(r, a, "base"),
             "replay-candidate": lambda r, a: stage_replay(r, a, "candidate"),
             "replay-guard-base": lambda r, a: stage_replay(r, a, "base", guard=True),
             "replay-guard-candidate": lambda r, a: stage_replay(r, a, "candidate", guard=True)}
    for stage in STAGES[:-1]:
        if not run.done(stage):
            steps[stage](run, args)
    report = stage_report(run, args) if not run.done("report") else json.loads((out / "report.json").read_text())
    if args.shadow_metrics:
        add_live_shadow(report, args, out)
    print((out / "report.md").read_text())
    o = report["overall"]
    print(f"summary: {run.state['info']['data']['train']} training / {o['requests']} held-out requests replayed; "
          f"acceptance length {o['a_acceptance']:.3f} -> {o['b_acceptance']:.3f} ({o['ratio']:.3f}x); "
          f"{'PROMOTE' if report['promote'] else 'keep the serving drafter'}; {time.time() - t0:.0f} s this run; "
          f"report in {out / 'report.md'}")
    if report["promote"] and args.server:
        print(f"sent to {args.server}: {promote_live(args.server, args.admin_key, str((out / 'candidate').resolve()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
