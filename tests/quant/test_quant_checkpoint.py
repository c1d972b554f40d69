"""ModelOpt NVFP4 checkpoints: names, dtypes and shapes by the rules public engines load by; round trips
through the model loader (experts-only) and load_quantized (any policy)."""
import json
import os

import pytest
import torch
from quant_fixtures import random_windows, tiny_model
from safetensors import safe_open

from namazu.models.checkpoint import CheckpointError
from namazu.models.loader import load_model
from namazu.quant.calibrate import calibrate, finalize
from namazu.quant.modelopt_checkpoint import load_quantized, save_quantized
from namazu.quant.nvfp4_experts import NvFP4Experts, set_mode
from namazu.quant.nvfp4_linear import NvFP4Linear
from namazu.quant.quantize import experts_resident_bytes, quantize_model
from namazu.quant.selective import QuantPolicy


def _quantized(policy_name="experts", dtype=torch.bfloat16, **kw):
    model = tiny_model(dtype=dtype, **kw)
    policy = QuantPolicy.preset(policy_name)
    cov, lin, total = calibrate(model, random_windows(4, 32), policy, min_tokens=4, progress=False)
    stats, _ = finalize(cov, lin, total, 4, True, False)
    quantize_model(model, policy, stats, mode="w4a4")
    return model, policy


def _tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_experts_only_checkpoint_follows_the_modelopt_layout(tmp_path):
    model, policy = _quantized()
    save_quantized(model, tmp_path, policy)
    cfg = model.config
    with open(tmp_path / "hf_quant_config.json") as f:
        hq = json.load(f)
    assert hq["producer"]["name"] == "modelopt"
    q = hq["quantization"]
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16 and q["kv_cache_quant_algo"] is None
    assert "lm_head" in q["exclude_modules"] and "model.layers.*.self_attn*" in q["exclude_modules"]
    with open(tmp_path / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4" and qc["group_size"] == 16
    assert qc["exclude_modules"] == q["exclude_modules"]

    t = _tensors(tmp_path)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        for e in range(cfg.n_routed_experts):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            for proj, (out_f, in_f) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                assert t[p + proj + ".weight"].dtype == torch.uint8
                assert t[p + proj + ".weight"].shape == (out_f, in_f // 2)
                assert t[p + proj + ".weight_scale"].dtype == torch.float8_e4m3fn
                assert t[p + proj + ".weight_scale"].shape == (out_f, in_f // 16)
                for s in ("weight_scale_2", "input_scale"):
                    assert t[p + proj + "." + s].dtype == torch.float32 and t[p + proj + "." + s].numel() == 1
                    assert t[p + proj + "." + s].item() > 0
            for s in ("weight_scale_2", "input_scale"):   # gate and up share them
                assert torch.equal(t[p + "gate_proj." + s], t[p + "up_proj." + s])
    # Everything outside the routed experts is high precision, under its usual name.
    assert t["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert t["lm_head.weight"].dtype == torch.bfloat16
    assert not any(k.endswith("weight_scale") and ".experts." not in k for k in t)


@torch.no_grad()
@pytest.mark.parametrize("tied", [False, True])
def test_model_loader_serves_the_experts_only_checkpoint(tmp_path, tied):
    model, policy = _quantized(tie_word_embeddings=tied)
    save_quantized(model, tmp_path, policy)
    assert ("lm_head.weight" in _tensors(tmp_path)) != tied  # a tied head is the embedding, stored once
    # Served with the runtime the in-memory model runs on, the round trip must be exact.
    loaded = load_model(tmp_path, progress=False, runtime=model.model.layers[1].mlp.experts.runtime)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    assert isinstance(loaded.model.layers[1].mlp.experts, NvFP4Experts)
    ids = random_windows(1, 24, seed=5)[0].unsqueeze(0)
    for mode in ("w4a4", "w4a16"):
        set_mode(model, mode)
        set_mode(loaded, mode)
        assert torch.equal(loaded.compute_logits(loaded(ids)[0]), model.compute_logits(model(ids)[0]))
    nbytes, nweights = experts_resident_bytes(loaded)
    assert 4.5 <= nbytes * 8 / nweights < 4.6


@torch.no_grad()
def test_all_linear_checkpoint_round_trips_through_load_quantized(tmp_path):
    model, policy = _quantized("all-linear")
    assert isinstance(model.model.layers[1].self_attn.q_a_proj, NvFP4Linear)
    save_quantized(model, tmp_path, policy)
    t = _tensors(tmp_path)
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.uint8
    assert t["model.layers.1.self_attn.kv_b_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert t["lm_head.weight"].dtype == torch.bfloat16
    loaded = load_quantized(tmp_path, mode="w4a4", progress=False)
    ids = random_windows(1, 24, seed=6)[0].unsqueeze(0)
    assert torch.equal(loaded.compute_logits(loaded(ids)[0]), model.compute_logits(model(ids)[0]))
    with pytest.raises(CheckpointError):
        load_model(tmp_path, progress=False)     # the plain loader knows NVFP4 experts only


def test_saving_refuses_experts_without_scales(tmp_path):
    model = tiny_model()
    policy = QuantPolicy.preset("experts")
    quantize_model(model, policy, None, mode="w4a16")       # weight-only: no input scales
    with pytest.raises(ValueError, match="no calibrated input_scale"):
        save_quantized(model, tmp_path, policy)
