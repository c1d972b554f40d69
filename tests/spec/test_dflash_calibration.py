"""The drafter's calibrated sampling temperature (`q_temperature_scale`): the walk draws from exactly the q
it reports, greedy rows ignore it, bad values are refused, and the fit finds a known scale."""
import json
import shutil

import numpy as np
import pytest
import torch
from dflash_fixtures import drafter_config, random_drafter
from engine_helpers import prompts, tiny_checkpoint

from namazu.config import ModelConfig
from namazu.spec.capture import CaptureRecord, CaptureWriter
from namazu.spec.dflash import DFlashDrafter
from namazu.spec.dflash_config import DFlashConfig, DrafterCheckpointError, check_drafter_checkpoint
from namazu.spec.training import calibrate

SCALES = (0.5, 2.0, 1.5, 0.8)      # the fixture's block of 5 drafts 4 tokens


def load(path: str) -> DFlashDrafter:
    t = ModelConfig.from_pretrained(tiny_checkpoint())
    return DFlashDrafter.load(path, t.vocab_size, t.hidden_size, t.num_hidden_layers)


@torch.no_grad()
def test_walk_draws_from_the_calibrated_q_and_greedy_rows_ignore_it():
    """Each sampled position's q is softmax(s / (T * c_j)) over the candidates, s recomputed by the
    selector from the pick before it (not the walk's pair table); greedy rows draft as uncalibrated."""
    plain = load(random_drafter(tiny_checkpoint()))
    tuned = load(random_drafter(tiny_checkpoint(), q_temperature_scale=SCALES))
    assert tuned.cfg.q_temperature_scale == list(SCALES)
    k, m = len(SCALES), 16
    v = plain.cfg.vocab_size
    torch.manual_seed(3)
    h = torch.randn(m, k, plain.cfg.hidden_size)
    anchor = torch.randint(0, v, (m,))
    logits = torch.randn(m, k, v) * 3
    u = torch.rand(m, k, dtype=torch.float64)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * (m // 4))
    walk = tuned.walk(anchor, h, logits, k, temperature, u)
    sampled = temperature > 0
    cand_logits, cand = logits.float().topk(tuned.cfg.selector_k, dim=-1)
    prev = torch.cat([anchor.unsqueeze(1), walk.ids[:, :-1]], 1)
    s = tuned.selector.scores(prev, cand, cand_logits, h)
    for j, c in enumerate(SCALES):
        want = torch.zeros(m, v).scatter_(1, cand[:, j], (s[:, j] / (temperature.clamp_min(1e-6) * c)
                                                           .unsqueeze(-1)).softmax(-1))
        torch.testing.assert_close(walk.q[sampled, j], want[sampled])
    q_pick = walk.q.gather(-1, walk.ids.unsqueeze(-1)).squeeze(-1)
    assert bool((q_pick[sampled] > 0).all())                            # every draw lies in q's support
    greedy_plain = plain.walk(anchor, h, logits, k, temperature, u)
    assert torch.equal(walk.ids[~sampled], greedy_plain.ids[~sampled])
    torch.testing.assert_close(walk.confidence[~sampled], greedy_plain.confidence[~sampled])
    assert not torch.allclose(walk.q[sampled], greedy_plain.q[sampled])  # the scales did change q


def test_a_config_without_the_field_samples_as_before(tmp_path):
    """Old checkpoints (no field) load with no scale, and the walk equals one with scale 1 everywhere."""
    src = random_drafter(tiny_checkpoint())
    d = json.loads(open(f"{src}/config.json").read())
    d.pop("q_temperature_scale", None)
    assert DFlashConfig.from_dict(d).q_temperature_scale == []
    ones = load(random_drafter(tiny_checkpoint(), q_temperature_scale=(1.0,) * 4))
    old = load(src)
    torch.manual_seed(4)
    m, k = 6, 4
    args = (torch.randint(0, old.cfg.vocab_size, (m,)), torch.randn(m, k, old.cfg.hidden_size),
            torch.randn(m, k, old.cfg.vocab_size), k, torch.full((m,), 0.7), torch.rand(m, k, dtype=torch.float64))
    with torch.no_grad():
        a, b = old.walk(*args), ones.walk(*args)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.q, b.q)


@pytest.mark.parametrize("value", [[1.0, 1.0, 0.0, 1.0], [1.0, -2.0, 1.0, 1.0], [1.0, float("nan"), 1.0, 1.0],
                                   [float("inf")] * 4, [1.0, 1.0, 1.0], [1.0] * 5, "1.5", 1.5, [True] * 4,
                                   [1.0, "2", 1.0, 1.0]])
def test_a_bad_scale_is_refused_naming_the_field(tmp_path, value):
    with pytest.raises(DrafterCheckpointError, match="q_temperature_scale"):
        drafter_config(tiny_checkpoint(), q_temperature_scale=value)
    shutil.copytree(random_drafter(tiny_checkpoint()), tmp_path / "d")
    file = tmp_path / "d" / "config.json"
    d = json.loads(file.read_text())
    d["q_temperature_scale"] = value
    file.write_text(json.dumps(d))
    t = ModelConfig.from_pretrained(tiny_checkpoint())
    with pytest.raises(DrafterCheckpointError, match="q_temperature_scale"):
        check_drafter_checkpoint(tmp_path / "d", t.vocab_size, t.hidden_size, t.num_hidden_layers)


def test_fit_finds_the_scale_that_makes_q_the_targets_p():
    """Synthetic positions whose target p is exactly softmax(s / (T * c_j)) over the candidates, captured
    tokens drawn from p: the fit returns c_j (each on the grid), where every overlap and every path weight
    is 1 and the engine's expected acceptance length is 1 + the positions inside the output."""
    rng = np.random.default_rng(0)
    a, k, kc = 400, 4, 6
    grid = calibrate.DEFAULT_GRID
    true = [grid[8], grid[30], grid[20], grid[36]]
    scores = rng.normal(size=(a, k, kc)) * 2
    valid = np.ones((a, k), bool)
    valid[-50:, 2:] = False                                     # blocks cut by the end of an output
    cap_t = np.where(np.arange(a) % 2, 1.0, 0.7)                # half the requests captured at each temperature
    pos = calibrate.Positions(scores, scores, valid, cap_temperature=cap_t)
    for t in (0.7, 1.0):
        pos.p[t] = calibrate.softmax(scores / (t * np.array(true)[None, :, None]))
        pos.p_top[t] = pos.p[t].max(-1)
    p_own = np.where(cap_t[:, None, None] == 0.7, pos.p[0.7], pos.p[1.0])     # each request's own p
    pos.cap_index = (p_own.cumsum(-1) < rng.random((a, k, 1))).sum(-1)
    for t in (0.7, 1.0):
        pos.p_cap[t] = np.take_along_axis(pos.p[t], pos.cap_index[..., None], -1)[..., 0]
    scales = calibrate.fit_scales(pos, [0.7, 1.0], kc)
    assert scales == pytest.approx(true)
    s = calibrate.summary(pos, 0.7, scales, kc)
    assert s["overlap_after"] == pytest.approx([1.0] * k, abs=1e-4)
    assert s["engine_length_after"] == pytest.approx(1 + (175 * k + 25 * 2) / 200, abs=1e-3)
    assert s["engine_length_before"] < s["engine_length_after"] - 0.5
    # A captured token outside the candidates is one no accepted draft can be: its path weight is 0.
    pos.cap_index[:, 0] = -1
    alpha, beta, _ = calibrate.chain_factors(pos, 0.7, np.asarray(true), kc)
    assert (beta[:, 0] == 0).all() and (alpha[:, 0] > 0.99).all()
    assert calibrate.engine_length(alpha, beta, valid[cap_t == 0.7]) == pytest.approx(2.0)


def test_calibrate_command_writes_the_field_it_fitted(tmp_path, capsys):
    target = tiny_checkpoint()
    drafter = tmp_path / "drafter"
    shutil.copytree(random_drafter(target), drafter)
    w = CaptureWriter(tmp_path / "capture")
    for i, p in enumerate(prompts(6, lo=4, hi=10, seed=5)):
        out = prompts(1, lo=12, hi=20, seed=100 + i)[0]
        temp = (0.7, 1.0)[i % 2]
        w.write(CaptureRecord(f"r{i}", p, [out], ["stop"], {"temperature": temp, "top_p": 0.9, "seed": i}))
    w.close()
    before = (drafter / "config.json").read_text()
    args = ["--drafter", str(drafter), "--data", str(tmp_path / "capture"), "--target", target]
    assert calibrate.main(args + ["--dry-run"]) == 0
    assert (drafter / "config.json").read_text() == before
    capsys.readouterr()
    assert calibrate.main(args) == 0
    printed = capsys.readouterr().out
    cfg = load(str(drafter)).cfg
    assert len(cfg.q_temperature_scale) == cfg.num_draft_tokens
    assert f"q_temperature_scale = {[round(c, 3) for c in cfg.q_temperature_scale]}" in printed
    assert cfg.q_temperature_scale != [1.0] * cfg.num_draft_tokens   # a random drafter is no calibrated one
    rows = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    assert [r["temperature"] for r in rows] == [0.7, 1.0]
    # The fit maximises the mean over the temperatures (from scale 1, so it cannot lose there).
    assert sum(r["engine_length_after"] for r in rows) >= sum(r["engine_length_before"] for r in rows) - 1e-6
