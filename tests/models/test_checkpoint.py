"""Loader and writer: block-FP8 dequantization, sharding, transformers round trip, clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from fp8_fixtures import projections, write_fp8_checkpoint
from safetensors.torch import load_file, save_file

from namazu.config import ConfigError, ModelConfig
from namazu.models.checkpoint import CheckpointError, save_checkpoint
from namazu.models.deepseek_v3 import DeepseekV3ForCausalLM
from namazu.models.loader import load_model

from hf_oracle import make_hf_checkpoint

BLOCK = (16, 16)


def _logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids)[0])


def test_block_fp8_checkpoint_gives_dequantized_logits(tmp_path):
    from transformers import DeepseekV3ForCausalLM as HF

    src, fp8, deq = tmp_path / "bf16", tmp_path / "fp8", tmp_path / "dequantized"
    make_hf_checkpoint(src, seed=11, hidden_size=80, q_lora_rank=40)
    tensors = write_fp8_checkpoint(src, fp8, BLOCK, projections)
    out = load_file(fp8 / "model.safetensors")
    deq.mkdir()
    save_file(tensors, deq / "model.safetensors")
    (deq / "config.json").write_text((src / "config.json").read_text())
    hf = HF.from_pretrained(deq).float().eval()
    model = load_model(fp8, dtype="float32", progress=False)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-4, atol=1e-4)
    assert any(v.dtype == torch.float8_e4m3fn and v.shape[0] % 16 for v in out.values()), "want partial edge blocks"


def test_writer_round_trips_through_transformers(tmp_path):
    from transformers import DeepseekV3ForCausalLM as HF

    make_hf_checkpoint(tmp_path / "a", seed=12, n_routed_experts=16, n_group=4, topk_group=2,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 32, "mscale": 1.0,
                                        "mscale_all_dim": 1.0})
    model = load_model(tmp_path / "a", dtype="float32", progress=False)
    save_checkpoint(model, tmp_path / "b", max_shard_bytes=200_000)
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["scoring_func"] == "sigmoid" and cfg["topk_method"] == "noaux_tc"
    assert (tmp_path / "b" / "model.safetensors.index.json").exists()
    hf = HF.from_pretrained(tmp_path / "b").float().eval()
    again = load_model(tmp_path / "b", dtype="float32", progress=False)
    ids = torch.randint(0, 97, (1, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_logits(again, ids), ref, rtol=1e-4, atol=1e-4)


def test_fused_expert_layout_loads(tmp_path):
    hf = make_hf_checkpoint(tmp_path / "a", seed=13)
    model = load_model(tmp_path / "a", dtype="float32", progress=False)
    t = load_file(tmp_path / "a" / "model.safetensors")
    fused = {k: v for k, v in t.items() if ".experts." not in k}
    for layer in (1, 2):
        exp = hf.model.layers[layer].mlp.experts
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = exp.gate_up_proj.detach()
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = exp.down_proj.detach()
    (tmp_path / "b").mkdir()
    save_file(fused, tmp_path / "b" / "model.safetensors")
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    ids = torch.randint(0, 97, (1, 9))
    torch.testing.assert_close(_logits(load_model(tmp_path / "b", dtype="float32", progress=False), ids),
                               _logits(model, ids))


@pytest.fixture()
def ckpt(tmp_path):
    make_hf_checkpoint(tmp_path, seed=14)
    return tmp_path


def _rewrite(path, fn):
    t = load_file(path / "model.safetensors")
    fn(t)
    save_file(t, path / "model.safetensors")


def test_missing_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(ckpt, progress=False)


def test_unexpected_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.self_attn\.extra\.weight"):
        load_model(ckpt, progress=False)


def test_misshaped_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight: shape \(65,\)"):
        load_model(ckpt, progress=False)
    _rewrite(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.ones(64)))
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.2.mlp.experts.0.down_proj.weight", torch.ones(64, 31)))
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight.*\(64, 31\)"):
        load_model(ckpt, progress=False)


def test_unsupported_dtype_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight: unsupported dtype torch\.int32"):
        load_model(ckpt, progress=False)


def test_mtp_layers_are_skipped(ckpt):
    """A DeepSeek-V3 checkpoint carries its multi-token-prediction module as one more decoder layer (index
    num_hidden_layers) with its own attention, experts, norms and projections: it is ignored whole, and
    nothing of it reaches the served layers."""
    n = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    plain = load_model(ckpt, dtype="float32", progress=False)

    def add_mtp_layer(t):
        last = f"model.layers.{n - 1}."
        for name in [k for k in t if k.startswith(last)]:
            t[f"model.layers.{n}." + name[len(last):]] = t[name] * 3 + 1
        hidden = t["model.norm.weight"].shape[0]
        for extra, shape in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                             ("eh_proj.weight", (hidden, 2 * hidden)), ("shared_head.norm.weight", (hidden,))):
            t[f"model.layers.{n}.{extra}"] = torch.full(shape, 7.0)
        t[f"model.layers.{n}.embed_tokens.weight"] = t["model.embed_tokens.weight"] * -1

    _rewrite(ckpt, add_mtp_layer)
    assert sum(k.startswith(f"model.layers.{n}.self_attn.") for k in load_file(ckpt / "model.safetensors")) > 0
    served = load_model(ckpt, dtype="float32", progress=False)
    assert len(served.model.layers) == n
    want, got = plain.state_dict(), served.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} changed by the MTP layer's tensors"


@pytest.mark.parametrize("field,value,match", [
    ("scoring_func", "softplus", "scoring_func='softplus'"),
    ("topk_method", "auxloss", "topk_method='auxloss'"),
    ("architectures", ["LlamaForCausalLM"], "architectures="),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("n_group", 3, "n_group=3"),
    ("rope_scaling", {"type": "longrope", "factor": 2.0}, "rope_scaling.type='longrope'"),
])
def test_unsupported_config_value_names_the_field(ckpt, field, value, match):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[field] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match):
        load_model(ckpt, progress=False)


def test_softmax_scoring_with_noaux_tc_is_refused():
    with pytest.raises(ConfigError, match="noaux_tc"):
        ModelConfig.from_dict({"scoring_func": "softmax", "topk_method": "noaux_tc"})


def test_scoring_keys_default_when_absent_and_are_written(tmp_path):
    cfg = ModelConfig.from_dict({"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "n_routed_experts": 4, "num_experts_per_tok": 2})
    assert (cfg.scoring_func, cfg.topk_method) == ("sigmoid", "noaux_tc")
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32)
    model.init_weights(seed=0)
    save_checkpoint(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["scoring_func"] == "sigmoid" and written["topk_method"] == "noaux_tc"
