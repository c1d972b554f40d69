"""Quality gate: metrics, bootstrap intervals and the exit code."""
import torch
from quant_fixtures import random_windows, tiny_model, write_model_dir

from namazu.eval import compare as cmp
from namazu.eval.metrics import WindowSums, compare, score, window_stats


def test_identical_models_agree_perfectly():
    m = tiny_model()
    s = score(m, m, random_windows(3, 12))
    r = compare(s, "ja", n_boot=50)
    assert r.mean_kl.value == 0 and r.top1_agreement.value == 1 and r.ppl_change_pct.value == 0
    assert r.tokens == 3 * 11


def test_window_stats_against_hand_computation():
    torch.manual_seed(0)
    lr, lc = torch.randn(5, 7), torch.randn(5, 7)
    ids = torch.tensor([1, 2, 3, 4, 5])
    nll_r, nll_c, kl, agree, n = window_stats(lr, lc, ids)
    pr, pc = lr[:-1].softmax(-1), lc[:-1].softmax(-1)
    assert abs(kl - (pr * (pr.log() - pc.log())).sum().item()) < 1e-4
    assert abs(nll_r - -pr.log()[torch.arange(4), ids[1:]].sum().item()) < 1e-4
    assert agree == (pr.argmax(-1) == pc.argmax(-1)).sum().item() and n == 4


def test_bootstrap_interval_contains_the_point_and_narrows_with_data():
    g = torch.Generator().manual_seed(0)

    def sums(w):
        n = torch.full((w,), 100.0, dtype=torch.float64)
        nll = 300 + 10 * torch.randn(w, generator=g, dtype=torch.float64)
        return WindowSums(nll, nll * 1.01, torch.rand(w, generator=g, dtype=torch.float64), 90 + 0 * n, n)

    small, big = compare(sums(10), "x", 500), compare(sums(400), "x", 500)
    for r in (small, big):
        assert r.ppl_change_pct.low <= r.ppl_change_pct.value <= r.ppl_change_pct.high
        assert abs(r.top1_agreement.value - 0.9) < 1e-9
    assert (big.mean_kl.high - big.mean_kl.low) < (small.mean_kl.high - small.mean_kl.low)


def test_cli_gate_exit_codes(tmp_path, capsys):
    ref, cand = tmp_path / "ref", tmp_path / "cand"
    write_model_dir(str(ref), seed=0)
    write_model_dir(str(cand), seed=1)          # a different model: the gate must fail
    text = tmp_path / "ja" / "test.txt"
    text.parent.mkdir()
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    base = ["--ref", str(ref), "--data", str(text), "--seq-len", "64", "--bootstrap", "50"]
    assert cmp.main(base + ["--cand", str(ref)]) == 0
    assert "| ja |" in capsys.readouterr().out
    assert cmp.main(base + ["--cand", str(cand), "--min-top1", "0.99", "--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert "FAIL ja: top-1 agreement" in out and "gate: FAIL" in out
