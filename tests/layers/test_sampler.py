"""Sampler: each filter and penalty against its definition, distributions of the exponential race,
seeded reproducibility independent of the batch, the bitmask hook and logprobs."""
import os
import subprocess
import sys

import torch
from sampling_cases import empirical, tensors

from namazu.layers.sampler import (
    _COLUMN_TABLE,
    _GOLDEN,
    Sampler,
    apply_penalties,
    apply_top_k_top_p,
    column_offsets,
    hash_uniform,
    leaves_logits_raw,
    pack_bitmask,
    process_logits,
    unpack_bitmask,
)


def test_hash_uniform_is_uniform_and_counter_dependent():
    u = hash_uniform(torch.tensor([1, 2]), torch.tensor([0, 0]), 50000, 0)
    assert ((u > 0) & (u < 1)).all()
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.01
    assert not torch.equal(u[0], u[1])
    again = hash_uniform(torch.tensor([1]), torch.tensor([1]), 50000, 0)
    assert not torch.equal(u[0], again[0])


def test_column_offsets_are_splitmix_increments_in_and_past_the_table():
    def wrapped(i: int) -> int:
        v = (i * _GOLDEN) & ((1 << 64) - 1)
        return v - (1 << 64) if v >= 1 << 63 else v

    cpu = torch.device("cpu")
    assert column_offsets(5, cpu).tolist() == [wrapped(i) for i in range(5)]
    wide = column_offsets(_COLUMN_TABLE + 3, cpu)       # computed, not loaded: the same stream
    assert wide[-3:].tolist() == [wrapped(i) for i in range(_COLUMN_TABLE, _COLUMN_TABLE + 3)]
    # Exact: int64 products, the table's and the computed ones wrap the same way on any machine.
    assert torch.equal(wide[:1000], column_offsets(1000, cpu))


_COMPILED_NOISE = """
import torch
from namazu.layers.sampler import hash_uniform

def noise(seeds, counters):
    u = hash_uniform(seeds, counters, 264, 0)
    return u, u.amax(-1)

s, c = torch.tensor([5, -3, 7, 11]), torch.tensor([0, 4, 9, 2])
want = noise(s, c)
got = torch.compile(noise, backend="inductor", fullgraph=True, dynamic=False)(s, c)
# Exact: integer hashing, and a conversion to float64 that is exact (53-bit integers), as is the max of them.
assert all(torch.equal(a, b) for a, b in zip(want, got)), "the compiled noise differs from eager"
print("same")
"""


def test_the_seeded_noise_compiles_right_under_inductor():
    """Inductor (CPU) turned `arange(n) * GOLDEN` into an overflowing signed index product and gcc optimised the
    loop on it: the compiled noise was wrong and its stores ran past their buffer (a corrupted heap here, a
    segfault in graph mode's sampled drafted tail). Bit-exact: the hash is integer arithmetic and its conversion
    to float64 is exact. A subprocess, since the failure aborts the interpreter (tests/MUTATIONS.md SN1)."""
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _COMPILED_NOISE], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0 and "same" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_greedy_is_argmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, tensors(8, 50, temperature=torch.zeros(8), all_greedy=True))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_leaves_logits_raw_exactly_when_processing_is_the_identity():
    """Graph mode samples rows `leaves_logits_raw` accepts by the raw logits' argmax (computed in its
    compiled forward): it must accept only settings under which processing changes nothing."""
    s, v = 3, 40
    logits = torch.randn(s, v, generator=torch.Generator().manual_seed(1))
    allowed = torch.zeros(s, v, dtype=torch.bool)
    allowed[:, ::3] = True
    greedy = dict(temperature=torch.zeros(s), all_greedy=True)
    cases = {
        "greedy": (tensors(s, v, **greedy), True),
        "greedy + penalty": (tensors(s, v, **greedy, presence_penalty=torch.ones(s), any_penalty=True,
                                     output_counts=(torch.arange(v) % 2).float().expand(s, v)), False),
        "greedy + grammar": (tensors(s, v, **greedy, bitmask=pack_bitmask(allowed)), False),
        "temperature": (tensors(s, v, temperature=torch.full((s,), 0.5)), False),
    }
    for name, (t, raw) in cases.items():
        assert leaves_logits_raw(t) == raw, name
        assert torch.equal(process_logits(logits, t), logits) == raw, name
        if raw:
            assert torch.equal(Sampler()(logits, t).token_ids, logits.argmax(-1)), name


def test_temperature_sampling_matches_softmax():
    v, s = 6, 40000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for temp in (1.0, 0.5):
        out = Sampler()(logits.expand(s, v), tensors(s, v, temperature=torch.full((s,), temp)))
        expect = (logits / temp).softmax(-1)
        assert (empirical(out.token_ids, v) - expect).abs().max() < 0.01


def test_top_k_top_p_min_p_restrict_support():
    v, s = 8, 4000
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]).expand(s, v)
    probs = logits[0].softmax(-1)
    out = Sampler()(logits, tensors(s, v, top_k=torch.full((s,), 3), any_top_k_top_p=True))
    assert out.token_ids.max() <= 2
    expect = probs[:3] / probs[:3].sum()
    assert (empirical(out.token_ids, v)[:3] - expect).abs().max() < 0.03
    # top_p: smallest prefix whose mass reaches 0.6 -> tokens 0..1 (p0 ~ .40, p0+p1 ~ .64)
    out = Sampler()(logits, tensors(s, v, top_p=torch.full((s,), 0.6), any_top_k_top_p=True))
    assert set(out.token_ids.unique().tolist()) == {0, 1}
    out = Sampler()(logits, tensors(s, v, min_p=torch.full((s,), 0.5), any_min_p=True))
    assert set(out.token_ids.unique().tolist()) == {0, 1}   # p1/p0 = e^-0.5 > .5, p2/p0 = e^-1 < .5


def test_penalties_follow_their_definitions():
    v = 5
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0]])
    prompt = torch.tensor([[False, False, False, True, False]])
    t = tensors(1, v, presence_penalty=torch.tensor([0.5]), frequency_penalty=torch.tensor([0.25]),
                repetition_penalty=torch.tensor([2.0]), output_counts=counts, prompt_mask=prompt,
                any_penalty=True)
    got = apply_penalties(logits, t)
    expect = torch.tensor([[1.0 / 2 - 0.5 - 0.5, -1.0 * 2 - 0.25 - 0.5, 2.0, 0.5 / 2, -0.5]])
    assert torch.allclose(got, expect)


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    v = 100
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, v, generator=g)
    seeds = torch.tensor([11, 22, 33, 44, 55, 66])
    counters = torch.tensor([0, 3, 1, 9, 2, 5])
    full = Sampler()(logits, tensors(6, v, seeds=seeds, counters=counters)).token_ids
    for i in range(6):
        one = Sampler()(logits[i:i + 1], tensors(1, v, seeds=seeds[i:i + 1], counters=counters[i:i + 1]))
        assert one.token_ids.item() == full[i].item()
    shuffled = Sampler()(logits.flip(0), tensors(6, v, seeds=seeds.flip(0), counters=counters.flip(0)))
    assert torch.equal(shuffled.token_ids.flip(0), full)


def test_bitmask_roundtrip_and_restricts_sampling():
    allowed = torch.rand(3, 70, generator=torch.Generator().manual_seed(2)) < 0.3
    allowed[:, 5] = True
    assert torch.equal(unpack_bitmask(pack_bitmask(allowed), 70), allowed)
    s = 3000
    logits = torch.randn(70).expand(s, 70)
    mask = pack_bitmask(allowed[:1].expand(s, 70))
    out = Sampler()(logits, tensors(s, 70, bitmask=mask))
    assert allowed[0, out.token_ids].all()
    greedy = process_logits(logits[:1], tensors(1, 70, bitmask=mask[:1], temperature=torch.zeros(1),
                                                all_greedy=True)).argmax(-1)
    assert allowed[0, greedy].all()


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    out = Sampler()(logits, tensors(4, 30, temperature=torch.full((4,), 0.7), num_logprobs=3))
    ref = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, ref.gather(-1, out.token_ids[:, None]).squeeze(-1))
    assert torch.allclose(out.top_logprobs, ref.topk(3, dim=-1).values)


def reference_top_k_top_p(logits: torch.Tensor, k: int, p: float) -> set[int]:
    """The support by definition, one row in plain Python: the k most likely tokens, renormalised among
    themselves, then the most likely of those until their mass reaches p."""
    order = sorted(range(logits.numel()), key=lambda i: -float(logits[i]))[:k]
    probs = torch.tensor([float(logits[i]) for i in order]).softmax(-1).tolist()
    kept, mass = [], 0.0
    for i, q in zip(order, probs):
        kept.append(i)
        mass += q
        if mass >= p:
            break
    return set(kept)


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # p over the full vocabulary: .30 .25 .20 .15 .10. Top-2 renormalised: .545 .455, so top_p = .5 keeps
    # token 0 alone; top-p taken before the top-k mask would keep tokens 0 and 1 (.30 < .5 <= .55).
    logits = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10]).log()
    out = apply_top_k_top_p(logits[None], torch.tensor([2]), torch.tensor([0.5]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0]
    g = torch.Generator().manual_seed(4)
    v = 40
    logits = torch.randn(200, v, generator=g) * 2
    ks = torch.randint(1, v + 1, (200,), generator=g)
    ps = torch.rand(200, generator=g) * 0.9 + 0.05
    out = apply_top_k_top_p(logits, ks, ps)
    for row in range(200):
        got = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
        assert got == reference_top_k_top_p(logits[row], int(ks[row]), float(ps[row])), f"row {row}"
        kept = sorted(got)
        assert torch.equal(out[row, kept], logits[row, kept]), "kept logits must pass through unchanged"
