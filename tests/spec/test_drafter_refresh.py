"""`python -m namazu.spec.refresh`: capture filtering and the newest-requests hold-out, the paired bootstrap
gate on hand-made tallies, and the command end to end on namazu-tiny's own answers: a candidate fine-tuned
on shuffled ids is refused, a better one promoted, and a run that crashed in its replay resumes without
training again."""
import json
import shutil
import time

import numpy as np
import pytest

from namazu import LLM, SamplingParams
from namazu.spec.capture import CaptureRecord, CaptureWriter, read_records
from namazu.spec.refresh import main, select, split_newest
from namazu.spec.training.gate import compare, judge, request_classes, temperature_bucket
from namazu.spec.training.replay import RequestAcceptance, read_results
from namazu.spec.training.traffic import build_requests

TRAIN_ARGS = "--steps 30 --time-budget 2 --batch 4 --anchors 32 --lr 3e-3 --eval-k 3 --no-bf16 --hidden-cache memory"


def rec(rid, t, out=(5, 6, 7), finish="length", prompt=(1, 2), temperature=0.0):
    return CaptureRecord(rid, list(prompt), [list(out)], [finish], {"temperature": temperature},
                         {"arrival": t})


def test_select_drops_window_errors_duplicates_and_holds_out_the_newest():
    recs = [rec("a", 10), rec("b", 20, finish="abort"), rec("c", 30, prompt=(9,)), rec("d", 40, prompt=(9,)),
            rec("e", 50, out=(1,)), rec("f", 5), rec("g", 60, prompt=(3,)), rec("h", 70, prompt=(4,)),
            rec("i", 80, finish=None, prompt=(8,))]
    kept, dropped = select(recs, since=8, until=75)
    assert [r.request_id for r in kept] == ["a", "c", "g", "h"]
    assert dropped == {"outside_window": 2, "error_or_abort": 1, "duplicate": 1, "empty": 1}
    train, heldout = split_newest(list(reversed(kept)), 0.5, None)
    assert [r.request_id for r in train] == ["a", "c"] and [r.request_id for r in heldout] == ["g", "h"]
    assert [r.request_id for r in split_newest(kept, 0.5, 1)[1]] == ["h"]


def test_bootstrap_gate_on_hand_made_tallies():
    rng = np.random.default_rng(0)
    n = 60
    # A: 2 tokens per verify step; B: 3, on every request (10 verify steps each): a gain of exactly 1.
    a = [RequestAcceptance(str(i), [0, 10, 0], 20, 12) for i in range(n)]
    b = [RequestAcceptance(str(i), [0, 0, 10], 30, 12) for i in range(n)]
    c = compare(a, b)
    assert c.a_acceptance == 2 and c.b_acceptance == 3 and c.gain_low == c.gain_high == 1.0 and c.ratio == 1.5
    # Ratio of sums, not mean of ratios: one request with 1 step at 7 tokens, one with 9 steps at 1.
    c = compare([RequestAcceptance("x", [0] * 6 + [1], 7, 1), RequestAcceptance("y", [9], 9, 9)],
                [RequestAcceptance("x", [1], 1, 1), RequestAcceptance("y", [9], 9, 9)])
    assert c.a_acceptance == pytest.approx(16 / 10) and c.b_acceptance == 1.0
    # Noise without a difference: the interval straddles zero.
    same = [RequestAcceptance(str(i), rng.multinomial(10, [0.5, 0.3, 0.2]).tolist(), 0, 1) for i in range(n)]
    other = [RequestAcceptance(str(i), rng.multinomial(10, [0.5, 0.3, 0.2]).tolist(), 0, 1) for i in range(n)]
    c = compare(same, other)
    assert c.gain_low < 0 < c.gain_high
    assert temperature_bucket(0) == "T=0" and temperature_bucket(0.7) == "0<T<=0.8" and temperature_bucket(1) == "T>0.8"


class Bytes:
    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", "replace")


def test_classes_and_a_class_worse_beyond_the_margin_blocks_promotion():
    ja, en, js = "こんにちは、元気です".encode(), b"hello there friend", b'{"a": 1}'
    recs = [rec(f"ja{i}", i, out=ja) for i in range(30)] + [rec(f"en{i}", 100 + i, out=en, temperature=0.7)
                                                             for i in range(30)]
    tok = Bytes()
    assert request_classes(recs[0], tok) == {"language": "ja", "kind": "text", "temperature": "T=0"}
    assert request_classes(recs[-1], tok) == {"language": "en", "kind": "text", "temperature": "0<T<=0.8"}
    assert request_classes(rec("j", 0, out=js), tok)["kind"] == "json"
    a = {r.request_id: RequestAcceptance(r.request_id, [0, 10], 20, 10) for r in recs}
    # Much better on Japanese, worse on English: refused at a margin of 5%, promoted at 15%.
    b = {r.request_id: RequestAcceptance(r.request_id, [0, 0, 10] if r.request_id.startswith("ja")
                                         else [2, 8], 0, 10) for r in recs}
    v2 = judge(recs, a, b, tok, margin=0.15)
    v1 = judge(recs, a, b, tok, margin=0.05)
    # en: (2*1 + 8*2) / 10 = 1.8 against 2.0, 0.9x: beyond 5%, within 15%.
    assert v1.classes["language"]["en"].ratio == pytest.approx(0.9)
    assert not v1.promote and any("language=en" in r for r in v1.reasons)
    assert v2.promote and v2.overall.gain_low > 0
    assert not judge(recs, a, b, tok, margin=0.05, min_class_requests=31).reasons[1:]   # en too small to gate


SHIPPED = "namazu/assets/namazu-tiny/drafter"


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """namazu-tiny's own answers to held-out chat requests (greedy and seeded T=0.7), captured as a server
    would, with a torn last record."""
    root = tmp_path_factory.mktemp("refresh")
    reqs = build_requests(40, "valid", seed=3, max_tokens=32)
    with LLM(None, executor="inline", num_speculative_tokens=0) as llm:
        tok = llm.get_tokenizer()
        ps = [tok.encode_chat(r["messages"], add_generation_prompt=True, tools=r["tools"] or None) for r in reqs]
        params = [SamplingParams(temperature=0.0 if i % 3 else 0.7, seed=i, max_tokens=32) for i in range(len(ps))]
        outs = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    w = CaptureWriter(root / "capture")
    now = time.time()
    for i, (p, sp, o) in enumerate(zip(ps, params, outs)):
        w.write(CaptureRecord(f"r{i}", p, [list(o.outputs[0].token_ids)], [o.outputs[0].finish_reason],
                              {"temperature": sp.temperature, "seed": sp.seed, "max_tokens": 32},
                              {"arrival": now - 1000 + i}))
    w.close()
    with open(next((root / "capture").glob("*.ndjson")), "ab") as f:
        f.write(b"0badc0de {\"torn")               # a torn last record: skipped
    return root


def refresh(capture, out, base, train_args, *extra):
    argv = ["--capture", str(capture / "capture"), "--base", str(base), "--out", str(out), "--heldout", "12",
            "--min-class-requests", "6", "--no-calibrate", "--train-args", train_args, *extra]
    assert main(argv) == 0
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def shuffled(capture):
    """The shipped drafter fine-tuned on the captures' output ids in random order, through the gate."""
    out = capture / "shuffled"
    return out, refresh(capture, out, SHIPPED, TRAIN_ARGS + " --shuffle-ids")


def test_the_gate_refuses_a_candidate_trained_on_shuffled_ids(capture, shuffled):
    out, report = shuffled
    state = json.loads((out / "state.json").read_text())
    assert state["info"]["data"]["torn_or_corrupt"] == 1 and state["info"]["data"]["heldout"] == 12
    held = [r.request_id for r in read_records(out / "data" / "heldout.ndjson")]
    assert held == [f"r{i}" for i in range(28, 40)]           # the newest, whole requests
    assert not report["promote"], report["reasons"]
    o = report["overall"]
    assert o["gain_high"] < 0 and o["b_acceptance"] < o["a_acceptance"]
    assert any("worse beyond the margin" in r for r in report["reasons"])
    assert set(report["classes"]["temperature"]) == {"T=0", "0<T<=0.8"}
    assert "KEEP the serving drafter" in (out / "report.md").read_text()


def test_the_gate_promotes_a_better_candidate(capture, shuffled, tmp_path):
    """The shuffled drafter serving; the candidate is the shipped drafter (the trainer's --init overridden,
    one step at a negligible rate): the command, replays and gate promote it."""
    bad = shuffled[0] / "candidate"
    report = refresh(capture, tmp_path / "fix", bad, f"--init {SHIPPED} --steps 1 --lr 1e-9 --no-bf16 --eval-k 3",
                     "--guard", str(capture / "capture"), "--replay-limit", "12")
    assert report["promote"], report["reasons"]
    assert report["overall"]["gain_low"] > 0
    assert report["classes"]["guard"]["all"]["ratio"] > 1 and any("within the margin" in r for r in report["reasons"])


def test_a_crashed_replay_resumes_without_training_again(capture, shuffled, tmp_path):
    src, first = shuffled
    out = tmp_path / "run"
    shutil.copytree(src, out)
    cand = out / "candidate" / "model.safetensors"
    mtime = cand.stat().st_mtime_ns
    state = json.loads((out / "state.json").read_text())
    state["done"] = [s for s in state["done"] if s not in ("replay-candidate", "report")]
    (out / "state.json").write_text(json.dumps(state))
    lines = (out / "replay-candidate.ndjson").read_text().splitlines()
    (out / "replay-candidate.ndjson").write_text("\n".join(lines[:5]) + "\n" + lines[5][:10])   # a torn line
    again = refresh(capture, out, SHIPPED, TRAIN_ARGS + " --shuffle-ids")
    assert cand.stat().st_mtime_ns == mtime
    assert len(read_results(out / "replay-candidate.ndjson")) == 12
    assert again["overall"] == first["overall"]
    with pytest.raises(SystemExit, match="other inputs"):
        refresh(capture, out, SHIPPED, TRAIN_ARGS, "--from-scratch")
