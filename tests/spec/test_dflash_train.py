"""The drafter trainer on captured ids of the random tiny target: it learns (held-out acceptance rises
above an untrained drafter's) and writes a checkpoint the engine accepts."""
import json

import numpy as np
import pytest
from engine_helpers import assert_same_outputs, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.spec.capture import CaptureRecord, CaptureWriter
from namazu.spec.dflash import DFlashDrafter
from namazu.spec.training.train import Target, acceptance_length, build_parser, load_examples, train


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Records shaped like captures, with outputs that follow a rule a drafter can learn in a few dozen
    steps (counting up from a random token): the trainer does not care who produced the ids."""
    root = tmp_path_factory.mktemp("capture")
    rng = np.random.default_rng(0)
    for part, n in (("train", 64), ("heldout", 8)):
        w = CaptureWriter(root / part)
        for i in range(n):
            start = int(rng.integers(0, 200))
            out = [(start + j) % 240 for j in range(40)]
            w.write(CaptureRecord(f"{part}{i}", rng.integers(0, 256, int(rng.integers(4, 12))).tolist(), [out],
                                  ["length"], {"temperature": 0.0}))
        w.close()
    return root


def test_trainer_learns_and_writes_a_servable_checkpoint(captured, tmp_path):
    out = tmp_path / "drafter"
    args = build_parser().parse_args([
        "--target", tiny_checkpoint(), "--data", str(captured / "train"), "--heldout", str(captured / "heldout"),
        "--out", str(out), "--steps", "300", "--time-budget", "3", "--batch", "2", "--anchors", "16",
        "--block-size", "5", "--num-heads", "2", "--head-dim", "16", "--intermediate-size", "64",
        "--selector-k", "4", "--selector-rank", "8", "--lr", "3e-3", "--eval-k", "4", "--draft-vocab", "200"])
    result = train(args)
    log = json.loads((out / "train_log.json").read_text())
    # The 200 commonest of the 240 output ids are the draft vocabulary the engine below serves with.
    from namazu.spec.dflash_config import DFlashConfig

    saved = DFlashConfig.load(out)
    assert saved.draft_vocab_size == 200
    assert log["steps"] == 300 and log["history"][-1]["loss"] < log["history"][0]["loss"]
    trained = result["heldout_acceptance"]["greedy"]["mean_acceptance_length"]
    # An untrained drafter of the same shape, on the same held-out outputs.
    saved.draft_vocab_size = 0
    fresh = DFlashDrafter(saved)
    target = Target(tiny_checkpoint(), fresh.cfg.target_layers)
    base = acceptance_length(fresh, target, load_examples([str(captured / "heldout")], 512), 4)
    # Trained: ~1.2 on this rule; labels shifted by one (a broken trainer): ~1.05; untrained: ~1.0.
    assert trained > base["greedy"]["mean_acceptance_length"] + 0.1, (trained, base)
    # The engine serves it, losslessly.
    ps = prompts(3, lo=4, hi=12, seed=2)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(tiny_checkpoint(), executor="inline") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params,
                                                             use_tqdm=False)]
    with LLM(tiny_checkpoint(), executor="inline", speculative_model=str(out), num_speculative_tokens=4) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params,
                                                            use_tqdm=False)]
        assert llm.engine.get_stats().num_draft_tokens > 0
    assert_same_outputs(tiny_checkpoint(), ps, params, got, want)


def test_packed_sequences_train_as_if_alone():
    """The trainer packs a step's sequences end to end into one forward: each block must see its own
    sequence's context only, so the packed hidden states equal each sequence's own forward."""
    import torch
    from dflash_fixtures import random_drafter

    from namazu.config import ModelConfig
    from namazu.spec.training.train import context_kv, draft_hidden

    t = ModelConfig.from_pretrained(tiny_checkpoint())
    drafter = DFlashDrafter.load(random_drafter(tiny_checkpoint()), t.vocab_size, t.hidden_size, t.num_hidden_layers)
    target = Target(tiny_checkpoint(), drafter.cfg.target_layers)
    seqs = [list(range(5, 31)), list(range(40, 58))]
    anchors = [torch.tensor([3, 10, 20]), torch.tensor([2, 9, 15])]
    with torch.no_grad():
        alone = [draft_hidden(drafter, target.embed, torch.tensor(s), context_kv(drafter, target.hidden(s)), a)
                 for s, a in zip(seqs, anchors)]
        ids = torch.tensor(seqs[0] + seqs[1])
        pos = torch.cat([torch.arange(len(s)) for s in seqs])
        seq = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
        hidden = [torch.cat(parts) for parts in zip(*(target.hidden(s) for s in seqs))]
        packed = draft_hidden(drafter, target.embed, ids, context_kv(drafter, hidden, pos),
                              torch.cat([anchors[0], anchors[1] + len(seqs[0])]), pos, seq)
    torch.testing.assert_close(packed, torch.cat(alone), atol=2e-4, rtol=1e-4)


def test_draft_vocabulary_loss_is_the_softmax_restricted_to_it():
    """With a draft vocabulary the block loss is the cross-entropy of the softmax over those lm_head rows
    only (the distribution the serving walk ranks), on the positions whose token lies inside it: checked
    against the full logits with every other column at -inf, every anchor of one sequence."""
    import torch
    from dflash_fixtures import random_drafter

    from namazu.config import ModelConfig
    from namazu.spec.training.train import Example, batch_loss, context_kv, draft_hidden

    t = ModelConfig.from_pretrained(tiny_checkpoint())
    drafter = DFlashDrafter.load(random_drafter(tiny_checkpoint()), t.vocab_size, t.hidden_size, t.num_hidden_layers)
    target = Target(tiny_checkpoint(), drafter.cfg.target_layers)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 60, 40).tolist()          # tokens 0..59; the draft vocabulary below holds 30 of them
    vocab = torch.tensor(sorted(rng.choice(60, 30, replace=False).tolist()) + [100, 200])
    ex = Example(ids, 10)
    out = target.outputs(ids)
    with torch.no_grad():
        block, _, n = batch_loss(drafter, target, [ex], [out], 1000, np.random.default_rng(1), vocab=vocab)
        # The reference: every anchor 9 .. 38, block positions 1 .. 4.
        a = torch.arange(9, 39)
        h = draft_hidden(drafter, target.embed, torch.tensor(ids), context_kv(drafter, out.hidden), a)
        logits = h @ target.lm_head.T
        masked = torch.full_like(logits, float("-inf"))
        masked[..., vocab] = logits[..., vocab]
        at = a.unsqueeze(1) + torch.arange(1, 5)
        labels = torch.tensor(ids)[at.clamp(max=39)]
        valid = (at < 40) & torch.isin(labels, vocab)
        ce = -masked.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        w = torch.exp(-torch.arange(4).float() / drafter.cfg.loss_gamma).expand_as(ce) * valid
        want = (torch.where(valid, ce, 0.0) * w).sum() / w.sum()
    assert n == int(valid.sum()) > 0
    torch.testing.assert_close(block, want, atol=1e-4, rtol=1e-4)


def test_selector_soft_loss_is_the_cross_entropy_against_the_target_over_the_candidates():
    """selector_soft_weight 1: the selector's loss at each position is the cross-entropy of its softmax over
    the K candidates against the target's next-token distribution (its kept top entries, renormalised)
    restricted to those candidates and renormalised: checked position by position against a plain loop over
    the target's full distribution, every anchor of one sequence. Weight 0 keeps the captured token's
    K-way cross-entropy."""
    import torch
    import torch.nn.functional as F
    from dflash_fixtures import random_drafter

    from namazu.config import ModelConfig
    from namazu.spec.training.train import Example, batch_loss, context_kv, draft_hidden

    t = ModelConfig.from_pretrained(tiny_checkpoint())
    drafter = DFlashDrafter.load(random_drafter(tiny_checkpoint()), t.vocab_size, t.hidden_size, t.num_hidden_layers)
    top = 24
    target = Target(tiny_checkpoint(), drafter.cfg.target_layers, soft_top=top)
    ids = np.random.default_rng(3).integers(0, 200, 30).tolist()
    ex, out = Example(ids, 8), target.outputs(ids)
    kk, b = drafter.cfg.selector_k, drafter.cfg.block_size
    with torch.no_grad():
        _, hard, _ = batch_loss(drafter, target, [ex], [out], 1000, np.random.default_rng(1))
        _, soft, n = batch_loss(drafter, target, [ex], [out], 1000, np.random.default_rng(1), selector_soft_weight=1.0)
        final, _ = target.model(torch.tensor([ids]), capture_layers=drafter.cfg.target_layers)
        p_full = target.model.compute_logits(final[0]).softmax(-1)                 # [T, V]
        a = torch.arange(7, 29)
        h = draft_hidden(drafter, target.embed, torch.tensor(ids), context_kv(drafter, out.hidden), a)
        logits = h @ target.lm_head.T
        want_soft, want_hard, wsum = 0.0, 0.0, 0.0
        for m, anchor in enumerate(a.tolist()):
            for j in range(1, b):
                at = anchor + j
                if at >= len(ids):
                    continue
                gold = ids[at]
                cand = logits[m, j - 1].topk(kk).indices.tolist()
                if gold not in cand:
                    cand[-1] = gold
                lp = logits[m, j - 1].log_softmax(-1)
                prev = ids[at - 1]
                s = drafter.selector.scores(torch.tensor(prev), torch.tensor(cand), lp[cand], h[m, j - 1])
                # The target's kept top entries after position at - 1, renormalised, then over the candidates.
                pt, it = p_full[at - 1].topk(top)
                pt = pt / pt.sum()
                kept = dict(zip(it.tolist(), pt.tolist()))
                pc = torch.tensor([kept.get(c, 0.0) for c in cand])
                wk = float(np.exp(-(j - 1) / drafter.cfg.loss_gamma))
                ce_hard = float(F.cross_entropy(s.unsqueeze(0), torch.tensor([cand.index(gold)])))
                ce = float(-(pc / pc.sum() * s.log_softmax(-1)).sum()) if pc.sum() > 0 else ce_hard
                want_soft += wk * ce
                want_hard += wk * ce_hard
                wsum += wk
    assert n > 0
    assert abs(float(soft) - want_soft / wsum) < 1e-3 * max(1.0, want_soft / wsum), (float(soft), want_soft / wsum)
    assert abs(float(hard) - want_hard / wsum) < 1e-3 * max(1.0, want_hard / wsum)
    assert abs(float(soft) - float(hard)) > 1e-2       # the two terms differ on this sequence


def test_memory_cache_packs_target_outputs_into_shared_slabs():
    """`--hidden-cache memory` keeps each sequence's target outputs inside a few large slabs (HostArena:
    thousands of small long-lived tensors fragmented glibc's heap to 9x their size), with the same values
    as computing them again."""
    import torch

    from namazu.spec.training.train import HostArena

    target = Target(tiny_checkpoint(), [0, 1], "memory", soft_top=8)
    target.arena = HostArena(slab_bytes=64 << 10)       # small slabs: these tensors fill several
    fresh = Target(tiny_checkpoint(), [0, 1], soft_top=8)
    seqs = [prompts(1, 12 + 5 * i, 12 + 5 * i, seed=i)[0] for i in range(6)]
    kept = [target.outputs(ids, key=str(i)) for i, ids in enumerate(seqs)]
    storages = set()
    for i, (ids, out) in enumerate(zip(seqs, kept)):
        again = fresh.outputs(ids)
        assert target.outputs(ids, key=str(i)) is out                  # served from the cache
        for a, b in zip(out.hidden + [out.soft_ids, out.soft_p], again.hidden + [again.soft_ids, again.soft_p]):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            assert a.untyped_storage().nbytes() >= 64 << 10           # a view into a slab, not its own tensor
            storages.add(a.untyped_storage().data_ptr())
    assert 1 < len(storages) < 6 * 4                                   # several tensors a slab, several slabs
    # A tensor larger than a slab gets a slab of its own size; alignment keeps every dtype viewable.
    arena = HostArena(slab_bytes=1024)
    odd, wide, big = torch.ones(3, dtype=torch.float16), torch.rand(5, dtype=torch.float64), torch.arange(1000)
    assert torch.equal(arena.keep(odd), odd) and torch.equal(arena.keep(wide), wide)    # 6 bytes, then 8-byte items
    kept_big = arena.keep(big)
    assert torch.equal(kept_big, big) and kept_big.untyped_storage().nbytes() == big.numel() * 8


def test_blend_init_ends_on_the_line_between_base_and_fine_tuned_weights(captured, tmp_path):
    """`--blend-init SHARE`: the fine-tune ends at SHARE * base + (1 - SHARE) * fine-tuned weights, the draft
    vocabulary the fine-tuned one; SHARE 1 gives the base's weights back, 0 the fine-tune's."""
    import torch

    from namazu.spec.training.train import blend_with_base

    base_dir = tmp_path / "base"
    shape = ["--block-size", "5", "--num-heads", "2", "--head-dim", "16", "--intermediate-size", "64",
             "--selector-k", "4", "--selector-rank", "8"]
    common = ["--target", tiny_checkpoint(), "--data", str(captured / "train"), "--heldout", str(captured / "heldout"),
              "--steps", "6", "--batch", "2", "--anchors", "8", "--lr", "3e-3", "--eval-k", "4"]
    train(build_parser().parse_args([*common, "--out", str(base_dir), "--draft-vocab", "180", *shape]))
    from namazu.config import ModelConfig

    tcfg = ModelConfig.from_pretrained(tiny_checkpoint())
    load = lambda d: DFlashDrafter.load(d, tcfg.vocab_size, tcfg.hidden_size, tcfg.num_hidden_layers)  # noqa: E731
    base = load(base_dir)
    runs = {}
    for share in (0.0, 1.0):
        out = tmp_path / f"blend{share}"
        train(build_parser().parse_args([*common, "--out", str(out), "--init", str(base_dir), "--blend-init",
                                         str(share), "--draft-vocab-extend", "20", "--seed", "1"]))
        runs[share] = load(out)
    tuned, back = dict(runs[0.0].named_parameters()), dict(runs[1.0].named_parameters())
    moved = [n for n, p in base.named_parameters() if not torch.equal(p, tuned[n])]
    assert moved, "the fine-tune changed no weight"
    for n, p in base.named_parameters():
        assert torch.allclose(back[n], p, atol=1e-6), n                  # share 1: the base's weights
    assert runs[1.0].draft_vocab.numel() > base.draft_vocab.numel()      # the extended vocabulary kept
    assert torch.equal(runs[1.0].draft_vocab, runs[0.0].draft_vocab)
    # A share in between: exactly on the line, parameter by parameter.
    mid = load(tmp_path / "blend0.0")
    blend_with_base(mid, {n: p.detach().clone() for n, p in base.named_parameters()}, 0.25)
    for n, p in mid.named_parameters():
        assert torch.allclose(p, 0.25 * dict(base.named_parameters())[n] + 0.75 * tuned[n], atol=1e-6), n
    with pytest.raises(SystemExit, match="--init"):
        train(build_parser().parse_args([*common, "--out", str(tmp_path / "x"), "--blend-init", "0.5", *shape]))
