"""The acceptance rule of the verify step (REFERENCE.md section 3), on the device, no host sync.

The target scores [last token, d_1 .. d_k] in one forward; row j's distribution p_j predicts the token
after d_j (d_0 = the last accepted token). Two rules, both lossless:
- deterministic drafts (a drafter that outputs tokens, q one-hot): sample the target's own token t_j at
  every row with the sequence's seeded noise, accept the longest prefix where d_{j+1} == t_j, then emit
  t at the first mismatch (the bonus token). At T=0 t_j is the argmax (greedy match). Because t_j is
  exactly what plain decoding would sample at that position, outputs equal decoding without drafts.
- stochastic drafts with distributions q_j: accept d with probability min(1, p(d) / q(d)); at the first
  rejection sample from norm(max(0, p - q)); if all k are accepted, the bonus token comes from p_k.
  Rows of requests that gave their own seed take the deterministic rule even then (`seeded`): it is
  lossless for drafts drawn any way, and it emits exactly the tokens of plain seeded decoding, so a
  seeded request's text does not depend on whether a step drafts (drafting switches off in large
  batches). The ratio rule would draw other coins and resamples, hence other text. The price is a lower
  acceptance rate for those rows (sum_x p(x) q(x) instead of sum_x min(p(x), q(x))).
The number accepted is computed on the device (cumulative product of the per-position accept flags).
"""
from __future__ import annotations

import torch

from namazu.layers.sampler import STREAM_ACCEPT, STREAM_RESIDUAL, first_argmax, gumbel_noise, hash_uniform


def accepted_prefix(accept: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """accept [S, K] bool -> length of the accepted prefix [S], capped by each row's draft count."""
    k = accept.shape[1]
    j = torch.arange(k, device=accept.device)
    ok = accept & (j < num_drafts.unsqueeze(-1))
    # The first position that is not accepted (k if none), as a min: one reduction, where a cumulative
    # product needs a scan.
    return torch.where(ok, k, j).amin(dim=1)


def verify_deterministic(target_tokens: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """target_tokens [S, K+1] (the target's sample at each row), draft_ids [S, K] ->
    (output tokens [S, K+1], num_accepted [S]); a row emits output[:num_accepted + 1]."""
    k = draft_ids.shape[1]
    n = accepted_prefix(draft_ids == target_tokens[:, :k], num_drafts)
    return target_tokens, n


def verify_stochastic(processed: torch.Tensor, target_tokens: torch.Tensor, draft_ids: torch.Tensor,
                      draft_probs: torch.Tensor, num_drafts: torch.Tensor, greedy: torch.Tensor,
                      seeds: torch.Tensor, counters: torch.Tensor, *, seeded: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling against draft distributions.

    processed [S, K+1, V] target logits after temperature/filters; target_tokens [S, K+1] sampled from
    them; draft_ids [S, K] drawn from draft_probs [S, K, V]; greedy [S] and seeded [S] (the request gave
    its seed) rows use the exact match against target_tokens; counters [S, K+1] the output index each
    row's token would take (seeds the coins and resamples). Static shapes, no host read: both rules are
    computed for every row and selected per row.
    """
    s, k = draft_ids.shape
    v = processed.shape[-1]
    p = processed[:, :k].softmax(dim=-1)
    q = draft_probs.float()
    p_d = p.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    q_d = q.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    flat_seeds = seeds.repeat_interleave(k)
    u = hash_uniform(flat_seeds, counters[:, :k].reshape(-1), 1, STREAM_ACCEPT).view(s, k)
    # u < p/q without dividing (q(d) > 0 for a token the drafter drew).
    coin = u * q_d.double() < p_d.double()
    exact = (greedy | seeded).unsqueeze(-1)
    accept = torch.where(exact, draft_ids == target_tokens[:, :k], coin)
    n = accepted_prefix(accept, num_drafts)

    # The residual is drawn at the first rejected position only (a row emits nothing after it): one row of the
    # vocabulary per sequence instead of K, with the noise that position's counter gives, as before.
    at = n.clamp(max=k - 1).unsqueeze(-1)                              # [S, 1] (k - 1 where none is rejected)
    rows = at.unsqueeze(-1).expand(s, 1, v)
    residual = (p.gather(1, rows) - q.gather(1, rows)).squeeze(1).clamp_min(0.0)
    noise = gumbel_noise(seeds, counters.gather(1, at).squeeze(1), v, STREAM_RESIDUAL)
    resampled = first_argmax(residual.log() + noise).unsqueeze(-1)    # [S, 1]
    # Exact-match rows never need the residual: their token at the first mismatch is the target's own
    # sample, already in target_tokens (kept at every position: such a row's tokens are the target's).
    resampled = torch.where(exact, target_tokens[:, :k], resampled)

    j = torch.arange(k, device=draft_ids.device).unsqueeze(0)
    first_k = torch.where(j < n.unsqueeze(-1), draft_ids, resampled)
    first_k = torch.where(j < num_drafts.unsqueeze(-1), first_k, target_tokens[:, :k])
    return torch.cat([first_k, target_tokens[:, k:]], dim=1), n

