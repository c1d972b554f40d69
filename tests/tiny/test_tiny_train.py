"""Smoke run of the namazu-tiny trainer on a toy config: the same code path `make tiny-model` runs."""
import json
import math

import pytest
import torch
from tiny_fixtures import small_moe_model, write_mini_corpus

from namazu.tiny import ASSET_DIR
from namazu.tiny.data import ChatDataConfig
from namazu.tiny.evaluate import evaluate, write_model_card
from namazu.tiny.train import (
    TrainConfig,
    check_design,
    induction_rows,
    induction_warmup,
    lr_at,
    make_optimizer,
    prepare_for_training,
    train,
)

CONFIG = ASSET_DIR.parent.parent / "tiny" / "configs" / "smoke.json"


def test_smoke_training_lowers_loss_and_writes_a_loadable_model(tmp_path):
    from namazu.models.loader import load_model

    corpus = write_mini_corpus(tmp_path / "corpus")
    cfg = TrainConfig.from_json(CONFIG)
    cfg.threads = 1
    res = train(cfg, tmp_path / "model", corpus, tokenizer_dir=ASSET_DIR, progress=False)
    loss = res["history"]["loss"]
    assert len(loss) == cfg.steps
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.5
    out = tmp_path / "model"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "loss_curve.png",
              "train_log.json"):
        assert (out / f).is_file(), f
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["scoring_func"] == "sigmoid" and hf_cfg["topk_method"] == "noaux_tc"
    model = load_model(out, dtype=torch.float32, progress=False)
    biases = torch.stack([m.gate.e_score_correction_bias for m in model.moe_layers()])
    assert biases.abs().sum() > 0  # the balancing loop ran and was saved

    # The evaluation that writes the model card runs on the same output.
    results = evaluate(out, corpus, tool_prompts=2, seq_len=64, stride=48)
    write_model_card(out, results)
    assert results["ja"]["tokens"] > 0 and results["ja"]["model_bits_per_byte"] > 0
    assert results["tools"]["prompts"] == 2
    assert sum(sum(r) for r in results["expert_load"]["shares"]) == pytest.approx(
        cfg.model["num_hidden_layers"] - 1, abs=1e-3)  # shares are rounded to 5 digits
    assert "## Expert load" in (out / "MODEL_CARD.md").read_text(encoding="utf-8")

    # A second stage continues from the first (tool tuning over procedural and fresh schemas) and keeps its log.
    stage2 = TrainConfig.from_json(CONFIG)
    stage2.model, stage2.steps, stage2.threads = {}, 4, 1
    stage2.chat = ChatDataConfig(seed=9, num_qa=20, num_tool=60, procedural_tools=30, synthetic_tool_share=0.5,
                                 num_copy=40, assistant_loss_only=True)
    res2 = train(stage2, tmp_path / "stage2", corpus, tokenizer_dir=ASSET_DIR, progress=False, init_dir=out)
    assert res2["previous_stages"][0]["steps_done"] == cfg.steps and res2["steps_done"] == 4
    with pytest.raises(ValueError, match="leave the config's 'model' empty"):
        train(cfg, tmp_path / "bad", corpus, tokenizer_dir=ASSET_DIR, progress=False, init_dir=out)


def test_induction_rows_repeat_a_span_at_varying_distances():
    ids, mask = induction_rows(64, 32, 16, 500, torch.Generator().manual_seed(0))
    assert ids.shape == mask.shape == (64, 64) and int(ids.min()) >= 16 and int(ids.max()) < 500
    periods, lengths = set(), set()
    for row, m in zip(ids, mask):
        pos = m.nonzero().flatten()
        assert len(pos) and bool((pos[1:] - pos[:-1] == 1).all())  # one contiguous recurrence
        n = len(pos) + 1
        for d in range(n, 64):  # the distance back to the first showing
            if bool((row[pos] == row[pos - d]).all()) and bool(row[pos[0] - 1] == row[pos[0] - 1 - d]):
                periods.add(d)
                break
        else:
            raise AssertionError("masked tokens are not a copy of an earlier span")
        lengths.add(n)
    assert len(periods) > 10 and len(lengths) > 10  # no single distance or length to learn instead of copying


def test_induction_warmup_trains_on_those_rows_with_a_ramp():
    torch.manual_seed(0)
    model = prepare_for_training(small_moe_model())
    before = [p.detach().clone() for p in model.parameters()]
    cfg = TrainConfig(model={}, batch_size=4, lr=3e-3, induction_steps=30, induction_len=16)
    opt = make_optimizer(model, cfg)
    curve = induction_warmup(model, opt, cfg, first_id=10, progress=False)
    assert [s for s, _ in curve] == [1, 26, 30] and all(math.isfinite(v) for _, v in curve)
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3 * opt.param_groups[0]["lr_scale"])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="induction_vocab"):
        induction_warmup(model, opt, TrainConfig(model={}, induction_steps=1, induction_vocab=5), 10, False)


def test_lr_schedule_warms_up_then_decays_to_floor():
    cfg = TrainConfig(model={}, steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) == pytest.approx(1e-4, rel=0.02)
    assert lr_at(50, cfg, progress=1.0) == pytest.approx(1e-4)  # a time budget can end the schedule early


def test_design_check_refuses_dims_off_the_64_grid():
    from namazu.config import ModelConfig

    cfg = ModelConfig(vocab_size=256, hidden_size=96, intermediate_size=128, moe_intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, q_lora_rank=64, kv_lora_rank=64,
                      qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8)
    with pytest.raises(ValueError, match="hidden_size"):
        check_design(cfg)


def test_config_rejects_unknown_keys(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"model": {}, "stesp": 3}))
    with pytest.raises(ValueError, match="stesp"):
        TrainConfig.from_json(p)


def test_routing_calibration_raises_the_coldest_expert():
    from namazu.tiny.balance import calibrate_routing
    from namazu.tiny.train import prepare_for_training

    model = small_moe_model()
    gate = model.moe_layers()[0].gate
    gate.e_score_correction_bias.copy_(torch.tensor([0.3, 0.3, 0.0, 0.0, 0.0, 0.0, -0.3, -0.3]))  # two cold experts
    weights = {k: v.clone() for k, v in model.state_dict().items() if "correction_bias" not in k}
    streams = {"ja": torch.randint(0, 64, (5000,), dtype=torch.int32)}
    res = calibrate_routing(prepare_for_training(model), streams, {"ja": 1.0}, steps=60, rate=0.02,
                            batch_size=4, seq_len=64, seed=0)
    assert res["first"]["min_share"] < 0.02 < res["last"]["min_share"]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
