"""`python -m namazu.spec.refresh`: capture filtering and the newest-requests hold-out, the paired bootstrap
gate on hand-made tallies, and the command end to end on the tiny random target: a candidate trained on the
target's own outputs is promoted over an untrained base, one trained on shuffled ids is refused, and a run
that crashed in its replay resumes without training again."""
import json
import time

import numpy as np
import pytest
from dflash_fixtures import random_drafter
from engine_helpers import prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.spec.capture import CaptureRecord, CaptureWriter, read_records
from namazu.spec.refresh import main, select, split_newest
from namazu.spec.training.gate import compare, judge, request_classes, temperature_bucket
from namazu.spec.training.replay import RequestAcceptance, read_results

TRAIN_ARGS = ("--steps 60 --time-budget 2 --batch 4 --anchors 16 --lr 3e-3 --eval-k 3 --no-bf16 "
              "--hidden-cache memory")


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


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """The tiny random target's own answers (greedy and seeded T=0.7), captured as a server would."""
    root = tmp_path_factory.mktemp("refresh")
    ps = prompts(80, lo=4, hi=16, seed=31)
    params = [SamplingParams(temperature=0.0 if i % 4 else 0.7, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(ps))]
    with LLM(tiny_checkpoint(), executor="inline", num_speculative_tokens=0) as llm:
        outs = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    w = CaptureWriter(root / "capture")
    now = time.time()
    for i, (p, sp, o) in enumerate(zip(ps, params, outs)):
        w.write(CaptureRecord(f"r{i}", p, [list(o.outputs[0].token_ids)], ["length"],
                              {"temperature": sp.temperature, "seed": sp.seed, "max_tokens": 24},
                              {"arrival": now - 1000 + i}))
    w.close()
    with open(next((root / "capture").glob("*.ndjson")), "ab") as f:
        f.write(b"0badc0de {\"torn")               # a torn last record: skipped
    return root


def refresh(capture, out, *extra):
    argv = ["--capture", str(capture / "capture"), "--base", random_drafter(tiny_checkpoint()), "--out", str(out),
            "--target", tiny_checkpoint(), "--heldout", "24", "--min-class-requests", "10",
            "--min-confidence", "0", "--no-calibrate", "--train-args", TRAIN_ARGS, *extra]
    assert main(argv) == 0
    return json.loads((out / "report.json").read_text())


def test_refresh_promotes_a_trained_candidate_and_refuses_one_trained_on_shuffled_ids(capture, tmp_path):
    good = refresh(capture, tmp_path / "good")
    state = json.loads((tmp_path / "good" / "state.json").read_text())
    assert state["info"]["data"]["torn_or_corrupt"] == 1 and state["info"]["data"]["heldout"] == 24
    held = [r.request_id for r in read_records(tmp_path / "good" / "data" / "heldout.ndjson")]
    assert held == [f"r{i}" for i in range(56, 80)]           # the newest, whole requests
    assert good["promote"], good["reasons"]
    assert good["overall"]["gain_low"] > 0 and set(good["classes"]["temperature"]) == {"T=0", "0<T<=0.8"}
    bad = refresh(capture, tmp_path / "shuffled", "--train-args", TRAIN_ARGS + " --shuffle-ids")
    assert not bad["promote"], bad["reasons"]
    assert bad["overall"]["b_acceptance"] < good["overall"]["b_acceptance"]


def test_a_crashed_replay_resumes_without_training_again(capture, tmp_path):
    out = tmp_path / "run"
    first = refresh(capture, out, "--replay-limit", "10")
    cand = out / "candidate" / "model.safetensors"
    mtime = cand.stat().st_mtime_ns
    state = json.loads((out / "state.json").read_text())
    state["done"] = [s for s in state["done"] if s not in ("replay-candidate", "report")]
    (out / "state.json").write_text(json.dumps(state))
    lines = (out / "replay-candidate.ndjson").read_text().splitlines()
    (out / "replay-candidate.ndjson").write_text("\n".join(lines[:4]) + "\n" + lines[4][:10])   # torn
    again = refresh(capture, out, "--replay-limit", "10")
    assert cand.stat().st_mtime_ns == mtime
    assert len(read_results(out / "replay-candidate.ndjson")) == 10
    assert again["overall"] == first["overall"]
    with pytest.raises(SystemExit, match="other inputs"):
        refresh(capture, out, "--from-scratch")
