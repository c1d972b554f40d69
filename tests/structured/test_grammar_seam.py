"""The grammar seam (namazu/structured): the test grammar's protocol, bitmask rows for draft and bonus
positions, and the engine wiring end to end with and without speculation: no sampled token outside the
grammar, the grammar advanced by exactly the committed tokens (drafts rolled back), termination when
the grammar completes."""
import numpy as np
import pytest
import torch
from engine_helpers import prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.assets.random_model import EOS, SPECIAL_TOKENS
from namazu.layers.sampler import unpack_bitmask
from namazu.spec.drafters import ScriptedDrafter
from namazu.structured.automaton import AutomatonGrammar
from namazu.structured.bitmask import fill_sequence_rows
from namazu.structured.grammar import AllOf, MinTokensGrammar, TokenSetGrammar, token_mask_words

VOCAB = 264
EOS_ID = 256 + SPECIAL_TOKENS.index(EOS)
LOW, HIGH = list(range(97, 104)), list(range(48, 54))     # "a".."g", "0".."5"
LENGTH = 9


def chain(length: int = LENGTH) -> tuple[dict[int, dict[int, int]], set[int]]:
    """Exactly `length` tokens alternating between LOW and HIGH, then the end token."""
    return {i: {t: i + 1 for t in (LOW if i % 2 == 0 else HIGH)} for i in range(length)}, {length}


def allowed_rows(mask: np.ndarray) -> list[set[int]]:
    bits = unpack_bitmask(torch.from_numpy(mask), VOCAB)
    return [set(torch.nonzero(row).flatten().tolist()) for row in bits]


def test_automaton_protocol():
    g = AutomatonGrammar(*chain(3), end_ids=[EOS_ID], vocab_size=VOCAB)
    assert g.validate_tokens([97, 48, 98, EOS_ID, 97]) == 4 and g.state == 0
    assert not g.accept_tokens([48]) and g.state == 0
    assert g.accept_tokens([97, 48]) and g.state == 2
    g.rollback(1)
    assert g.state == 1
    with pytest.raises(ValueError):
        g.rollback(5)
    assert g.accept_tokens([49, 100])
    mask = np.full((1, token_mask_words(VOCAB)), -1, dtype=np.int32)
    g.fill_bitmask(mask, 0)
    assert allowed_rows(mask) == [{EOS_ID}]          # complete: only the end token
    assert not g.is_terminated() and g.accept_tokens([EOS_ID]) and g.is_terminated()
    g.fill_bitmask(mask, 0)
    assert allowed_rows(mask) == [set()]


def test_rows_for_drafts_and_bonus_leave_the_grammar_where_it_was():
    g = AutomatonGrammar(*chain(), end_ids=[EOS_ID], vocab_size=VOCAB)
    g.accept_tokens([97])
    mask = np.full((4, token_mask_words(VOCAB)), -1, dtype=np.int32)
    fill_sequence_rows(g, mask, 0, 0, [48, 98, 49])
    assert allowed_rows(mask) == [set(HIGH), set(LOW), set(HIGH), set(LOW)]
    assert g.state == 1 and len(g.history) == 2
    # A value-independent grammar takes pending tokens as placeholders and rolls them back too.
    m = MinTokensGrammar(3, [EOS_ID], VOCAB)
    mask = np.full((3, token_mask_words(VOCAB)), -1, dtype=np.int32)
    fill_sequence_rows(m, mask, 0, 1, [-1, -1])
    rows = allowed_rows(mask)
    assert EOS_ID not in rows[0] and EOS_ID not in rows[1] and EOS_ID in rows[2] and m.count == 0


def test_composed_grammars_and_token_sets():
    both = AllOf([TokenSetGrammar(LOW + [EOS_ID], VOCAB), MinTokensGrammar(2, [EOS_ID], VOCAB)])
    assert both.validate_tokens([97, EOS_ID]) == 1 and both.validate_tokens([97, 98, EOS_ID]) == 3
    assert both.validate_tokens([97, 48]) == 1
    assert both.accept_tokens([97, 98])
    mask = np.full((1, token_mask_words(VOCAB)), -1, dtype=np.int32)
    both.fill_bitmask(mask, 0)
    assert allowed_rows(mask) == [set(LOW) | {EOS_ID}]


def follows_chain(tokens: list[int], length: int = LENGTH) -> bool:
    body = tokens[:-1] if tokens and tokens[-1] == EOS_ID else tokens
    ok = all(t in (LOW if i % 2 == 0 else HIGH) for i, t in enumerate(body))
    return ok and len(body) <= length


def run(params, drafter=None, k=0, **kw):
    made: list[AutomatonGrammar] = []

    def factory():
        made.append(AutomatonGrammar(*chain(), end_ids=[EOS_ID], vocab_size=VOCAB))
        return made[-1]

    params = [SamplingParams(**{**p, "grammar_factory": factory}) for p in params]
    with LLM(tiny_checkpoint(), executor="inline", drafter=drafter, num_speculative_tokens=k, **kw) as llm:
        outs = llm.generate(prompt_token_ids=BATCH, sampling_params=params, use_tqdm=False)
        stats = llm.engine.get_stats()
    return [o.outputs[0] for o in outs], made, stats


BATCH = prompts(6, lo=3, hi=20, seed=31)
GREEDY = [dict(temperature=0, max_tokens=40)] * len(BATCH)
SAMPLED = [dict(temperature=1.0, seed=i, max_tokens=40) for i in range(len(BATCH))]


@pytest.mark.parametrize("mode", [None, "right", "wrong", "random"])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_grammar_end_to_end(mode, sampling):
    params = GREEDY if sampling == "greedy" else SAMPLED
    base, _, _ = run(params)
    drafter = None
    if mode is not None:
        reference = {tuple(p): o.token_ids for p, o in zip(BATCH, base)}
        drafter = ScriptedDrafter(mode, VOCAB, reference, seed=2)
    outs, grammars, stats = run(params, drafter, k=3 if drafter else 0)
    for o, g in zip(outs, grammars):
        assert follows_chain(o.token_ids), o.token_ids
        # Terminated by the grammar: exactly LENGTH tokens, then the end token, well before max_tokens.
        assert o.finish_reason == "stop" and len(o.token_ids) == LENGTH + 1 and o.token_ids[-1] == EOS_ID
        # The grammar saw exactly the committed tokens: every draft it was shown was rolled back.
        assert len(g.history) == len(o.token_ids) + 1 and g.is_terminated()
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]   # speculation changes nothing
    if mode is not None:
        assert stats.num_draft_tokens > 0
    if mode == "right":
        assert stats.num_accepted_draft_tokens > 0


def test_grammar_with_async_scheduling_and_speculation():
    reference = {tuple(p): o.token_ids for p, o in zip(BATCH, run(GREEDY)[0])}
    outs, grammars, stats = run(GREEDY, ScriptedDrafter("right", VOCAB, reference), k=3, async_scheduling=True)
    assert [o.token_ids for o in outs] == list(reference.values())
    assert all(len(g.history) == len(o.token_ids) + 1 for o, g in zip(outs, grammars))
    assert stats.num_accepted_draft_tokens > 0


def test_max_tokens_inside_an_unfinished_structure_is_length():
    outs, grammars, _ = run([dict(temperature=0, max_tokens=4)] * len(BATCH))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 4 and follows_chain(o.token_ids) for o in outs)
    assert not any(g.is_terminated() for g in grammars)
