"""Prefix caching end to end: a block is reused only under the same whole prefix (its hash chains through
its parent), and cached KV gives the dense oracle's greedy output."""
import pytest
from engine_helpers import assert_greedy_equal, dense_greedy, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_checkpoint(), executor="inline", dtype="float32", block_size=BLOCK, max_num_seqs=4) as llm:
        yield llm


def generate(llm, ids):
    return llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)[0]


def test_a_block_seen_after_another_prefix_is_not_reused(llm):
    p, q, r, s = prompts(4, BLOCK, BLOCK, seed=31)
    first = generate(llm, p + q + r[:5])
    assert first.num_cached_tokens == 0
    # Q is cached only as the block after P; at the start of a prompt its KV would be another one.
    moved = generate(llm, q + r)
    assert moved.num_cached_tokens == 0
    assert_greedy_equal(moved.outputs[0].token_ids, *dense_greedy(tiny_checkpoint(), q + r, 8))
    # The same two blocks in place are reused, and give the oracle's output.
    again = generate(llm, p + q + s)
    assert again.num_cached_tokens == 2 * BLOCK
    assert_greedy_equal(again.outputs[0].token_ids, *dense_greedy(tiny_checkpoint(), p + q + s, 8))
    # Q after another first block: nothing can be shared.
    other = generate(llm, s + q + r[:3])
    assert other.num_cached_tokens == 0
    assert_greedy_equal(other.outputs[0].token_ids, *dense_greedy(tiny_checkpoint(), s + q + r[:3], 8))


def test_eviction_takes_the_least_recently_used_prefix_tail_first():
    # 8 blocks of 4 tokens. Each 9-token prompt leaves 2 full blocks cached when it finishes.
    old, new, hog = prompts(3, 9, 9, seed=32)
    hog = hog + prompts(1, 8, 8, seed=33)[0]          # 17 tokens: 5 blocks
    with LLM(tiny_checkpoint(), executor="inline", dtype="float32", block_size=4, num_kv_blocks=8,
             max_model_len=32) as small:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

        def cached(ids):
            return small.generate(prompt_token_ids=[ids], sampling_params=one, use_tqdm=False)[0].num_cached_tokens

        assert cached(old) == 0 and cached(new) == 0
        # The hog needs 5 blocks: the 4 free ones and one evicted, the oldest prefix's tail.
        assert cached(hog) == 0
        assert cached(new[:8] + [1]) == 8, "the most recently used prefix was evicted"
        assert cached(old[:8] + [1]) == 4, "the oldest prefix's tail should have gone, and only it"
