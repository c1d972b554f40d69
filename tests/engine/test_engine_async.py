"""Async scheduling (step N+1 planned and launched before step N's tokens reach the host): outputs are
identical to synchronous scheduling, through preemption, chunked prefill, penalties (the pending token
is counted on the device), stops discovered a step late, aborts in flight, and in a worker process.

"Identical" is `assert_same_outputs` for the tokens: the two schedules batch other rows together (a
stopped sequence's wasted row, verify rows), so the logits agree to rounding and the runs may part only
at a near-tie; every request that did not part must match in text, finish and stop reason too."""
import pytest
from engine_helpers import assert_greedy_equal, assert_same_outputs, dense_greedy, prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.assets.random_model import EOS, SPECIAL_TOKENS
from namazu.engine.llm_engine import LLMEngine
from namazu.engine_config import EngineConfig

ASCII = list(range(65, 91))     # byte-level ids 65..90 are the bytes b..{
EOS_ID = 256 + SPECIAL_TOKENS.index(EOS)


def mixed_params(i: int) -> SamplingParams:
    return [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, seed=i, top_k=30, max_tokens=12, presence_penalty=0.8,
                       frequency_penalty=0.5, repetition_penalty=1.4, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=i, max_tokens=14, allowed_token_ids=ASCII, stop=["e", "k", "t", "xy"],
                       min_tokens=2),
        SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=9, prompt_logprobs=1),
        SamplingParams(temperature=1.0, seed=i, max_tokens=20, allowed_token_ids=[EOS_ID, 70, 71, 72]),  # EOS
    ][i % 5]


def run(async_scheduling: bool, batch, params, **kw):
    with LLM(tiny_checkpoint(), executor=kw.pop("executor", "inline"), async_scheduling=async_scheduling,
             **kw) as llm:
        outs = llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
        stats = llm.engine.get_stats()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    tokens = [[(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in r.outputs] for r in outs]
    logprobs = [[o.logprobs for o in r.outputs] + [r.prompt_logprobs] for r in outs]
    return (tokens, logprobs), stats


def assert_logprobs_close(a, b, tol=1e-4):
    """Logprobs agree to float noise (preemption changes batch composition, so low bits may move)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        assert all(abs(a[k] - b[k]) < tol for k in a)
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_logprobs_close(x, y, tol)
    else:
        assert a == b


def assert_same_runs(batch, params, got, want) -> None:
    """run()'s results of two schedules: the same tokens up to near-ties (`assert_same_outputs`), and for
    every request that did not part, the same texts, finish and stop reasons, and logprobs to float noise."""
    (g, g_lp), (w, w_lp) = got, want
    parted = assert_same_outputs(tiny_checkpoint(), batch, params, [[o[0] for o in r] for r in g],
                                 [[o[0] for o in r] for r in w])
    for i in range(len(w)):
        if i not in parted:
            assert g[i] == w[i], f"request {i}"
            assert_logprobs_close(g_lp[i], w_lp[i])


@pytest.mark.parametrize("engine_args", [
    dict(),
    dict(max_num_batched_tokens=16, max_num_seqs=8),                  # chunked prefill mixed with decodes
    dict(num_kv_blocks=24, block_size=4, max_model_len=80),            # constant preemption
], ids=["plain", "chunked", "preemption"])
def test_async_equals_sync(engine_args):
    batch = prompts(10, lo=3, hi=40, seed=13)
    params = [mixed_params(i) for i in range(10)]
    (sync, sync_lp), s_stats = run(False, batch, params, **engine_args)
    (async_, async_lp), a_stats = run(True, batch, params, **engine_args)
    assert_same_runs(batch, params, (async_, async_lp), (sync, sync_lp))
    reasons = {(o[2], type(o[3]).__name__) for r in sync for o in r}
    assert {("stop", "str"), ("stop", "NoneType"), ("length", "NoneType")} <= reasons   # stop string, EOS
    if "num_kv_blocks" in engine_args:
        assert a_stats.num_preemptions > 0


def test_async_greedy_matches_dense_oracle_in_a_worker_process():
    batch = prompts(6, lo=3, hi=30, seed=17)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(tiny_checkpoint(), async_scheduling=True) as llm:
        outs = llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
    for p, o in zip(batch, outs):
        ref, gaps = dense_greedy(tiny_checkpoint(), p, 10)
        assert_greedy_equal(o.outputs[0].token_ids, ref, gaps)


def test_abort_while_a_step_is_in_flight_frees_everything():
    engine = LLMEngine(EngineConfig(model=tiny_checkpoint(), executor="inline", async_scheduling=True,
                                    block_size=4))
    for i, p in enumerate(prompts(3, 10, 10, seed=4)):
        engine.add_request(f"r{i}", None, SamplingParams(max_tokens=50, ignore_eos=True), prompt_token_ids=p)
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request(["r0", "r2"])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_async_steps_do_not_sync():
    batch = prompts(6, lo=3, hi=30, seed=19)
    params = [mixed_params(i) for i in range(6)]
    with LLM(tiny_checkpoint(), executor="inline", async_scheduling=True, debug_no_host_sync=True,
             max_num_batched_tokens=16, max_num_seqs=8) as llm:
        outs = llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
    assert all(o.finished for o in outs)


def test_ngram_speculation_with_async_scheduling_is_exact():
    """The plan of step N+1 assumes step N's drafts were all accepted; the worker corrects positions and
    counters by the rejected ones. Token-identical to no speculation on 24 greedy prompts, drafts
    proposed and accepted, and no host sync over those steps."""
    # Prompts that repeat themselves give prompt lookup matches that are sometimes right, sometimes not.
    batch = [p * 3 for p in prompts(24, lo=4, hi=12, seed=23)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = run(False, batch, params)[0]
    got, stats = run(True, batch, params, speculative_method="ngram", num_speculative_tokens=3, ngram_max=3,
                     debug_no_host_sync=True)
    assert_same_runs(batch, params, got, base)
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.num_steps < 24 * 16


@pytest.mark.parametrize("mode", ["right", "wrong", "random", "random_q"])
def test_scripted_drafts_with_async_scheduling_are_exact(mode):
    """Seeded sampling, penalties (the history includes tokens of the verify in flight), logprobs,
    stop strings, min_tokens, preemption: outputs equal synchronous scheduling without speculation."""
    from namazu.spec.drafters import ScriptedDrafter

    batch = prompts(10, lo=3, hi=40, seed=13)
    params = [mixed_params(i) for i in range(10)]
    engine_args = dict(num_kv_blocks=40, block_size=4, max_model_len=80)
    base = run(False, batch, params, **engine_args)[0]
    reference = {tuple(p): r[0][0] for p, r in zip(batch, base[0])}
    drafter = ScriptedDrafter(mode, 264, reference, seed=5)
    got, stats = run(True, batch, params, drafter=drafter, num_speculative_tokens=3, **engine_args)
    if mode == "random_q":
        # Drafts with a distribution q take the p/q rule: exact in distribution, identical only at T = 0.
        greedy = [i for i, p in enumerate(params) if p.temperature == 0]
        assert greedy
        assert_same_runs([batch[i] for i in greedy], [params[i] for i in greedy],
                         ([got[0][i] for i in greedy], [got[1][i] for i in greedy]),
                         ([base[0][i] for i in greedy], [base[1][i] for i in greedy]))
        assert all(o[2] in ("stop", "length") for r in got[0] for o in r)
    else:
        assert_same_runs(batch, params, got, base)
    assert stats.num_draft_tokens > 0
    if mode == "right":
        assert stats.num_accepted_draft_tokens > 0


def test_close_with_a_step_in_flight_collects_it_first(capfd):
    """With async scheduling a step can still be in flight when the engine closes (launched for sequences its
    predecessor finished, or, here, the first step of a request). close() collects it before the worker's
    pipe closes: the worker's answer would otherwise hit a closed pipe (a BrokenPipeError traceback per rank)."""
    engine = LLMEngine(EngineConfig(model=tiny_checkpoint(), async_scheduling=True))
    for i, p in enumerate(prompts(4, 60, 60, seed=8)):
        engine.add_request(f"r{i}", None, SamplingParams(max_tokens=50, ignore_eos=True), prompt_token_ids=p)
    assert engine.step() == [] and engine._in_flight is not None
    engine.close()
    proc = engine.executor.procs[0]
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert "BrokenPipeError" not in capfd.readouterr().err


def test_an_inline_engine_left_open_with_a_step_in_flight_exits_quietly(tmp_path):
    """`LLM.generate` returns with the next step launched; an inline engine never closed is closed by
    `LLM.__del__` at interpreter exit, with torch half torn down. Its in-flight step has not run (an inline
    step runs when collected): close drops it. Running it there raised, and printed a traceback after every
    script that did not close its LLM."""
    import subprocess
    import sys

    script = tmp_path / "left_open.py"
    script.write_text(
        "from namazu import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_checkpoint())!r}, executor='inline')\n"
        "p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)\n"
        "out = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=p, use_tqdm=False)\n"
        "ids = out[0].outputs[0].token_ids\n"
        "# a stop token the host sees only after the next step is launched\n"
        "p = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[ids[3]])\n"
        "out = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=p, use_tqdm=False)\n"
        "assert llm.engine._in_flight is not None\n"
        "print('generated', len(out[0].outputs[0].token_ids))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "generated" in proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr and "discarding" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("executor", ["inline", "mp"])
def test_a_step_launched_for_sequences_that_stopped_is_dropped_not_run(executor, monkeypatch):
    """With async scheduling `LLM.generate` returns with a step launched for a sequence whose stop token the
    host saw only after launching it. The next call's first `step()` dropped nothing: an in-process worker
    ran that whole step (a verify and a draft at batch 1) before the next request's prefill, only to discard
    its result. Now no step whose sequences all finished is collected: it is dropped unrun (in-process) or
    waited for (worker processes), and the requests after it get the tokens they get without async
    scheduling (up to near-ties: the two schedules verify other row counts)."""
    from dflash_fixtures import random_drafter

    from namazu.engine.llm_engine import LLMEngine
    from namazu.worker.model_runner import ModelRunner

    ps = prompts(3, lo=4, hi=9, seed=11)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    collected_finished, skipped = [], []
    collect, skip = LLMEngine._collect, ModelRunner.skip
    monkeypatch.setattr(LLMEngine, "_collect", lambda self, launched: collected_finished.append(
        all(it.seq.is_finished for it in launched.scheduled)) or collect(self, launched))
    monkeypatch.setattr(ModelRunner, "skip", lambda self, b: skipped.append(1) or skip(self, b))
    for async_scheduling in (False, True):
        with LLM(tiny_checkpoint(), executor=executor, async_scheduling=async_scheduling,
                 speculative_model=random_drafter(tiny_checkpoint()), num_speculative_tokens=3) as llm:
            free_ids = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=free,
                                                                       use_tqdm=False)]
            collected_finished.clear()
            got, params, order = [], [], []
            # One request, then two that stop a step apart (the step dropped after the second carries the
            # news of the first), then one again.
            for group, at in (([0], [5]), ([1, 2], [3, 4]), ([0], [4])):
                group_params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free_ids[i][j]])
                                for i, j in zip(group, at)]
                res = llm.generate(prompt_token_ids=[ps[i] for i in group], sampling_params=group_params,
                                   use_tqdm=False)
                got += [o.outputs[0].token_ids for o in res]
                params += group_params
                order += group
                if async_scheduling:
                    assert llm.engine._in_flight is not None     # launched before the stop was seen
            outs[async_scheduling] = got
            assert not any(collected_finished)
            if executor == "inline":     # a dropped step's finished sequences are forgotten all the same
                assert len(llm.engine.executor.worker.runner.seqs.seqs) <= 1      # the last one's news is queued
            assert llm.engine.get_stats().num_draft_tokens > 0
    assert_same_outputs(tiny_checkpoint(), [ps[i] for i in order], params, outs[True], outs[False])
    if executor == "inline":            # worker processes skip nothing where `skipped` sees it
        assert len(skipped) >= 2, skipped


@pytest.mark.parametrize("executor", ["mp", "inline"])
def test_a_collective_rpc_between_steps_answers_itself_not_the_step_in_flight(executor):
    """With async scheduling a step is in flight after the first `step()`. Sent behind it, an RPC read that
    step's results as its answers (worker processes answer in order), and the next collect read the RPC's.
    `LLMEngine.collective_rpc` collects the step first and hands its outputs to the next `step()`; the
    executor refuses an RPC behind an uncollected step."""
    from namazu.worker.rank import Worker

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batch = prompts(3, 5, 9, seed=4)
    with LLM(tiny_checkpoint(), executor=executor, async_scheduling=False) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(prompt_token_ids=batch, sampling_params=params,
                                                             use_tqdm=False)]
    engine = LLMEngine(EngineConfig(model=tiny_checkpoint(), executor=executor, async_scheduling=True))
    try:
        for i, p in enumerate(batch):
            engine.add_request(f"r{i}", None, params, prompt_token_ids=p)
        assert engine.step() == [] and engine._in_flight is not None
        with pytest.raises(RuntimeError, match="not collected"):
            engine.executor.collective_rpc(Worker.resident_memory)
        answers = engine.collective_rpc(Worker.resident_memory)
        assert len(answers) == 1 and answers[0]["weight_bytes"] > 0
        assert engine._in_flight is None and engine.has_unfinished_requests()
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        assert [done[f"r{i}"] for i in range(len(batch))] == [list(w) for w in want]
    finally:
        engine.close()
