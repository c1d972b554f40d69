"""Selective quantization policy: ModelOpt exclude_modules (fnmatch) meaning, default = routed experts only."""
import pytest

from namazu.quant.selective import QuantPolicy, module_class

NAMES = {
    "model.layers.3.mlp.experts.17.gate_proj": "routed_experts",
    "model.layers.3.mlp.experts": "routed_experts",
    "model.layers.3.mlp.shared_experts.down_proj": "shared_experts",
    "model.layers.0.mlp.up_proj": "dense_mlp",
    "model.layers.3.self_attn.kv_a_proj_with_mqa": "attention",
    "model.layers.3.self_attn.q_b_proj": "attention",
    "model.layers.3.mlp.gate": "router",
    "lm_head": "lm_head",
    "model.embed_tokens": None,
    "model.layers.3.self_attn.kv_a_layernorm": None,
}


def test_module_classes():
    for name, cls in NAMES.items():
        assert module_class(name) == cls, name


def test_default_policy_quantizes_only_routed_experts():
    p = QuantPolicy.preset("experts")
    quantized = {n for n in NAMES if p.quantized(n)}
    assert quantized == {"model.layers.3.mlp.experts.17.gate_proj", "model.layers.3.mlp.experts"}
    assert p.experts_quantized(3)


def test_all_linear_and_extra_excludes():
    p = QuantPolicy.parse("all-linear", extra_exclude=["model.layers.3.mlp.experts*"])
    assert p.quantized("model.layers.3.self_attn.q_b_proj") and p.quantized("model.layers.0.mlp.up_proj")
    assert not p.quantized("model.layers.3.mlp.gate") and not p.quantized("lm_head")
    assert not p.experts_quantized(3) and p.experts_quantized(4)
    # namazu holds one experts module per layer: `experts.*` patterns decide for the whole module
    assert not p.quantized("model.layers.3.mlp.experts") and p.quantized("model.layers.4.mlp.experts")
    only = QuantPolicy.parse("attention,lm_head")
    assert only.quantized("lm_head") and not only.quantized("model.layers.0.mlp.up_proj")
    assert not only.quantized("model.layers.3.mlp.shared_experts.up_proj")
    with pytest.raises(ValueError, match="unknown module class"):
        QuantPolicy.parse("experts,attention")
