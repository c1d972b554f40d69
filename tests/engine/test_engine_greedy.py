"""End to end (fp32, CPU): greedy outputs equal the dense no-cache oracle, and stay identical with prefix
caching on/off, chunked prefill on/off, forced preemption, and batch 1 vs 16."""
import pytest
from engine_helpers import assert_greedy_equal, assert_same_outputs, dense_greedy, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(prompt_ids, **engine_args):
    with LLM(tiny_checkpoint(), executor="inline", **engine_args) as llm:
        outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.get_stats()


@pytest.fixture(scope="module")
def shared_prompts():
    # A shared 40-token "system prompt" so prefix caching has something to share.
    return prompts(16, lo=2, hi=30, seed=1, prefix=prompts(1, 40, 40, seed=2)[0])


@pytest.fixture(scope="module")
def reference(shared_prompts):
    return [dense_greedy(tiny_checkpoint(), p, MAX_TOKENS) for p in shared_prompts]


def check(outs, reference):
    for got, (ref, gaps) in zip(outs, reference):
        assert_greedy_equal(got, ref, gaps)


def test_batched_engine_matches_dense_oracle(shared_prompts, reference):
    outs, _ = generate(shared_prompts)
    check(outs, reference)


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_on_and_off(shared_prompts, reference, caching):
    with LLM(tiny_checkpoint(), executor="inline", enable_prefix_caching=caching, max_num_seqs=4) as llm:
        first = llm.generate(prompt_token_ids=shared_prompts[:1], sampling_params=GREEDY, use_tqdm=False)
        rest = llm.generate(prompt_token_ids=shared_prompts[1:], sampling_params=GREEDY, use_tqdm=False)
        stats = llm.engine.get_stats()
    check([o.outputs[0].token_ids for o in first + rest], reference)
    if caching:
        assert stats.prefix_cache_hit_rate > 0.4
        assert all(o.num_cached_tokens >= 32 for o in rest)
    else:
        assert stats.prefix_cache_hit_rate == 0


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill_on_and_off(shared_prompts, reference, chunked):
    budget = 16 if chunked else 128     # 16 < every prompt: each is split over several steps
    outs, _ = generate(shared_prompts, enable_chunked_prefill=chunked, max_num_batched_tokens=budget,
                       max_num_seqs=16, enable_prefix_caching=False)
    check(outs, reference)


def test_forced_preemption_by_a_tiny_block_pool(shared_prompts, reference):
    # 30 blocks x 4 = 120 token slots for 16 sequences of up to ~82 tokens: constant preemption.
    outs, stats = generate(shared_prompts, num_kv_blocks=30, block_size=4, max_model_len=96)
    assert stats.num_preemptions > 0
    check(outs, reference)


def test_batch_of_one_equals_batch_of_sixteen_in_one_step(shared_prompts, reference):
    with LLM(tiny_checkpoint(), executor="inline", max_num_seqs=16) as llm:
        sizes = []
        submit = llm.engine.executor.submit
        llm.engine.executor.submit = lambda b: (sizes.append(b.num_sampling), submit(b))[1]
        together = llm.generate(prompt_token_ids=shared_prompts, sampling_params=GREEDY, use_tqdm=False)
        alone = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0]
                 for p in shared_prompts[:4]]
    assert max(sizes) == 16, "16 sequences never shared a step"
    check([o.outputs[0].token_ids for o in together], reference)
    # Alone, a sequence's rows are products of M = 1; together, of M = 16: equal up to near-ties.
    assert_same_outputs(tiny_checkpoint(), shared_prompts[:4], GREEDY, [a.outputs[0].token_ids for a in alone],
                        [t.outputs[0].token_ids for t in together[:4]])
