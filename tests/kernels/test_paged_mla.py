"""The paged absorbed-MLA op against the lead's torch reference, over scattered blocks and mixed batches."""
import pytest
import torch

from namazu.kernels.paged_mla import paged_latent_attention, write_latents
from namazu.layers.mla import latent_attention_ref


@pytest.mark.parametrize("tile_tokens", [8, 256])
def test_paged_attention_matches_reference_over_scattered_blocks(tile_tokens):
    g = torch.Generator().manual_seed(0)
    h, r, dr, bs, num_blocks = 3, 16, 4, 4, 40
    cache = torch.zeros(num_blocks, bs, r + dr)
    # Three sequences: a long prefill chunk after a cached prefix, a decode, a verify (1 + 3 queries).
    ctx_lens = [13, 22, 9]       # tokens in the cache after this step
    new = [6, 1, 4]              # query tokens this step (the last ones of each sequence)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in ctx_lens:
        nb = -(-n // bs)
        tables.append(perm[used:used + nb])
        used += nb
    m = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (m - len(t)) for t in tables])
    keys = [(torch.randn(n, r, generator=g), torch.randn(n, dr, generator=g)) for n in ctx_lens]
    # Old tokens are already cached; the new ones are written through the slot mapping like a step does.
    slots, q_lat, q_pe, q_pos = [], [], [], []
    for s, (n, k) in enumerate(zip(ctx_lens, new)):
        for p in range(n):
            slot = tables[s][p // bs] * bs + p % bs
            if p < n - k:
                cache.view(-1, r + dr)[slot] = torch.cat([keys[s][0][p], keys[s][1][p]])
            else:
                slots.append(slot)
        q_lat.append(torch.randn(k, h, r, generator=g))
        q_pe.append(torch.randn(k, h, dr, generator=g))
        q_pos.append(torch.arange(n - k, n))
    c_new = torch.cat([keys[s][0][n - k:] for s, (n, k) in enumerate(zip(ctx_lens, new))])
    p_new = torch.cat([keys[s][1][n - k:] for s, (n, k) in enumerate(zip(ctx_lens, new))])
    write_latents(cache, torch.tensor(slots), c_new, p_new)
    tq = max(new)
    q_index = torch.zeros(3, tq, dtype=torch.long)
    q_pos_pad = torch.full((3, tq), -1)
    out_index = []
    start = 0
    for s, k in enumerate(new):
        q_index[s, :k] = torch.arange(start, start + k)
        q_pos_pad[s, :k] = q_pos[s]
        out_index += [s * tq + j for j in range(k)]
        start += k
    scale = 0.3
    got = paged_latent_attention(torch.cat(q_lat), torch.cat(q_pe), cache, block_tables, q_index, q_pos_pad,
                                 torch.tensor(out_index), r, scale, tile_tokens=tile_tokens)
    ref = torch.cat([latent_attention_ref(q_lat[s], q_pe[s], keys[s][0], keys[s][1], scale, q_pos[s],
                                          torch.arange(ctx_lens[s])) for s in range(3)])
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
