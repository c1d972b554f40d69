"""Calibration: amaxes from the tokens the router sent, forcing of cold experts, refusal and imputation."""
import json

import pytest
import torch
import torch.nn.functional as F
from quant_fixtures import random_windows, tiny_model, write_model_dir

from namazu.quant import calibrate as cal
from namazu.quant.calibrate import MissingScalesError, ObserverExperts, calibrate, finalize
from namazu.quant.selective import QuantPolicy

POLICY = QuantPolicy.preset("experts")


@torch.no_grad()
def test_observer_keeps_the_output_and_records_routed_amaxes():
    model = tiny_model()
    moe = model.model.layers[1].mlp
    inner = moe.experts
    obs = ObserverExperts(inner, min_tokens=1000, force=False)
    x = torch.randn(10, model.config.hidden_size)
    ids = torch.tensor([[0, 1]] * 6 + [[2, 1]] * 4)
    w = torch.rand(10, 2)
    assert torch.equal(obs(x, ids, w), inner(x, ids, w))
    assert obs.cov.tokens.tolist()[:4] == [6, 10, 4, 0]
    i = model.config.moe_intermediate_size
    rows = x[6:]
    h = F.linear(rows, inner.w13[2])
    want_a2 = (F.silu(h[:, :i]) * h[:, i:]).abs().max()
    assert obs.cov.a13[2] == rows.abs().max() and torch.isclose(obs.cov.a2[2], want_a2)
    assert obs.cov.a13[3] == 0 and obs.cov.forced_tokens.sum() == 0


@torch.no_grad()
def test_forcing_covers_cold_experts_and_the_report_names_them():
    model = tiny_model(skew=2.0)          # routing strongly prefers low expert ids
    windows = random_windows(2, 16)
    cov, lin, total = calibrate(model, windows, POLICY, min_tokens=8, force=True, progress=False)
    assert total == 32 and set(cov) == {1, 2}
    for c in cov.values():
        assert c.tokens.sum() == 32 * model.config.num_experts_per_tok
        cold = c.tokens < 8
        assert cold.any()
        assert torch.all(c.forced_tokens[cold] > 0) and torch.all(c.forced_a2[cold] > 0)
    stats, report = finalize(cov, lin, total, 8, True, impute_missing=False)
    forced = {(s.layer, s.expert) for s in report.by_source("forced")}
    assert forced == {(layer, e) for layer, c in cov.items() for e in (c.tokens < 8).nonzero().flatten().tolist()}
    for layer in (1, 2):
        assert torch.all(stats.experts_a13[layer] > 0) and torch.all(stats.experts_a2[layer] > 0)
    assert "scales from forced tokens" in report.summary()
    # The model is unwrapped again and computes exactly as before.
    assert not any(isinstance(m, ObserverExperts) for m in model.modules())


@torch.no_grad()
def test_without_forcing_cold_experts_are_refused_or_imputed_and_listed():
    model = tiny_model(skew=2.0)
    cov, lin, total = calibrate(model, random_windows(1, 8), POLICY, min_tokens=9, force=False, progress=False)
    zero = [(layer, e) for layer, c in cov.items() for e in (c.tokens == 0).nonzero().flatten().tolist()]
    assert zero, "the skewed router should leave some experts without tokens"
    with pytest.raises(MissingScalesError, match=f"layer {zero[0][0]} expert {zero[0][1]}"):
        finalize(cov, lin, total, 9, False, impute_missing=False)
    stats, report = finalize(cov, lin, total, 9, False, impute_missing=True)
    assert {(s.layer, s.expert) for s in report.by_source("imputed")} == set(zero)
    layer, e = zero[0]
    have = cov[layer].tokens > 0
    assert stats.experts_a13[layer][e] == cov[layer].a13[have].max()
    assert stats.experts_a2[layer][e] == cov[layer].a2[have].max()
    assert report.by_source("low")            # some saw a few tokens: flagged, not silently trusted


def test_cli_refuses_then_writes_with_imputation(tmp_path, capsys):
    src = tmp_path / "src"
    write_model_dir(str(src), skew=2.0)
    data = tmp_path / "calib.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hello there"}]}) + "\n")
    out = tmp_path / "out"
    args = ["--model", str(src), "--data", str(data), "--out", str(out), "--min-tokens", "8", "--no-force"]
    assert cal.main(args) == 2
    assert "saw no calibration token" in capsys.readouterr().err and not out.exists()
    assert cal.main(args + ["--impute-missing"]) == 0
    report = json.loads((out / "calibration.json").read_text())
    assert report["summary"]["imputed"] and not report["summary"]["missing"]
    assert (out / "hf_quant_config.json").exists() and (out / "tokenizer.json").exists()


def test_cli_converts_a_block_fp8_checkpoint(tmp_path):
    """DeepSeek-V3 ships block-FP8: the calibrator starts from it (dequantized at load) just as from BF16."""
    from safetensors.torch import load_file, save_file

    from namazu.quant.modelopt_checkpoint import load_quantized
    from namazu.quant.nvfp4 import dequantize_weight

    src, fp8, out = tmp_path / "bf16", tmp_path / "fp8", tmp_path / "out"
    write_model_dir(str(src))
    fp8.mkdir()
    tensors, deq = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith("proj.weight") and t.dim() == 2:
            scale = t.float().abs().unflatten(0, (-1, 16)).unflatten(-1, (-1, 16)).amax((1, 3)) / 448
            full = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
            tensors[name] = (t.float() / full).to(torch.float8_e4m3fn)
            tensors[name[:-len("weight")] + "weight_scale_inv"] = scale
            deq[name] = tensors[name].float() * full
        else:
            tensors[name] = t
    save_file(tensors, fp8 / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (fp8 / f).write_bytes((src / f).read_bytes())
    data = tmp_path / "calib.txt"
    data.write_text("Calibration text from a block-FP8 source checkpoint. " * 20)
    assert cal.main(["--model", str(fp8), "--data", str(data), "--out", str(out), "--seq-len", "64"]) == 0
    model = load_quantized(out, progress=False)
    exp = model.model.layers[1].mlp.experts
    i = exp.intermediate_size
    w = dequantize_weight(exp.w13_packed[3, :i], exp.w13_scale[3, :i], exp.w13_gs[3], torch.float32)
    ref = deq["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert ((w - ref).norm() / ref.norm()).item() < 0.15
    assert "weight_scale_inv" not in json.dumps(list(load_file(out / "model.safetensors")))
