"""Tree attention over the paged latent cache: a draft tree's verify rows see the context and their own
ancestors only; after acceptance the accepted path's latents sit at the slots of their positions."""
import pytest
import torch

from namazu.kernels.paged_mla import move_slots, paged_latent_attention, path_slots, write_latents
from namazu.layers.mla import latent_attention_ref
from namazu.spec.tree import TreeTopology, tree_block_mask

H, R, DR, BS, NUM_BLOCKS = 3, 16, 4, 4, 48
SCALE = 0.3


def _layout(g, lens):
    """Scattered block tables for sequences of `lens` slots."""
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-n // BS)
        tables.append(perm[used:used + nb])
        used += nb
    m = max(len(t) for t in tables)
    return tables, torch.tensor([t + [0] * (m - len(t)) for t in tables])


def _slot(table, p):
    return table[p // BS] * BS + p % BS


@pytest.mark.parametrize("tile_tokens", [8, 256, None])
def test_tree_rows_see_the_context_and_their_ancestors_only(tile_tokens):
    """A batch of a draft tree (after 11 context tokens), a decode and a prefill chunk, against two oracles:
    the dense reference with the same visibility, and, per tree row, plain causal attention over a sequence
    that holds the context followed by that row's ancestors in order (what the row would see in a chain)."""
    g = torch.Generator().manual_seed(0)
    topo = TreeTopology.build(9, 4, 3)
    tt = topo.tensors()
    rows = len(topo.parents)
    ctx = [11, 17, 5]
    new = [rows, 1, 6]
    lens = [c + n for c, n in zip(ctx, new)]
    tables, block_tables = _layout(g, lens)
    cache = torch.zeros(NUM_BLOCKS, BS, R + DR)
    keys = [(torch.randn(n, R, generator=g), torch.randn(n, DR, generator=g)) for n in lens]
    slots, q_lat, q_pe = [], [], []
    for s, (c, n) in enumerate(zip(ctx, new)):
        for p in range(c):
            cache.view(-1, R + DR)[_slot(tables[s], p)] = torch.cat([keys[s][0][p], keys[s][1][p]])
        slots += [_slot(tables[s], p) for p in range(c, c + n)]
        q_lat.append(torch.randn(n, H, R, generator=g))
        q_pe.append(torch.randn(n, H, DR, generator=g))
    write_latents(cache, torch.tensor(slots), torch.cat([k[0][c:] for k, c in zip(keys, ctx)]),
                  torch.cat([k[1][c:] for k, c in zip(keys, ctx)]))
    tq = max(new)
    q_index = torch.zeros(3, tq, dtype=torch.long)
    q_pos = torch.full((3, tq), -1)
    out_index, start = [], 0
    for s, (c, n) in enumerate(zip(ctx, new)):
        q_index[s, :n] = torch.arange(start, start + n)
        q_pos[s, :n] = torch.arange(c, c + n)            # slot indices: the tree's rows in node order
        out_index += [s * tq + j for j in range(n)]
        start += n
    mask = tree_block_mask(tt, torch.tensor([True, False, False]), tq)
    got = paged_latent_attention(torch.cat(q_lat), torch.cat(q_pe), cache, block_tables, q_index, q_pos,
                                 torch.tensor(out_index), R, SCALE, tile_tokens=tile_tokens, tree_mask=mask)
    # Dense reference with the tree's visibility for sequence 0, causal for the others.
    vis0 = torch.cat([torch.ones(rows, ctx[0], dtype=torch.bool), tt.ancestors], 1)
    ref = [latent_attention_ref(q_lat[0], q_pe[0], *keys[0], SCALE, None, None, visible=vis0)]
    ref += [latent_attention_ref(q_lat[s], q_pe[s], *keys[s], SCALE, torch.arange(ctx[s], lens[s]),
                                 torch.arange(lens[s])) for s in (1, 2)]
    torch.testing.assert_close(got, torch.cat(ref), atol=1e-5, rtol=1e-5)
    # The chain oracle: row i over [context ; its ancestors in depth order], causal, as its last query.
    for i in range(rows):
        anc = torch.nonzero(tt.ancestors[i]).flatten()        # increasing index = increasing depth
        ckv = torch.cat([keys[0][0][:ctx[0]], keys[0][0][ctx[0] + anc]])
        kpe = torch.cat([keys[0][1][:ctx[0]], keys[0][1][ctx[0] + anc]])
        n = ckv.shape[0]
        want = latent_attention_ref(q_lat[0][i:i + 1], q_pe[0][i:i + 1], ckv, kpe, SCALE,
                                    torch.tensor([n - 1]), torch.arange(n))
        torch.testing.assert_close(got[i:i + 1], want, atol=1e-5, rtol=1e-5)
    # Without the mask the tree's rows would see their siblings: the mask is what makes them differ.
    plain = paged_latent_attention(torch.cat(q_lat), torch.cat(q_pe), cache, block_tables, q_index, q_pos,
                                   torch.tensor(out_index), R, SCALE, tile_tokens=tile_tokens)
    assert (plain[:rows] - got[:rows]).abs().max() > 1e-2
    torch.testing.assert_close(plain[rows:], got[rows:])


def test_the_accepted_path_moves_to_its_positions_in_every_cache():
    """After a step that accepted a path, the target's latent stack and the drafter's context cache hold
    the path's entries at root + 1 .. root + n, in order; a query after them attends exactly as over the
    sequence of the accepted tokens."""
    g = torch.Generator().manual_seed(1)
    topo = TreeTopology.build(10, 4, 3)
    rows, layers = len(topo.parents), 2
    roots = [9, 14]                                           # the root's slot (= its position)
    tables, block_tables = _layout(g, [r + rows + 1 for r in roots])
    kv = torch.randn(layers, NUM_BLOCKS, BS, R + DR, generator=g)
    drafter = torch.randn(layers, 2, NUM_BLOCKS * BS, 2, 8, generator=g)
    before_kv, before_dr = kv.clone(), drafter.clone()
    # Sequence 0 accepted the deepest path through a non-first sibling; sequence 1 nothing.
    def ancestry(i):
        out = []
        while i > 0:
            out.append(i)
            i = topo.parents[i]
        return out[::-1]

    chain = max((ancestry(i) for i in range(rows) if any(topo.ranks[c] > 0 for c in ancestry(i))), key=len)
    assert len(chain) >= 3
    path = torch.full((2, topo.depth), -1)
    path[0, :len(chain)] = torch.tensor(chain)
    num = torch.tensor([len(chain), 0])
    root_pos = torch.tensor(roots)
    src, dst = path_slots(block_tables, BS, root_pos, path, num)
    move_slots(kv.view(layers, -1, R + DR), 1, src, dst)
    move_slots(drafter, 2, src, dst)
    flat_kv, flat_b = kv.view(layers, -1, R + DR), before_kv.view(layers, -1, R + DR)
    for j, node in enumerate(chain):
        to, frm = _slot(tables[0], roots[0] + 1 + j), _slot(tables[0], roots[0] + node)
        assert torch.equal(flat_kv[:, to], flat_b[:, frm])
        assert torch.equal(drafter[:, :, to], before_dr[:, :, frm])
    # The context, the root, and everything of the sequence that accepted nothing are untouched.
    for p in range(roots[0] + 1):
        assert torch.equal(flat_kv[:, _slot(tables[0], p)], flat_b[:, _slot(tables[0], p)])
    for p in range(roots[1] + rows):
        assert torch.equal(flat_kv[:, _slot(tables[1], p)], flat_b[:, _slot(tables[1], p)])
    # A query at the next position sees context + root + the path, as a chain would have stored them.
    n = roots[0] + 1 + len(chain)
    seq = torch.stack([flat_b[0, _slot(tables[0], p)] for p in range(roots[0] + 1)]
                      + [flat_b[0, _slot(tables[0], roots[0] + c)] for c in chain])
    q_lat, q_pe = torch.randn(1, H, R, generator=g), torch.randn(1, H, DR, generator=g)
    got = paged_latent_attention(q_lat, q_pe, kv[0], block_tables[:1], torch.zeros(1, 1, dtype=torch.long),
                                 torch.tensor([[n - 1]]), torch.tensor([0]), R, SCALE)
    want = latent_attention_ref(q_lat, q_pe, seq[:, :R], seq[:, R:], SCALE, torch.tensor([n - 1]), torch.arange(n))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_graph_op_takes_the_tree_mask():
    """`namazu::paged_mla` (what a compiled step calls) passes the mask through, traced and eager."""
    from namazu.kernels import graph_ops  # noqa: F401  (registers the op)

    g = torch.Generator().manual_seed(2)
    tt = TreeTopology.build(5, 3, 2).tensors()
    rows = tt.parents.shape[0]
    cache = torch.randn(NUM_BLOCKS, BS, R + DR, generator=g)
    block_tables = torch.arange(4).view(1, 4)
    q_lat, q_pe = torch.randn(rows, H, R, generator=g), torch.randn(rows, H, DR, generator=g)
    q_index = torch.arange(rows).view(1, rows)
    q_pos = torch.arange(7, 7 + rows).view(1, rows)
    mask = tree_block_mask(tt, torch.tensor([True]), rows)
    args = (q_lat, q_pe, cache, block_tables, q_index, q_pos, torch.arange(rows), R, SCALE)
    want = paged_latent_attention(*args, tree_mask=mask)

    def step(*a):
        return torch.ops.namazu.paged_mla(*a, tree_mask=mask)

    torch.testing.assert_close(step(*args), want)
    torch.testing.assert_close(torch.compile(step, backend="eager", fullgraph=True)(*args), want)
