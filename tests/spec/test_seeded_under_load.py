"""A seeded request's tokens do not depend on the load (issue 34, item 7).

The default model speculates with its shipped DFlash drafter, whose drafts at T > 0 come with q, and
drafting switches off when more sequences run than `--speculative-disable-batch-size` (8). A seeded row is
verified by exact match against the target's own seeded samples (`spec/verify.py`), so the same seeded
request at T = 0.8 gives the same tokens alone (drafting), beside a dozen others (not drafting) and with
speculation off: up to near-ties of the target (`assert_same_outputs`: the three runs compute the rows in
GEMMs of other shapes). Under the ratio rule min(1, p/q) the first two differ within a few tokens.
"""
from engine_helpers import assert_same_outputs

from namazu import LLM, SamplingParams
from namazu.assets import default_model_path
from namazu.spec.selection import AUTO_DISABLE_BATCH_SIZE

PROMPT = "Tell me a story about a fox and a crow."
OTHERS = [f"Question {i}: name a colour, a number and a city." for i in range(AUTO_DISABLE_BATCH_SIZE + 4)]
SEEDED = [SamplingParams(temperature=0.8, seed=1234, max_tokens=32, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=77, n=2, max_tokens=32, ignore_eos=True)]


def run(prompts: list[str], params: list[SamplingParams], **kw):
    with LLM(executor="inline", **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.get_stats()
        drafter = llm.engine.drafter
    return ([[c.token_ids for c in o.outputs] for o in outs[:len(SEEDED)]],
            [o.prompt_token_ids for o in outs[:len(SEEDED)]], stats, drafter)


def test_seeded_tokens_are_the_same_alone_under_load_and_without_speculation():
    alone, ids, stats, drafter = run([PROMPT] * len(SEEDED), SEEDED)
    assert drafter is not None and stats.num_draft_tokens > 0            # the shipped drafter drafted
    assert stats.num_accepted_draft_tokens > 0                           # and the rule kept some drafts
    # Beside a dozen others (unseeded, T = 0.8, outlasting the seeded ones): drafting switched off.
    others = [SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)] * len(OTHERS)
    loaded, _, loaded_stats, _ = run([PROMPT] * len(SEEDED) + OTHERS, SEEDED + others)
    assert loaded_stats.num_spec_disabled_steps > 0
    plain, _, plain_stats, _ = run([PROMPT] * len(SEEDED), SEEDED, num_speculative_tokens=0)
    assert plain_stats.num_draft_tokens == 0
    path = str(default_model_path())
    assert_same_outputs(path, ids, SEEDED, alone, plain)
    assert_same_outputs(path, ids, SEEDED, loaded, plain)


def test_only_a_requests_own_seed_marks_its_rows_seeded():
    """Engine-drawn seeds are negative, so the worker keeps the ratio rule (the higher acceptance rate)
    for requests that did not ask for reproducible draws."""
    import torch

    from namazu.layers.sampler import seeded_rows

    with LLM(executor="inline", num_speculative_tokens=0) as llm:
        engine = llm.engine
        engine.add_request("a", PROMPT, SamplingParams(temperature=0.8, n=3))
        engine.add_request("b", PROMPT, SamplingParams(temperature=0.8, n=3, seed=2**63 - 1))
        seeds = {s.request_id: [] for s in engine.scheduler.waiting}
        for s in engine.scheduler.waiting:
            seeds[s.request_id].append(s.seed)
        engine.abort_request(["a", "b"])
    assert not seeded_rows(torch.tensor(seeds["a"])).any()
    assert seeded_rows(torch.tensor(seeds["b"])).all() and len(set(seeds["a"] + seeds["b"])) == 6
