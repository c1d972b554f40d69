"""Sampler test inputs shared by the sampler's and the acceptance rule's tests."""
import torch

from namazu.layers.sampler import SamplingTensors


def tensors(s, v, **kw) -> SamplingTensors:
    """Sampling settings for `s` rows over a vocabulary of `v`: plain T=1 sampling unless overridden."""
    base = dict(
        temperature=torch.ones(s), top_k=torch.full((s,), v, dtype=torch.long), top_p=torch.ones(s),
        min_p=torch.zeros(s), presence_penalty=torch.zeros(s), frequency_penalty=torch.zeros(s),
        repetition_penalty=torch.ones(s), seeds=torch.arange(s, dtype=torch.long) * 7919 + 1,
        counters=torch.zeros(s, dtype=torch.long), num_logprobs=-1)
    base.update(kw)
    return SamplingTensors(**base)


def empirical(tokens, v):
    return torch.bincount(tokens, minlength=v).float() / tokens.numel()
