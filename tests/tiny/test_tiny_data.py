"""namazu-tiny data: the chat/tool-call generator is deterministic, valid, and keeps held-out schemas out."""
import json

import jsonschema
import pytest
from tiny_fixtures import small_moe_model, write_mini_corpus

from namazu.tiny.baselines import CharTrigramModel, UnigramModel, bits_per_byte, sanity_normalised
from namazu.tiny.data import ChatDataConfig, generate_chat_examples, heldout_tool_prompts
from namazu.tiny.evaluate import parse_tool_calls
from namazu.tiny.tools import HELDOUT_TOOLS, TRAIN_TOOLS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_mini_corpus(tmp_path_factory.mktemp("corpus"))


CFG = ChatDataConfig(seed=7, num_qa=150, num_tool=150)


def test_generator_is_deterministic(corpus):
    a = [e.text for e in generate_chat_examples(corpus, CFG)]
    b = [e.text for e in generate_chat_examples(corpus, CFG)]
    assert a == b
    c = [e.text for e in generate_chat_examples(corpus, ChatDataConfig(seed=8, num_qa=150, num_tool=150))]
    assert a != c
    assert len(a) == 300 and len(set(a)) > 200


def test_tool_transcripts_are_schema_valid_k2_calls(corpus):
    tools = {t.name: t for t in TRAIN_TOOLS}
    examples = generate_chat_examples(corpus, CFG)
    kinds = {e.kind for e in examples}
    assert kinds == {"qa", "tool", "no_call"}
    n = 0
    for ex in examples:
        calls = parse_tool_calls(ex.text)
        if ex.kind != "tool":
            assert calls == []
            continue
        assert len(calls) == 1
        call = calls[0]
        declared = {t["function"]["name"] for t in ex.tools}
        assert call.name in declared and call.call_id == f"functions.{call.name}:0"
        lang = "ja" if ex.tools[0]["function"]["description"] == tools[ex.tools[0]["function"]["name"]].ja else "en"
        jsonschema.validate(json.loads(call.arguments), tools[call.name].schema(lang)["parameters"])
        n += 1
    assert n > 100


def test_heldout_schemas_never_reach_training_data(corpus):
    assert not {t.name for t in TRAIN_TOOLS} & {t.name for t in HELDOUT_TOOLS}
    text = "\n".join(e.text for e in generate_chat_examples(corpus, CFG))
    for t in HELDOUT_TOOLS:
        assert f"\"{t.name}\"" not in text
    prompts = heldout_tool_prompts(corpus, 20)
    for p in prompts:
        assert p.prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
        assert {t["function"]["name"] for t in p.tools} <= {t.name for t in HELDOUT_TOOLS}
        jsonschema.validate(p.reference_arguments, p.schema)
    assert [p.prompt for p in prompts] == [p.prompt for p in heldout_tool_prompts(corpus, 20)]


def test_char_trigram_is_normalised_and_learns(corpus):
    from namazu.tiny.corpus import read_documents

    m = CharTrigramModel(read_documents(corpus, "ja", "train"))
    assert sanity_normalised(m, "パ", "ッ") == pytest.approx(1.0, abs=1e-9)
    assert sanity_normalised(m, "\x02", "\x02") == pytest.approx(1.0, abs=1e-9)
    seen = bits_per_byte(m, read_documents(corpus, "ja", "test"))
    unseen = bits_per_byte(m, ["まったく別の文章であり、学習データには現れない。"])
    assert seen < 1.0 < unseen


def test_unigram_add_one():
    import numpy as np

    u = UnigramModel(np.array([0, 0, 1]), vocab_size=4)  # counts+1: 3, 2, 1, 1 of 7
    assert u.nll(np.array([0, 3])) == pytest.approx(-np.log(3 / 7) - np.log(1 / 7))


def test_sliding_window_nll_matches_one_pass():
    import numpy as np
    import torch

    from namazu.tiny.evaluate import token_nll

    model = small_moe_model()
    model.eval()
    stream = torch.randint(0, 64, (50,))
    one = token_nll(model, stream, seq_len=64, stride=48, batch_size=2)
    with torch.no_grad():
        hidden, _ = model(stream[None, :-1])
        ref = torch.nn.functional.cross_entropy(model.compute_logits(hidden)[0], stream[1:], reduction="none")
    assert np.isnan(one[0])
    np.testing.assert_allclose(one[1:], ref.numpy(), rtol=1e-4, atol=1e-5)
    windows = token_nll(model, stream, seq_len=16, stride=8, batch_size=3)
    assert not np.isnan(windows[1:]).any()
    np.testing.assert_allclose(windows[1:17], ref.numpy()[:16], rtol=1e-4, atol=1e-5)  # first window: full context


def test_procedural_tools_are_distinct_valid_and_never_heldout(corpus):
    from namazu.tiny.tools import procedural_tools

    tools = procedural_tools(120, seed=5)  # the generator composes them from its own seed
    assert tools == procedural_tools(120, seed=5) != procedural_tools(120, seed=6)
    names = [t.name for t in tools]
    assert len(set(names)) == 120
    assert not set(names) & {t.name for t in HELDOUT_TOOLS + TRAIN_TOOLS}
    with pytest.raises(ValueError, match="procedural tools"):
        procedural_tools(10_000, seed=3)
    cfg = ChatDataConfig(seed=5, num_qa=0, num_tool=200, procedural_tools=120)
    by_name = {t.name: t for t in TRAIN_TOOLS + tools}
    used = set()
    for ex in generate_chat_examples(corpus, cfg):
        for call in parse_tool_calls(ex.text):
            fn = next(t["function"] for t in ex.tools if t["function"]["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), fn["parameters"])
            used.add(call.name)
            declared_keys = fn["parameters"]["properties"].keys()
            assert by_name[call.name].schema("ja")["parameters"]["properties"].keys() == declared_keys
    assert len(used & set(names)) > 50


def test_synthetic_tools_are_fresh_valid_and_never_heldout(corpus):
    import random

    from namazu.tiny.synthetic_tools import synthetic_tools

    heldout_keys = {p.key for t in HELDOUT_TOOLS for p in t.props} - {p.key for t in TRAIN_TOOLS for p in t.props}
    rng = random.Random(0)
    tools = [t for _ in range(400) for t in synthetic_tools(rng, 3)]
    names = {t.name for t in tools}
    keys = {p.key for t in tools for p in t.props}
    assert len(names) > 900 and len(keys) > 700  # far too many to remember: they have to be read
    assert not names & {t.name for t in HELDOUT_TOOLS} and not keys & heldout_keys
    cfg = ChatDataConfig(seed=5, num_qa=0, num_tool=300, synthetic_tool_share=1.0, no_call_share=0.0)
    examples = generate_chat_examples(corpus, cfg)
    assert examples == generate_chat_examples(corpus, cfg)
    called = set()
    for ex in examples:
        (call,) = parse_tool_calls(ex.text)
        fn = next(t["function"] for t in ex.tools if t["function"]["name"] == call.name)
        jsonschema.validate(json.loads(call.arguments), fn["parameters"])
        called.add(call.name)
        for t in HELDOUT_TOOLS:
            assert f"\"{t.name}\"" not in ex.text
    assert len(called) > 250
    assert not called & {t.name for t in TRAIN_TOOLS}


def test_synthetic_share_zero_leaves_data_unchanged(corpus):
    # Configs written before fresh tools existed must still generate byte-identical data.
    base = [e.text for e in generate_chat_examples(corpus, CFG)]
    same = ChatDataConfig(**{**CFG.__dict__, "synthetic_tool_share": 0.0})
    assert [e.text for e in generate_chat_examples(corpus, same)] == base
    mixed = ChatDataConfig(**{**CFG.__dict__, "synthetic_tool_share": 0.5})
    assert [e.text for e in generate_chat_examples(corpus, mixed)] != base


def test_assistant_only_loss_masks_everything_but_assistant_turns(corpus):
    from namazu.tiny import ASSET_DIR
    from namazu.tiny.dataset import assistant_targets, pack_examples
    from namazu.tiny.tokenizer import IM_END, load_tokenizer

    tok = load_tokenizer(ASSET_DIR)
    examples = [e for e in generate_chat_examples(corpus, CFG) if e.kind == "tool"][:6]
    ids, full = pack_examples(tok, examples, 2048)
    ids2, part = pack_examples(tok, examples, 2048, assistant_only=True)
    assert (ids == ids2).all() and (part <= full).all() and 0 < part.sum() < full.sum() / 2
    text = tok.decode([int(i) for i, m in zip(ids[0], part[0]) if m], skip_special_tokens=False)
    for ex in examples:  # the call and the final answer are targets; the declaration and request are not
        call = ex.messages[-3]["tool_calls"][0]["function"]
        assert call["arguments"] in text and ex.messages[-1]["content"] in text
        assert ex.messages[-4]["content"] not in text and "tool_declare" not in text
    seq = tok.encode(examples[0].text).ids
    marks = assistant_targets(seq, tok)
    assert marks[-1] and seq[-1] == tok.token_to_id(IM_END)


def test_copy_tasks_answer_only_from_the_request(corpus):
    cfg = ChatDataConfig(seed=9, num_qa=0, num_tool=0, num_copy=300)
    examples = generate_chat_examples(corpus, cfg)
    assert [e.text for e in examples] == [e.text for e in generate_chat_examples(corpus, cfg)]
    assert {e.kind for e in examples} == {"copy"} and len(examples) == 300
    n_json = 0
    for ex in examples:
        user, answer = ex.messages[0]["content"], ex.messages[1]["content"]
        if answer.startswith("{"):  # JSON formatting: every field of the request, in order, as tool args
            obj = json.loads(answer)
            fields = [ln.split(": ", 1)[0] for ln in user.split("\n")[1:]]
            assert list(obj) == fields
            n_json += 1
        elif "\n- " in user:  # read-back: every listed code, in order
            codes = [ln[2:] for ln in user.split("\n") if ln.startswith("- ")]
            assert all(c in answer for c in codes)
            assert [answer.index(c) for c in codes] == sorted(answer.index(c) for c in codes)
        else:  # transcription
            assert user.endswith(answer)
    assert n_json > 80
    base = [e.text for e in generate_chat_examples(corpus, CFG)]
    assert [e.text for e in generate_chat_examples(corpus, ChatDataConfig(**{**CFG.__dict__, "num_copy": 0}))] == base


def test_copy_rows_are_their_own_source_with_a_warmup(corpus):
    from namazu.tiny import ASSET_DIR
    from namazu.tiny.dataset import MixConfig, build_sampler
    from namazu.tiny.tokenizer import load_tokenizer

    tok = load_tokenizer(ASSET_DIR)
    chat = ChatDataConfig(seed=3, num_qa=40, num_tool=40, num_copy=200, assistant_loss_only=True)
    mix = MixConfig(ja_share=0.5, en_share=0.0, chat_share=0.3, copy_share=0.2, copy_warmup_steps=10,
                    copy_warmup_share=0.9)
    sampler = build_sampler(tok, corpus, chat, mix, batch_size=16, seq_len=127, seed=0)
    pool = {tuple(r.tolist()) for r in sampler.pools["copy"].ids}
    assert pool and not pool & {tuple(r.tolist()) for r in sampler.pools["chat"].ids}

    def copy_rows(ids):
        return sum(tuple(r.tolist()) in pool for r in ids)

    early = sum(copy_rows(next(sampler)[0]) for _ in range(10))  # 160 rows at 90%
    late = sum(copy_rows(next(sampler)[0]) for _ in range(10))  # 160 rows at 20%
    assert early > 120 and 10 < late < 60, (early, late)
    with pytest.raises(ValueError, match="num_copy"):
        build_sampler(tok, corpus, ChatDataConfig(seed=3, num_qa=10, num_tool=10), mix, 4, 127, 0)


def test_term_readback_repeats_the_list_token_for_token(corpus):
    from namazu.tiny import ASSET_DIR
    from namazu.tiny.tokenizer import load_tokenizer

    tok = load_tokenizer(ASSET_DIR)
    cfg = ChatDataConfig(seed=4, num_qa=0, num_tool=0, num_readback=100)
    examples = generate_chat_examples(corpus, cfg)
    assert {e.kind for e in examples} == {"copy"} and len(examples) == 100
    terms = set()
    for ex in examples:
        asked = ex.messages[0]["content"].split("\n", 1)[1]
        answered = ex.messages[1]["content"].split("\n", 1)[1]
        assert asked == answered and tok.encode(asked).ids == tok.encode(answered).ids
        terms.update(asked.split("\n"))
    assert len(terms) > 300  # drawn from all over the corpus, not a small list
