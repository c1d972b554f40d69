"""The shipped namazu-tiny: design constraints of issue 5, and logits equal to transformers' implementation."""
import json

import pytest
import torch

from namazu.tiny import ASSET_DIR
from namazu.tiny.tokenizer import EOT, load_tokenizer


@pytest.fixture(scope="module")
def cfg():
    return json.loads((ASSET_DIR / "config.json").read_text())


def test_shipped_files_and_design(cfg):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md",
              "loss_curve.png", "expert_load.png", "eval_results.json"):
        assert (ASSET_DIR / f).is_file(), f
    assert (ASSET_DIR / "model.safetensors").stat().st_size <= 24 * 10**6
    assert cfg["scoring_func"] == "sigmoid" and cfg["topk_method"] == "noaux_tc"
    assert cfg["num_hidden_layers"] >= 4 and cfg["first_k_dense_replace"] == 1
    assert cfg["n_shared_experts"] == 1 and cfg["n_routed_experts"] >= 8 and cfg["num_experts_per_tok"] == 2
    for k in ("hidden_size", "q_lora_rank", "kv_lora_rank", "moe_intermediate_size", "intermediate_size"):
        assert cfg[k] % 64 == 0, k
    assert cfg["num_attention_heads"] * cfg["v_head_dim"] % 64 == 0
    h, moe_layers = cfg["hidden_size"], cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    routed = moe_layers * cfg["n_routed_experts"] * 3 * h * cfg["moe_intermediate_size"]
    from safetensors.torch import load_file

    tensors = load_file(ASSET_DIR / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for k, t in tensors.items() if not k.endswith("e_score_correction_bias"))
    total = sum(t.numel() for k, t in tensors.items() if not k.endswith("e_score_correction_bias"))
    embed = 2 * cfg["vocab_size"] * h
    assert routed / (total - embed) >= 0.6


def test_logits_match_transformers_fp32():
    from transformers import DeepseekV3ForCausalLM

    from namazu.models.loader import load_model

    tok = load_tokenizer(ASSET_DIR)
    ids = torch.tensor([tok.encode(EOT + "Debian では、パッケージ管理システムを使ってソフトウェアを導入します。").ids])
    ours = load_model(ASSET_DIR, dtype=torch.float32, progress=False)
    ref = DeepseekV3ForCausalLM.from_pretrained(ASSET_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden, _ = ours(ids)
        a = ours.compute_logits(hidden)
        b = ref(ids).logits.float()
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_model_card_reports_the_acceptance_numbers():
    card = (ASSET_DIR / "MODEL_CARD.md").read_text(encoding="utf-8")
    results = json.loads((ASSET_DIR / "eval_results.json").read_text())
    for key in ("ratio model / unigram", "bits per byte", "arguments validate", "Expert load", "Greedy continuations"):
        assert key in card
    assert f"{results['ja']['ppl_ratio_vs_unigram']:.4f}" in card
