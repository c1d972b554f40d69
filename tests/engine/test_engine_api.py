"""Library API and engine behaviour: LLM lifecycle (worker process ends), default model, chat, logprobs,
stop conditions, n > 1, abort at any point, AsyncEngine streaming and cancellation, input errors."""
import argparse
import asyncio
import dataclasses
import gc
import os
import time

import pytest
import torch
from engine_helpers import assert_same_outputs, dense_model, prompts, tiny_checkpoint

import namazu.assets
from namazu import LLM, SamplingParams
from namazu.async_engine import AsyncEngine
from namazu.engine.llm_engine import LLMEngine
from namazu.engine_config import EngineConfig

ASCII = list(range(65, 91))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout: float = 20) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_worker_process_ends_on_close_and_on_del():
    with LLM(tiny_checkpoint()) as llm:
        pid = llm.engine.executor.pids[0]
        assert pid != os.getpid() and alive(pid)
        out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    assert wait_dead(pid)
    llm = LLM(tiny_checkpoint())
    pid = llm.engine.executor.pids[0]
    del llm
    gc.collect()
    assert wait_dead(pid)


def test_default_model_is_the_embedded_path(monkeypatch, tmp_path):
    monkeypatch.setattr(namazu.assets, "default_model_path", lambda: tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="embedded default model"):
        LLM(executor="inline")
    monkeypatch.setattr(namazu.assets, "default_model_path", lambda: __import__("pathlib").Path(tiny_checkpoint()))
    with LLM(executor="inline") as llm:
        assert str(llm.engine.model_path) == tiny_checkpoint()


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_checkpoint(), executor="inline", max_num_seqs=8) as llm:
        yield llm


def test_chat_and_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "こんにちは"}], params, use_tqdm=False)[0].outputs[0]
    assert isinstance(out.text, str) and len(out.token_ids) == 6
    assert len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4 and all(v <= 0 for v in lp.values())
        assert lp[tok] == max(lp.values())          # greedy picks the top token
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)))


def check_prompt_logprobs(got, ids, num_top):
    """Against the model's own log_softmax from one full forward over the prompt (no cache): entry i is the
    distribution after ids[:i], holding ids[i] and the top `num_top` tokens with their values."""
    model = dense_model(tiny_checkpoint())
    with torch.no_grad():
        hidden, _ = model(torch.tensor([ids]))
        logp = model.compute_logits(hidden[0]).float().log_softmax(-1)
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        want = {ids[i]: float(logp[i - 1, ids[i]])}
        top = logp[i - 1].topk(num_top)
        want.update(zip(top.indices.tolist(), top.values.tolist()))
        assert got[i].keys() == want.keys(), f"position {i}"
        for tok, v in want.items():
            assert abs(got[i][tok] - v) < 1e-4, f"position {i} token {tok}: {got[i][tok]} vs {v}"


def test_prompt_logprobs(llm):
    ids = prompts(1, 10, 10, seed=3)[0]
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    check_prompt_logprobs(out.prompt_logprobs, ids, 2)


def test_prompt_logprobs_over_prefill_chunks():
    ids = prompts(1, 30, 30, seed=4)[0]
    with LLM(tiny_checkpoint(), executor="inline", max_num_batched_tokens=8, max_num_seqs=2) as small:
        outs = small.generate(prompt_token_ids=[ids, ids[:12]], use_tqdm=False,
                              sampling_params=SamplingParams(max_tokens=2, prompt_logprobs=3))
    check_prompt_logprobs(outs[0].prompt_logprobs, ids, 3)
    check_prompt_logprobs(outs[1].prompt_logprobs, ids[:12], 3)


def test_stop_conditions(llm):
    base = SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=ASCII)
    ref = llm.generate("stop test", base, use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 12 and ref.text.isascii()
    # Stop string made of two output characters (two tokens).
    stop = ref.text[5:7]
    first = ref.text.find(stop)
    out = llm.generate("stop test", SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=ASCII,
                                                   stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == ref.text[:first]
    # Stop token id.
    tok = ref.token_ids[4]
    out = llm.generate("stop test", SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=ASCII,
                                                   stop_token_ids=[tok]), use_tqdm=False)[0].outputs[0]
    k = ref.token_ids.index(tok)
    assert out.finish_reason == "stop" and out.stop_reason == tok and out.token_ids == ref.token_ids[:k + 1]
    # min_tokens delays the stop token.
    out = llm.generate("stop test", SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=ASCII,
                                                   stop_token_ids=[tok], min_tokens=k + 1),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > k + 1


def test_eos_stops_unless_ignored(llm):
    eos = llm.get_tokenizer().eos_token_id
    allowed = [eos, 70]
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[eos]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [eos] and out.text == ""
    out = llm.generate("x", SamplingParams(temperature=1, max_tokens=8, allowed_token_ids=allowed, ignore_eos=True,
                                           seed=0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_n_sequences_and_seeds(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    a = llm.generate("seeded", p, use_tqdm=False)[0]
    b = llm.generate("seeded", p, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    # The second run's prompt comes from the prefix cache (a prefill of another length): the same tokens
    # up to near-ties.
    assert_same_outputs(tiny_checkpoint(), [a.prompt_token_ids], p, [[o.token_ids for o in b.outputs]],
                        [[o.token_ids for o in a.outputs]])
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_abort_at_any_point_frees_every_block():
    engine = LLMEngine(EngineConfig(model=tiny_checkpoint(), executor="inline", max_num_batched_tokens=16,
                                    max_num_seqs=2, block_size=4))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts(4, 30, 30, seed=8)):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=p)
    engine.step()                                   # r0 mid-prefill
    assert engine.block_manager.usage > 0
    outs = engine.abort_request("r0")
    assert outs[0].outputs[0].finish_reason == "abort" and outs[0].finished
    for _ in range(6):
        engine.step()                               # r1 prefilled and decoding, r2 admitted
    engine.abort_request(["r1", "r3", "unknown"])   # decoding and waiting
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants([])
    engine.close()


def test_bad_input_gets_clear_errors(llm):
    with pytest.raises(ValueError, match="at most"):
        llm.generate(prompt_token_ids=[[1] * 5000], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompt_token_ids=[[1, 99999]], use_tqdm=False)
    with pytest.raises(ValueError, match="max-logprobs"):
        llm.generate("x", SamplingParams(logprobs=100), use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(tiny_checkpoint(), max_num_seq=3)
    with pytest.raises(ValueError, match="max-model-len"):
        LLM(tiny_checkpoint(), executor="inline", num_kv_blocks=4, max_model_len=200)
    assert not llm.engine.has_unfinished_requests()


def test_the_prompt_limits_are_exact_at_their_boundaries(llm):
    # One token id past the vocabulary reaches the embedding and kills the worker (every request then
    # 503s), and a prompt of max_model_len tokens leaves no room for its first output token: both must
    # be refused here, and the last value inside each limit must still be served.
    engine = llm.engine
    vocab, limit = engine.vocab_size, engine.max_model_len
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with pytest.raises(ValueError, match=rf"\[{vocab}\] outside the vocabulary \[0, {vocab}\)"):
        llm.generate(prompt_token_ids=[[1, vocab]], use_tqdm=False)
    with pytest.raises(ValueError, match=f"the prompt has {limit} tokens"):
        llm.generate(prompt_token_ids=[[7] * limit], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    edge = llm.generate(prompt_token_ids=[[1, vocab - 1], [7] * (limit - 1)], sampling_params=greedy,
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in edge] == [1, 1]
    assert len(edge[1].prompt_token_ids) + 1 == limit
    engine.block_manager.check_invariants([])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_engine_streams_and_cancels(async_scheduling):
    engine = AsyncEngine(EngineConfig(model=tiny_checkpoint(), executor="inline", async_scheduling=async_scheduling))

    async def main():
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        seen = []
        async for out in engine.generate("stream me", params):
            seen.append(list(out.outputs[0].token_ids))
        assert seen[-1] and len(seen[-1]) == 10 and out.finished
        assert all(seen[i] == seen[-1][:len(seen[i])] for i in range(len(seen)))

        async def consume(n):
            got = 0
            async for _ in engine.generate("cancel me", SamplingParams(max_tokens=1000, ignore_eos=True)):
                got += 1
                if got == n:
                    break
            return got

        both = await asyncio.gather(consume(3), engine_collect(engine, "together", 5))
        assert both[0] == 3 and len(both[1]) == 5
        for _ in range(100):
            if engine.get_stats().num_running == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.get_stats().num_running == 0
        assert engine.engine.block_manager.num_free_blocks == engine.engine.block_manager.num_blocks
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate("", params):
                pass

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


async def engine_collect(engine, prompt, n):
    last = None
    async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
        last = out
    return last.outputs[0].token_ids


def test_engine_config_flags_are_generated():
    parser = EngineConfig.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--max-num-seqs", "7", "--no-enable-prefix-caching", "--kv-cache-memory", "64MiB",
                              "--speculative-method", "ngram", "--num-speculative-tokens", "2"])
    cfg = EngineConfig.from_cli_args(args)
    assert cfg.max_num_seqs == 7 and not cfg.enable_prefix_caching and cfg.kv_cache_bytes == 64 * 2**20
    assert cfg.speculative_method == "ngram"
    assert "--gpu-memory-utilization" in parser.format_help()
    with pytest.raises(ValueError, match="--block-size"):
        EngineConfig(block_size=12)
    from namazu.kernels.backends import BACKENDS

    moe = next(f for f in dataclasses.fields(EngineConfig) if f.name == "moe_backend")
    assert set(moe.metadata["choices"]) == {"auto", *BACKENDS}
    # `--tp` is the short name the server documents; a rank per process, so not with the inline executor.
    assert EngineConfig.from_cli_args(parser.parse_args(["--tp", "4"])).tensor_parallel_size == 4
    with pytest.raises(ValueError, match="tensor-parallel-size=4.*--executor mp"):
        EngineConfig.from_cli_args(parser.parse_args(["--tp", "4", "--executor", "inline"]))
    with pytest.raises(ValueError, match="tensor-parallel-size=0"):
        EngineConfig.from_cli_args(parser.parse_args(["--tp", "0"]))


def test_worker_process_ends_at_interpreter_exit(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "leak.py"
    # No close(), no with, no __main__ guard: the worker must still go away when the interpreter exits.
    script.write_text(
        "from namazu import LLM\n"
        f"llm = LLM({tiny_checkpoint()!r})\n"
        "print(llm.engine.executor.pids[0], flush=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    pid = int(out.stdout.strip().splitlines()[-1])
    assert wait_dead(pid)


def test_a_finished_request_leaves_its_prefix_cached(llm):
    ids = prompts(1, 50, 50, seed=21)[0]
    params = SamplingParams(max_tokens=1)
    first = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0]
    again = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48   # 3 full blocks of 16
