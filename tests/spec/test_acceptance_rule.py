"""The verify step's acceptance rule: lossless against scripted and stochastic drafts."""
import torch
from sampling_cases import empirical, tensors

from namazu.layers.sampler import Sampler, gumbel_noise
from namazu.spec.verify import verify_deterministic, verify_stochastic


def test_deterministic_rule_accepts_the_matching_prefix():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [0, 6, 7], [1, 2, 3]])
    num = torch.tensor([3, 3, 3, 1])
    tokens, n = verify_deterministic(target, drafts, num)
    assert n.tolist() == [3, 1, 0, 1]
    assert torch.equal(tokens, target)     # the output is always the target's own samples


def test_stochastic_rule_preserves_the_target_distribution():
    """Speculative sampling theorem: token 0 ~ p_0 and, given draft 0 was accepted, token 1 ~ p_1."""
    v, k, s = 5, 2, 60000
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(k + 1, v, generator=g) * 1.5
    q = torch.randn(k, v, generator=g).softmax(-1)
    processed = target_logits.expand(s, k + 1, v)
    draft_ids = torch.stack([torch.multinomial(q[j], s, replacement=True, generator=g) for j in range(k)], 1)
    seeds = torch.arange(s, dtype=torch.long) * 104729 + 17
    counters = torch.arange(k + 1).expand(s, k + 1)
    t = tensors(s * (k + 1), v, seeds=seeds.repeat_interleave(k + 1), counters=counters.reshape(-1))
    target_tokens = Sampler()(processed.reshape(-1, v), t).token_ids.view(s, k + 1)
    tokens, n = verify_stochastic(processed, target_tokens, draft_ids, q.expand(s, k, v),
                                  torch.full((s,), k), torch.zeros(s, dtype=torch.bool), seeds, counters,
                                  seeded=torch.zeros(s, dtype=torch.bool))
    p = target_logits.softmax(-1)
    assert (empirical(tokens[:, 0], v) - p[0]).abs().max() < 0.01
    took = n >= 1
    assert (empirical(tokens[took, 1], v) - p[1]).abs().max() < 0.015
    # Accepted drafts are kept verbatim; acceptance rate matches sum(min(p, q)).
    assert torch.equal(tokens[took, 0], draft_ids[took, 0])
    assert abs(took.float().mean().item() - torch.minimum(p[0], q[0]).sum().item()) < 0.01


def test_stochastic_rule_is_greedy_match_at_temperature_zero():
    v, k = 7, 3
    logits = torch.randn(2, k + 1, v, generator=torch.Generator().manual_seed(4))
    target = logits.argmax(-1)
    drafts = torch.stack([target[0, :k], (target[1, :k] + 1) % v])
    q = torch.full((2, k, v), 1.0 / v)
    tokens, n = verify_stochastic(logits, target, drafts, q, torch.tensor([k, k]),
                                  torch.ones(2, dtype=torch.bool), torch.tensor([1, 2]),
                                  torch.arange(k + 1).expand(2, k + 1), seeded=torch.zeros(2, dtype=torch.bool))
    assert n.tolist() == [k, 0]
    assert torch.equal(tokens, target)


def test_seeded_rows_take_the_exact_match_whatever_q_says():
    """A row whose request gave its seed is verified as a deterministic draft at T > 0: it accepts the
    longest prefix of drafts equal to the target's own seeded samples and emits those samples, so its
    tokens are those of plain seeded decoding whether or not the step drafted. Unseeded rows keep the
    ratio rule (their tokens are the drafts or residual draws, not the target's samples)."""
    v, k, s = 6, 3, 4000
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(k + 1, v, generator=g).expand(s, k + 1, v)
    q = torch.randn(k, v, generator=g).softmax(-1)
    draft_ids = torch.stack([torch.multinomial(q[j], s, replacement=True, generator=g) for j in range(k)], 1)
    seeds = torch.arange(s, dtype=torch.long) * 7919 + 3
    counters = torch.arange(k + 1).expand(s, k + 1)
    t = tensors(s * (k + 1), v, seeds=seeds.repeat_interleave(k + 1), counters=counters.reshape(-1))
    target = Sampler()(logits.reshape(-1, v), t).token_ids.view(s, k + 1)
    seeded = torch.arange(s) % 2 == 0
    tokens, n = verify_stochastic(logits, target, draft_ids, q.expand(s, k, v), torch.full((s,), k),
                                  torch.zeros(s, dtype=torch.bool), seeds, counters, seeded=seeded)
    match = torch.cumprod((draft_ids == target[:, :k]).long(), 1).sum(1)
    assert torch.equal(n[seeded], match[seeded])
    j = torch.arange(k + 1)
    emitted = j <= n.unsqueeze(-1)
    assert torch.equal(tokens[seeded][emitted[seeded]], target[seeded][emitted[seeded]])
    # The unseeded half follows the ratio rule: it accepts drafts the target did not sample, and its
    # token at a rejection is a residual draw, not the target's sample.
    un = ~seeded
    assert (n[un] > match[un]).any()
    assert not torch.equal(tokens[un][emitted[un]], target[un][emitted[un]])


def test_gumbel_noise_is_finite():
    assert torch.isfinite(gumbel_noise(torch.tensor([0, -1]), torch.tensor([0, 2**40]), 1000)).all()


def test_the_rule_traces_as_one_graph():
    """The verify step is captured inside a compiled graph: no host read, no data-dependent shape, no
    Python branch on a tensor value (fullgraph=True refuses a graph break)."""
    v, k, s = 9, 3, 6
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(s, k + 1, v, generator=g)
    q = torch.randn(s, k, v, generator=g).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(s, k)
    target = logits.argmax(-1)
    args = (logits, target, drafts, q, torch.tensor([3, 2, 0, 3, 1, 3]), torch.arange(s) % 3 == 0,
            torch.arange(s) - 2, torch.arange(k + 1).expand(s, k + 1))
    seeded = torch.arange(s) % 2 == 1
    compiled = torch.compile(verify_stochastic, fullgraph=True, backend="eager", dynamic=False)
    for got, want in zip(compiled(*args, seeded=seeded), verify_stochastic(*args, seeded=seeded)):
        assert torch.equal(got, want)
