"""Prefix-cache isolation by `cache_salt` (issue 34, item 12): requests with different salts never share a
block (the second's cached tokens are 0, whatever the prompt), the same salt shares, an unsalted request
shares only with unsalted ones; the replica publishes the hashes a router computes for a salted prompt
(the same root, from the same salt); a bad salt is refused naming the field."""
import dataclasses

import httpx
import pytest
from engine_helpers import prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.scheduler.block_hash import ROOT_HASH, extend_block_hashes, root_hash
from namazu.scheduler.kv_events import prompt_block_hashes

BLOCK = 16
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_checkpoint(), executor="inline", block_size=BLOCK, max_num_seqs=4,
             num_speculative_tokens=0) as llm:
        yield llm


def cached(llm, ids, salt=None) -> int:
    params = dataclasses.replace(ONE, cache_salt=salt)
    return llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0].num_cached_tokens


def test_different_salts_share_no_block_and_the_same_salt_shares(llm):
    p = prompts(1, 3 * BLOCK + 5, 3 * BLOCK + 5, seed=41)[0]
    assert cached(llm, p, "tenant-a") == 0
    assert cached(llm, p, "tenant-b") == 0                      # same prompt, another tenant: nothing
    assert cached(llm, p) == 0                                  # unsalted: nothing of either tenant's
    assert cached(llm, p, "tenant-a") == 3 * BLOCK              # the same salt shares
    assert cached(llm, p, "tenant-b") == 3 * BLOCK
    assert cached(llm, p) == 3 * BLOCK                          # and unsalted requests share among themselves
    # A salt is part of the whole chain, not only its first block: a tenant's second block is never found
    # under another salt even after a first block of its own.
    q = prompts(1, 2 * BLOCK + 3, 2 * BLOCK + 3, seed=42)[0]
    assert cached(llm, q[:BLOCK] + [1], "tenant-c") == 0
    assert cached(llm, q, "tenant-d") == 0
    assert cached(llm, q, "tenant-c") == BLOCK                  # its own first block only


def test_the_chain_starts_at_the_salts_root():
    tokens = list(range(40))
    assert root_hash(None) == ROOT_HASH
    assert len({root_hash(None), root_hash("a"), root_hash("b"), root_hash("ab")}) == 4
    a, b = prompt_block_hashes(tokens, 8, "a"), prompt_block_hashes(tokens, 8, "b")
    assert a == extend_block_hashes([], tokens, 8, root_hash("a")) and len(a) == 5
    assert not set(a) & set(b) and not set(a) & set(prompt_block_hashes(tokens, 8))


def test_the_replica_publishes_what_the_router_computes_for_a_salted_prompt():
    from namazu.tokenizer import Tokenizer
    from server.router.policy import make_policy
    from server.router.pool import ReplicaPool
    from server.router.proxy import Router

    text = "a shared system prompt, long enough to fill several blocks of sixteen tokens each, " * 2
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, json={})))
    router = Router(ReplicaPool(["http://r:1"], client), make_policy("kv", 4.0, 1.0, 0, 2.0),
                    Tokenizer.from_pretrained(tiny_checkpoint()), client, None, BLOCK)
    try:
        with LLM(tiny_checkpoint(), executor="inline", block_size=BLOCK, num_speculative_tokens=0) as llm:
            for salt in ("tenant-a", None):
                body = {"prompt": text} | ({"cache_salt": salt} if salt else {})
                _, ids, hashes, _, _ = router.prepare("/v1/completions", httpx.Request("POST", "http://x", json=body)
                                                   .content)
                after = llm.engine.kv_events.last_id
                llm.generate([text], dataclasses.replace(ONE, cache_salt=salt), use_tqdm=False)
                page = llm.engine.kv_events.since(after)
                stored = [h for e in page["events"] if e["type"] == "stored" for h in e["block_hashes"]]
                assert len(hashes) >= 4 and hashes == prompt_block_hashes(ids, BLOCK, salt)
                assert set(hashes[:(len(ids) - 1) // BLOCK]) <= set(stored), salt
            # The salted and the unsalted prompt were stored under disjoint hashes.
            assert prompt_block_hashes(ids, BLOCK, "tenant-a")[0] != prompt_block_hashes(ids, BLOCK)[0]
    finally:
        router.close()


@pytest.mark.parametrize("salt", ["", "x" * 257, 7, ["a"]])
def test_a_bad_salt_is_refused_naming_the_field(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=salt)
