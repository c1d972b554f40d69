"""Grammar rows of a draft tree (namazu/structured/tree_masks.py): node i's row is the grammar's mask after the
path root..i, nodes the grammar rejects leave their subtree unmasked and the walk leaves the grammar where it
was; a tree is cut before the first node that ends the grammar; the engine's step bitmask takes the tree rows
when it is given a topology."""
import numpy as np
import pytest
import torch

from namazu.layers.sampler import unpack_bitmask
from namazu.spec.tree import TreeTopology
from namazu.structured.automaton import AutomatonGrammar
from namazu.structured.grammar import PLACEHOLDER, MinTokensGrammar, token_mask_words
from namazu.structured.tree_masks import fill_tree_rows, usable_tree_nodes

VOCAB = 64
EOS = 63
A, B = list(range(0, 8)), list(range(8, 16))


def ab(length: int) -> AutomatonGrammar:
    """`length` tokens alternating A, B, A, ..., then EOS."""
    return AutomatonGrammar({i: {t: i + 1 for t in (A if i % 2 == 0 else B)} for i in range(length)}, {length},
                            end_ids=[EOS], vocab_size=VOCAB)


def allowed(mask: np.ndarray) -> list[set[int]]:
    bits = unpack_bitmask(torch.from_numpy(mask), VOCAB)
    return [set(torch.nonzero(row).flatten().tolist()) for row in bits]


# Root 0; nodes 1, 2 its children; 3, 4 children of 1; 5 child of 2; 6 child of 3.
PARENTS = (-1, 0, 0, 1, 1, 2, 3)


def test_each_node_row_is_the_grammar_after_its_own_path():
    g = ab(6)
    g.accept_tokens([0])              # committed: one A; the root's row allows B
    drafts = [8, 9, 1, 2, 3, 12]      # node 1 (B), 2 (B), 3 (A under 1), 4 (A under 1), 5 (A under 2), 6 (B under 3)
    mask = np.full((7, token_mask_words(VOCAB)), -1, dtype=np.int32)
    fill_tree_rows(g, mask, 0, 0, drafts, PARENTS)
    rows = allowed(mask)
    assert rows[0] == set(B)
    assert rows[1] == rows[2] == set(A)          # after B at depth 1
    assert rows[3] == rows[4] == rows[5] == set(B)
    assert rows[6] == set(A)
    assert g.history == [0, 1]                   # the grammar is where it was


def test_a_rejected_node_and_its_subtree_keep_unmasked_rows():
    g = ab(6)
    g.accept_tokens([0])
    drafts = [8, 1, 2, 3, 4, 5]        # node 2 is an A where B is due: rejected, so is its child 5
    mask = np.full((7, token_mask_words(VOCAB)), -1, dtype=np.int32)
    fill_tree_rows(g, mask, 0, 0, drafts, PARENTS)
    rows = allowed(mask)
    everything = set(range(VOCAB))
    assert rows[0] == set(B) and rows[1] == set(A)
    assert rows[2] == everything and rows[5] == everything
    # Node 3 (token 2, an A under 1) is accepted; node 4 (token 3, an A) too; 6 (token 5, an A after A) is not.
    assert rows[3] == set(B) and rows[4] == set(B) and rows[6] == everything
    assert g.history == [0, 1]


def test_rows_by_depth_for_a_value_independent_grammar():
    """Placeholders (values unknown to the host): min_tokens counts each node's depth, not its index."""
    g = MinTokensGrammar(3, [EOS], VOCAB)
    topo = TreeTopology.build(8, 4, 3)
    k = topo.num_nodes
    mask = np.full((k + 1, token_mask_words(VOCAB)), -1, dtype=np.int32)
    fill_tree_rows(g, mask, 0, 1, [PLACEHOLDER] * k, topo.parents)       # one token pending: count 1 first
    rows = allowed(mask)
    for node, depth in enumerate(topo.depths):
        assert (EOS in rows[node]) == (1 + depth >= 3), (node, depth)
    assert g.count == 0


def test_the_tree_is_cut_before_the_first_node_that_ends_the_grammar():
    g = ab(2)
    g.accept_tokens([0])              # one B then EOS completes it
    # Node 1: B (accepted, grammar now complete); node 2: A (rejected); node 3: EOS under 1 (ends it);
    # node 4: B under 1 (rejected); node 5: EOS under the rejected node 2 (never reachable: no cut).
    drafts = [8, 1, EOS, 9, EOS, 5]
    assert usable_tree_nodes(g, drafts, PARENTS, {EOS}) == 2
    assert g.history == [0, 1]
    # A stop token the grammar does not accept never cuts the tree.
    assert usable_tree_nodes(g, [EOS, 8, 1, 2, 3, 4], PARENTS, {EOS}) == 6
    # A grammar that terminates on a token that is not a stop token cuts there too.
    done = ab(2)
    done.accept_tokens([0])
    assert usable_tree_nodes(done, [8, 9, EOS, 1, 2, 3], PARENTS, set()) == 2


def test_fewer_planned_nodes_than_the_topology_has():
    g = ab(6)
    mask = np.full((3, token_mask_words(VOCAB)), -1, dtype=np.int32)
    fill_tree_rows(g, mask, 0, 0, [0, 1], PARENTS)
    assert allowed(mask) == [set(A), set(B), set(B)]
    with pytest.raises(ValueError, match="topology"):
        fill_tree_rows(g, np.full((9, 2), -1, dtype=np.int32), 0, 0, [0] * 8, PARENTS)
