"""BadWordsGrammar: vLLM's bad-words rule behind the grammar seam (bans only the token that would complete a
word, rolls back with the drafts it validated)."""
import numpy as np
import torch

from namazu.layers.sampler import unpack_bitmask
from namazu.structured.bad_words import BadWordsGrammar
from namazu.structured.grammar import token_mask_words

V = 64


def allowed(g) -> set[int]:
    mask = np.full((1, token_mask_words(V)), -1, dtype=np.int32)
    g.fill_bitmask(mask, 0)
    return set(torch.nonzero(unpack_bitmask(torch.from_numpy(mask), V)[0]).flatten().tolist())


def test_bans_the_completing_token_only():
    g = BadWordsGrammar([[5], [1, 2, 3]], V)
    assert allowed(g) == set(range(V)) - {5}
    assert g.accept_tokens([1, 2])
    assert allowed(g) == set(range(V)) - {5, 3}
    assert not g.accept_tokens([3]) and g.history == [1, 2]          # refused, unchanged
    assert g.validate_tokens([4, 1, 2, 3]) == 3                       # the word completes at the 4th
    assert g.validate_tokens([5]) == 0
    g.rollback(1)
    assert g.history == [1] and allowed(g) == set(range(V)) - {5}
    assert not g.accept_tokens([2, 3])                                 # 1 2 3 again
    g.rollback(1)
    assert g.accept_tokens([2, 3])                                     # "2 3" without the 1 is fine
