"""Logits parity with transformers' DeepseekV3ForCausalLM on tiny random checkpoints it saved itself."""
from __future__ import annotations

import pytest
import torch

from namazu.models.kv_cache import ContiguousLatentCache, forward_with_cache
from namazu.models.loader import load_model

from hf_oracle import make_hf_checkpoint

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}

VARIANTS = {
    "q_lora_set": {},
    "q_lora_null": {"q_lora_rank": None},
    "grouped_routing": {"n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
    "yarn": {"rope_parameters": YARN},
    "all_moe_no_interleave": {"first_k_dense_replace": 0, "rope_interleave": False},
    "v_eq_nope_no_norm_topk": {"v_head_dim": 16, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
}


def _ref_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits.float()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_logits_match_transformers(tmp_path, name):
    hf = make_hf_checkpoint(tmp_path, seed=1, **VARIANTS[name])
    model = load_model(tmp_path, dtype="float32", progress=False)
    ids = torch.randint(0, hf.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden, _ = model(ids)
        logits = model.compute_logits(hidden)
    ref = _ref_logits(hf, ids)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["q_lora_set", "yarn", "grouped_routing"])
def test_cached_decode_matches_transformers(tmp_path, name):
    """Prefill then token-by-token decode through the absorbed latent cache equals full-sequence logits."""
    hf = make_hf_checkpoint(tmp_path, seed=2, **VARIANTS[name])
    model = load_model(tmp_path, dtype="float32", progress=False)
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    ref = _ref_logits(hf, ids)
    cache = ContiguousLatentCache(model.config, batch=2, max_len=32, dtype=torch.float32)
    parts = [forward_with_cache(model, ids[:, :10], cache)]
    for t in range(10, 24):
        parts.append(forward_with_cache(model, ids[:, t:t + 1], cache))
    torch.testing.assert_close(torch.cat(parts, 1), ref, rtol=1e-4, atol=1e-4)


def test_captured_hidden_states_match_transformers(tmp_path):
    hf = make_hf_checkpoint(tmp_path, seed=4)
    model = load_model(tmp_path, dtype="float32", progress=False)
    ids = torch.randint(0, hf.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states
        _, captured = model(ids, capture_layers=(0, 1))
    # transformers' hidden_states[i + 1] is the output of decoder layer i
    torch.testing.assert_close(captured[0], ref[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(captured[1], ref[2], rtol=1e-4, atol=1e-4)


def test_bf16_close_to_fp32(tmp_path):
    make_hf_checkpoint(tmp_path, seed=6)
    m32 = load_model(tmp_path, dtype="float32", progress=False)
    m16 = load_model(tmp_path, dtype="bfloat16", progress=False)
    assert m16.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a = m32.compute_logits(m32(ids)[0])
        b = m16.compute_logits(m16(ids)[0])
    assert (a - b).abs().max() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
