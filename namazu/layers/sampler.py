"""Token sampling on the device with no host synchronisation.

Per row (one sampled position): penalties -> logit bias -> token bitmask -> temperature -> top-k / top-p -> min-p ->
exponential race. Sampling draws E ~ Exp(1) per token and takes argmax(logits / T - log E), which picks
token i with probability softmax(logits / T)_i without `multinomial` and without reading anything back.

The noise is a counter-based hash of (sequence seed, output index, stream, token id), not a stateful
generator: a sequence's samples depend only on its own seed and position, never on which other
sequences share the step, so a seeded request is reproducible and a verify step samples exactly the
token plain decoding would have sampled at the same position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_STREAM = 0xD1B54A32D192ED03 - (1 << 64)

# Noise streams: the token sample, the acceptance coin of a stochastic draft, the residual resample.
STREAM_SAMPLE, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2


def _wrap(v: int) -> int:
    """An integer reduced to the signed int64 with the same low 64 bits."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


# Column offsets i * GOLDEN (wrapping int64), computed once. Inductor (CPU) turned `arange(n) * GOLDEN` into the
# C++ index expression `GOLDEN * x1`: a signed product that overflows, which C++ leaves undefined, and gcc at -O3
# derived the loop's bounds from it (wrong noise, stores past a buffer's end, a corrupted heap; the drafted step's
# sampled tail segfaulted). Loaded from this table the offsets are values: no product of a loop index overflows.
# 2^18 columns cover every vocabulary of the model family (163,840 for Kimi-K2); wider rows compute them, as
# other devices do (their integer products wrap).
_COLUMN_TABLE = 1 << 18
_COLUMNS_CPU = torch.arange(_COLUMN_TABLE, dtype=torch.int64) * _GOLDEN


def column_offsets(n: int, device: torch.device) -> torch.Tensor:
    """[n] int64: i * GOLDEN for column i (splitmix64's increment), from the table on CPU."""
    if device.type == "cpu" and n <= _COLUMN_TABLE:
        return _COLUMNS_CPU[:n]
    return torch.arange(n, device=device, dtype=torch.int64) * _GOLDEN


def hash_uniform(seeds: torch.Tensor, counters: torch.Tensor, n: int, stream: int) -> torch.Tensor:
    """Uniform (0, 1) float64 [S, n] from (seed [S], counter [S], column, stream) by splitmix64."""
    base = _mix(seeds * _GOLDEN + _mix(counters + _wrap(stream * _STREAM)))
    z = _mix(base.unsqueeze(-1) + column_offsets(n, seeds.device))
    return (_srl(z, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, n: int, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """-log(E), E ~ Exp(1): adding it to logits and taking argmax samples from their softmax."""
    return -torch.log(-torch.log(hash_uniform(seeds, counters, n, stream))).float()


@dataclass
class SamplingTensors:
    """Per-row sampling settings on the device, plus host-side flags that let the sampler skip work
    (the flags come from the requests, never from device values)."""

    temperature: torch.Tensor        # [S] fp32; 0 = greedy
    top_k: torch.Tensor              # [S] int64; vocab size = off
    top_p: torch.Tensor              # [S] fp32
    min_p: torch.Tensor              # [S] fp32
    presence_penalty: torch.Tensor   # [S] fp32
    frequency_penalty: torch.Tensor  # [S] fp32
    repetition_penalty: torch.Tensor  # [S] fp32
    seeds: torch.Tensor              # [S] int64; >= 0: the request's seed, < 0: engine-drawn (`seeded_rows`)
    counters: torch.Tensor           # [S] int64: index of the output token this row samples
    output_counts: torch.Tensor | None = None  # [S, V] fp32 counts of generated tokens (penalties)
    prompt_mask: torch.Tensor | None = None    # [S, V] bool tokens in the prompt (repetition penalty)
    bitmask: torch.Tensor | None = None        # [S, ceil(V/32)] int32, bit set = allowed
    bias: torch.Tensor | None = None           # [2, E] int64 (row, token id) of each logit-bias entry
    bias_values: torch.Tensor | None = None    # [E] fp32 added to the logit there
    any_penalty: bool = False
    any_top_k_top_p: bool = False
    any_min_p: bool = False
    all_greedy: bool = False
    num_logprobs: int = 0            # top-N logprobs to return (max over rows); -1 = none at all


def seeded_rows(seeds: torch.Tensor) -> torch.Tensor:
    """[S] bool: the rows whose seed the request gave (engine-drawn seeds are negative,
    `scheduler.sequence.sequence_seed`). A device op: no host read."""
    return seeds >= 0


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    counts = t.output_counts
    if counts is None:
        return logits
    seen = counts > 0
    if t.prompt_mask is not None:
        seen = seen | t.prompt_mask
    rep = t.repetition_penalty.unsqueeze(-1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty.unsqueeze(-1) * counts
    return logits - t.presence_penalty.unsqueeze(-1) * (counts > 0).float()


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, W] int32 (bit j of word w = token 32w + j, as xgrammar packs it) -> [S, V] bool allowed."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool()
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size]


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[S, V] bool -> [S, ceil(V/32)] int32 (inverse of unpack_bitmask)."""
    s, v = allowed.shape
    padded = torch.zeros(s, -(-v // 32) * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :v] = allowed.long()
    words = (padded.view(s, -1, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    if bitmask is None:
        return logits
    return logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps each row's top_k tokens, then the smallest set whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(-1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(-1), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def leaves_logits_raw(t: SamplingTensors) -> bool:
    """Whether `process_logits` returns the raw logits unchanged (every row greedy, no penalty, no grammar
    mask): each row's sample is then their argmax, which graph mode computes inside its compiled forward."""
    return t.all_greedy and not t.any_penalty and t.bitmask is None and t.bias is None


def apply_logit_bias(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Adds each row's logit bias (a scatter on the device: no host read)."""
    if t.bias is None:
        return logits
    return logits.index_put((t.bias[0], t.bias[1]), t.bias_values, accumulate=True)


def process_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Raw fp32 logits [S, V] -> the logits of each row's sampling distribution (temperature applied;
    greedy rows keep scale 1, their argmax is unchanged by every filter)."""
    if t.any_penalty:
        logits = apply_penalties(logits, t)
    logits = apply_logit_bias(logits, t)
    logits = apply_bitmask(logits, t.bitmask)
    if t.all_greedy:
        return logits
    temp = torch.where(t.temperature > 0, t.temperature, torch.ones_like(t.temperature))
    logits = logits / temp.unsqueeze(-1)
    if t.any_top_k_top_p:
        logits = apply_top_k_top_p(logits, t.top_k, t.top_p)
    if t.any_min_p:
        logits = apply_min_p(logits, t.min_p)
    return logits


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension (the first index of the largest value, as torch.argmax) as a max and a
    min. Written so when an argmax fused with the seeded noise seemed miscompiled under inductor (CPU); the
    cause was the noise's overflowing index product (`column_offsets`). A row holding NaN gives its last
    index, not an index past the end."""
    n = x.shape[-1]
    top = x.amax(dim=-1, keepdim=True)
    index = torch.arange(n, device=x.device)
    return torch.where(x == top, index, n - 1).amin(dim=-1)


def sample_from_processed(processed: torch.Tensor, t: SamplingTensors, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """Greedy rows take the argmax, others the exponential race with their own seeded noise."""
    greedy = first_argmax(processed)
    if t.all_greedy:
        return greedy
    raced = first_argmax(processed + gumbel_noise(t.seeds, t.counters, processed.shape[-1], stream))
    return torch.where(t.temperature > 0, raced, greedy)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                 # [S] int64
    logprobs: torch.Tensor | None = None    # [S] raw logprob of the sampled token
    top_ids: torch.Tensor | None = None     # [S, N]
    top_logprobs: torch.Tensor | None = None  # [S, N]
    processed: torch.Tensor | None = None   # [S, V] processed logits (the verify step needs p)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Logprobs of the model's raw distribution: the chosen tokens' and the top `num_top`."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    if num_top <= 0:
        return chosen, None, None
    top_lp, top_ids = logp.topk(num_top, dim=-1)
    return chosen, top_ids, top_lp


class Sampler:
    """Stateless: everything per-row arrives in SamplingTensors."""

    def __call__(self, logits: torch.Tensor, t: SamplingTensors, keep_processed: bool = False) -> SamplerOutput:
        logits = logits.float()
        processed = process_logits(logits, t)
        token_ids = sample_from_processed(processed, t)
        out = SamplerOutput(token_ids, processed=processed if keep_processed else None)
        if t.num_logprobs >= 0:
            out.logprobs, out.top_ids, out.top_logprobs = gather_logprobs(logits, token_ids, t.num_logprobs)
        return out
