"""The drafter's serving shortcuts give the values of the plain forms they replace: the greedy walk over
precomputed score tables equals the position-by-position walk bit for bit (the same row-wise argmax and
softmax over the same score tensors), and the fused projections (`fuse_for_serving`: q/k/v, gate/up,
every layer's context keys/values) equal the separate modules up to summation order (a product of
another shape and layout is blocked differently by BLAS, so the low bits depend on the machine:
tests/harness/numerics.py). Drafts only decide what is verified, so either way the output is the
target's own; only the acceptance could move, on a near-tie of the drafter's scores."""
import pytest
import torch
from dflash_fixtures import random_drafter, shortlisted_drafter
from engine_helpers import tiny_checkpoint
from numerics import assert_equal_up_to_reordering

from namazu.assets import default_model_path
from namazu.config import ModelConfig
from namazu.layers.cpu_layout import use_k_major_linears
from namazu.spec.dflash import DFlashDrafter
from namazu.spec.selection import SHIPPED_DRAFTER_DIR


def _load(kind: str) -> DFlashDrafter:
    """The engine tests' random drafter (2 layers), its draft-vocabulary variant, or the shipped drafter
    (namazu-tiny's shapes), laid out as the proposer lays them out on CPU."""
    if kind == "shipped":
        path, target = default_model_path() / SHIPPED_DRAFTER_DIR, default_model_path()
    else:
        target = tiny_checkpoint()
        path = shortlisted_drafter(target) if kind == "shortlist" else random_drafter(target)
    t = ModelConfig.from_pretrained(target)
    model = DFlashDrafter.load(path, t.vocab_size, t.hidden_size, t.num_hidden_layers)
    use_k_major_linears(model)
    return model


@pytest.mark.parametrize("kind", ["random", "shortlist", "shipped"])
def test_greedy_walk_equals_the_position_by_position_walk(kind):
    """`walk` without temperatures takes the table walk; with every temperature 0 it takes the loop, whose
    greedy picks and confidences are the reference. Integer-valued logits make ties, which both forms
    must break alike."""
    model = _load(kind)
    n = model.cfg.draft_vocab_size or model.cfg.vocab_size
    g = torch.Generator().manual_seed(3)
    for m, k in [(1, 1), (1, 2), (3, model.cfg.block_size - 1), (8, model.cfg.block_size - 1)]:
        for ties in (False, True):
            anchor = torch.randint(0, model.cfg.vocab_size, (m,), generator=g)
            h = torch.randn(m, k, model.cfg.hidden_size, generator=g)
            logits = torch.randn(m, k, n, generator=g) * 3
            if ties:
                logits = logits.round()
            with torch.no_grad():
                fast = model.walk(anchor, h, logits, k)
                loop = model.walk(anchor, h, logits, k, torch.zeros(m), torch.rand(m, k, generator=g).double())
            assert fast.q is None
            assert torch.equal(fast.ids, loop.ids), (m, k, ties)
            assert torch.equal(fast.confidence, loop.confidence), (m, k, ties)


@pytest.mark.parametrize("kind", ["random", "shipped"])
def test_fused_projections_equal_the_separate_modules(kind):
    """Context keys/values of a prefill chunk and of a verify step, and block hidden states over per-block
    and over shared contexts (the two attention forms), with and without `fuse_for_serving`: equal up
    to summation order (the shared-context form multiplies q/k/v views of other strides, and on some
    CPUs the fused product itself is blocked differently from the three separate ones)."""
    plain, fused = _load(kind), _load(kind)
    fused.fuse_for_serving()
    cfg = plain.cfg
    g = torch.Generator().manual_seed(5)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    with torch.no_grad():
        for t in (7, 300):
            feat = plain.fuse([torch.randn(t, cfg.hidden_size, generator=g) for _ in cfg.target_layers])
            pos = torch.arange(t) + 11
            keys, values = fused.context_kv_all(feat, pos)                   # [layers, T, heads, D]
            for li, layer in enumerate(plain.layers):
                k, v = layer.context_kv(feat, pos)                           # [heads, T, D]
                assert_equal_up_to_reordering(keys[li], k.transpose(0, 1), ("keys", t, li))
                assert_equal_up_to_reordering(values[li], v.transpose(0, 1), ("values", t, li))
        ctx_len = 40
        feat = plain.fuse([torch.randn(ctx_len, cfg.hidden_size, generator=g) for _ in cfg.target_layers])
        ctx = [layer.context_kv(feat, torch.arange(ctx_len)) for layer in plain.layers]
        for m, shared in [(1, False), (3, False), (3, True)]:
            anchor = torch.randint(0, cfg.vocab_size, (m,), generator=g)
            anchor_pos = torch.randint(5, ctx_len, (m,), generator=g)
            visible = torch.arange(ctx_len) < anchor_pos.unsqueeze(-1)
            kv = [(k.unsqueeze(0), v.unsqueeze(0)) if shared else
                  (k.expand(m, -1, -1, -1), v.expand(m, -1, -1, -1)) for k, v in ctx]
            want = plain.forward_blocks(anchor, anchor_pos, kv, visible, embed)
            got = fused.forward_blocks(anchor, anchor_pos, kv, visible, embed)
            assert_equal_up_to_reordering(got, want, ("blocks", m, shared))
