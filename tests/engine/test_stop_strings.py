"""Stop strings on namazu-tiny's real tokenizer (multi-character and split multi-byte tokens): a stop
inside the text one token releases (not at its end), the earliest of several stops completed by the same
token whatever their order in the list, and no stop while `min_tokens` is not reached — each through the
incremental detokenizer and end to end through `LLM`."""
import pytest

from namazu import LLM, SamplingParams
from namazu.assets import default_model_path
from namazu.engine.detokenizer import IncrementalDetokenizer
from namazu.tokenizer import Tokenizer

PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(default_model_path())


def feed(tok: Tokenizer, text: str, stop: list[str], include: bool = False, min_tokens: int = 0):
    """Appends the tokens of `text` one by one as the engine would; returns (text, stop hit, tokens fed)."""
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT, add_special_tokens=False), stop=stop,
                               include_stop_str_in_output=include)
    for n, t in enumerate(ids, 1):
        if d.append(t, check_stop=n > min_tokens) is not None:
            return d.text, d.stop_hit, n
    d.finish()
    return d.text, None, len(ids)


def test_a_stop_inside_a_token_is_found_and_cut_there(tok):
    # " wor" and " プロジェクトのリリース" are single tokens: the stops end before the released text does.
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)[1:3]) == "lo wor"
    assert feed(tok, "hello world, the quick", ["o w"]) == ("hell", "o w", 3)
    assert feed(tok, "hello world, the quick", ["o w"], include=True) == ("hello w", "o w", 3)
    text = "この man ページは Linux man-pages プロジェクトのリリース 5.10 の一部である。"
    got, hit, _ = feed(tok, text, ["ジェク"])
    assert (got, hit) == (text[:text.index("ジェク")], "ジェク")


def test_the_earliest_stop_wins_whatever_the_list_order(tok):
    # The token "ld" completes both "orl" (starting at 7) and "rld" (starting at 8).
    for stops in (["rld", "orl"], ["orl", "rld"]):
        assert feed(tok, "hello world, the quick", stops) == ("hello w", "orl", 4)
    text = "Linux man-pages プロジェクトのリリース 5.10"
    for stops in (["リリース", "プロジェクト"], ["プロジェクト", "リリース"], ["ース", "ロジ", "プ"]):
        got, hit, _ = feed(tok, text, stops)
        first = min(stops, key=text.index)
        assert (got, hit) == (text[:text.index(first)], first)


def test_a_stop_completed_under_min_tokens_is_ignored_and_a_later_one_counts(tok):
    text = " file descriptor.\nThe file descriptor is a file descriptor."
    assert feed(tok, text, [" file"]) == ("", " file", 1)
    later = text.index(" file", 1)
    assert feed(tok, text, [" file"], min_tokens=3) == (text[:later], " file", 6)
    second = text.index("descriptor.", later)
    assert feed(tok, text, ["descriptor."], min_tokens=3) == (text[:second], "descriptor.", 12)


@pytest.fixture(scope="module")
def llm():
    with LLM(executor="inline", dtype="float32", max_num_seqs=4) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    ref = out[0].outputs[0]
    # The cases below read this continuation; if the model changes, pick new stops from its output.
    assert ref.text.startswith(" file descriptor.\nThe file descriptor"), ref.text
    return ref


def run(llm, **params):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **params),
                       use_tqdm=False)
    return out[0].outputs[0]


def expect_stop(out, ref, tok: Tokenizer, stop: str, start: int = 0) -> None:
    """Finished by `stop` at its first occurrence from `start`: text cut before it, tokens through the one
    that completed it."""
    at = ref.text.index(stop, start)
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, ref.text[:at])
    n = next(i for i in range(1, len(ref.token_ids) + 1) if len(tok.decode(ref.token_ids[:i])) >= at + len(stop))
    assert out.token_ids == ref.token_ids[:n]


def test_engine_stop_inside_a_token(llm, reference, tok):
    expect_stop(run(llm, stop=["escrip"]), reference, tok, "escrip")


def test_engine_earliest_of_several_stops(llm, reference, tok):
    for stops in (["ptor", "scr"], ["scr", "ptor"]):
        expect_stop(run(llm, stop=stops), reference, tok, "scr")


def test_engine_stop_under_min_tokens(llm, reference, tok):
    expect_stop(run(llm, stop=[" file"], min_tokens=3), reference, tok, " file", start=1)
    expect_stop(run(llm, stop=[" file"]), reference, tok, " file")
