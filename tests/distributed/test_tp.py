"""Tensor parallelism at TP=4: four gloo worker processes, one thread each, against TP=1 in-process.

Greedy outputs must be token-identical to TP=1 (fp32 compute, BF16-format and NVFP4 checkpoints,
speculation on and off per request), grammar masks apply identically, a batch is pickled once whatever
the number of ranks, each rank holds a quarter of the sharded weights, and the sampled tokens and
acceptance decisions are rank 0's: a rank-dependent perturbation of the logits makes ranks commit
different tokens without the broadcast and identical ones with it.

TP=4 sums four partial products where TP=1 computes one, so its logits agree with TP=1's to rounding:
"token-identical" is `assert_same_outputs` (the runs may part only at a near-tie of the model). The ranks
of one run, which commit rank 0's broadcast decisions, agree exactly.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch
import tp_helpers
from engine_helpers import assert_same_outputs
from quant_fixtures import random_windows, write_model_dir

import namazu.engine.llm_engine as engine_module
import namazu.worker.executor as worker_module
from namazu import LLM, SamplingParams
from namazu.assets.random_model import write_random_checkpoint

TP = 4
NUM_PROMPTS = 50
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 3, "ngram_min": 1}


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(NUM_PROMPTS):
        base = [rng.randrange(3, vocab - 16) for _ in range(rng.randrange(2, 8))]
        out.append(base * (1 + i % 3))      # repeats give the n-gram drafter something to propose
    return out


def _greedy(max_tokens: int, spec: bool) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          **({} if spec else {"num_speculative_tokens": 0}))


def _generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                         use_tqdm=False)]


def _assert_same(llm: LLM, prompts, params, got, want) -> None:
    assert_same_outputs(str(llm.engine.model_path), prompts, params, got, want)


def _tp_llm(path, **kw) -> LLM:
    """A TP=4 LLM whose ranks carry the probe of tp_helpers (recording, perturbation off)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "make_executor",
                   functools.partial(worker_module.make_executor, setup=tp_helpers.install_probe))
        return LLM(str(path), tensor_parallel_size=TP, dtype="float32", max_num_seqs=64, **{**SPEC, **kw})


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tp_bf16"), "tiny", seed=5)


@pytest.fixture(scope="module")
def tp4(bf16_ckpt):
    llm = _tp_llm(bf16_ckpt)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def tp1(bf16_ckpt):
    with LLM(str(bf16_ckpt), executor="inline", dtype="float32", max_num_seqs=64, **SPEC) as llm:
        yield llm


def test_bf16_greedy_tp4_equals_tp1_with_and_without_speculation(tp4, tp1):
    prompts = _prompts(tp1.engine.model_config.vocab_size)
    for spec in (False, True):
        want = _generate(tp1, prompts, _greedy(10, spec))
        got = _generate(tp4, prompts, _greedy(10, spec))
        _assert_same(tp1, prompts, _greedy(10, spec), got, want)
    stats = tp4.engine.get_stats()
    assert stats.num_accepted_draft_tokens > 0, "the drafter never proposed an accepted token: speculation untested"
    # Seeded sampling draws the same tokens too (the noise depends on seed and position, not on the rank).
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8, ignore_eos=True) for i in range(20)]
    _assert_same(tp1, prompts[:20], seeded, _generate(tp4, prompts[:20], seeded), _generate(tp1, prompts[:20], seeded))


def test_grammar_masks_apply_identically_on_every_rank(tp4, tp1):
    vocab = tp1.engine.model_config.vocab_size
    allowed = list(range(40, 80, 3))
    params = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed, ignore_eos=True)
    prompts = _prompts(vocab, seed=1)[:12]
    want = _generate(tp1, prompts, params)
    tp4.engine.collective_rpc(tp_helpers.set_probe, False, True)
    got = _generate(tp4, prompts, params)
    _assert_same(tp1, prompts, params, got, want)
    assert all(t in allowed for out in got for t in out)
    logs = tp4.engine.collective_rpc(tp_helpers.probe_log)
    assert logs[0] and all(log == logs[0] for log in logs)


def test_a_batch_is_encoded_once_for_all_ranks(tp4, monkeypatch):
    """The engine encodes a step once (namazu/step/delta.py) whatever the number of ranks; rank 0 shares
    the bytes. No step travels as a pickle."""
    import pickle

    dumps: list[str] = []

    class CountingPickle:
        @staticmethod
        def dumps(obj, *a, **k):
            dumps.append(obj[0] if isinstance(obj, tuple) else repr(obj))
            return pickle.dumps(obj, *a, **k)

        loads = staticmethod(pickle.loads)

    monkeypatch.setattr(worker_module, "pickle", CountingPickle)
    ex = tp4.engine.executor
    submits, encodes = [], []
    real, real_encode = ex.submit, ex.encoder.encode
    monkeypatch.setattr(ex, "submit", lambda b: (submits.append(1), real(b))[1])
    monkeypatch.setattr(ex.encoder, "encode", lambda b: (encodes.append(1), real_encode(b))[1])
    _generate(tp4, [[5, 6, 7], [8, 9]], _greedy(4, spec=False))
    assert submits and len(encodes) == len(submits) and "execute" not in dumps


def test_ranks_commit_rank0s_decision_even_when_their_logits_differ(tp4, tp1):
    """Ranks > 0 add a large bonus to a rank-specific token. Without the broadcast each rank commits its
    own samples (and drafts verify differently); with it every rank commits rank 0's, which are TP=1's."""
    ex = tp4.engine
    prompts = _prompts(tp1.engine.model_config.vocab_size, seed=2)[:8]
    want = _generate(tp1, prompts, _greedy(8, spec=True))

    ex.collective_rpc(tp_helpers.set_probe, True, False)
    try:
        _generate(tp4, prompts, _greedy(8, spec=True))
        logs = ex.collective_rpc(tp_helpers.probe_log)
    finally:
        ex.collective_rpc(tp_helpers.set_probe, False, True)
    assert all(log != logs[0] for log in logs[1:]), "ranks agreed without the broadcast: the probe is inert"
    assert any(37 in toks for _, toks in logs[1])

    ex.collective_rpc(tp_helpers.set_probe, True, True)
    try:
        got = _generate(tp4, prompts, _greedy(8, spec=True))
        logs = ex.collective_rpc(tp_helpers.probe_log)
    finally:
        ex.collective_rpc(tp_helpers.set_probe, False, True)
    assert all(log == logs[0] for log in logs)
    _assert_same(tp1, prompts, _greedy(8, spec=True), got, want)


def test_each_rank_holds_a_quarter_of_the_sharded_weights(tp4, tp1):
    full = tp1.engine.collective_rpc(worker_module.Worker.resident_memory)[0]["weight_bytes"]
    ranks = tp4.engine.collective_rpc(worker_module.Worker.resident_memory)
    model = tp1.engine.executor.worker.runner.model
    # Replicated by design: norms, the latent down-projections (q_a, kv_a), the router and its bias.
    replicated = sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
                     if "norm" in n or "q_a_proj" in n or "kv_a_proj" in n or ".gate." in n or "inv_freq" in n)
    for r in ranks:
        assert r["weight_bytes"] == replicated + (full - replicated) // TP, r


def test_a_model_that_does_not_divide_is_refused_before_any_rank_starts(bf16_ckpt):
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3: num_attention_heads \(4\), "
                                         r"moe_intermediate_size \(32\) not divisible by 3"):
        LLM(str(bf16_ckpt), tensor_parallel_size=3)


def test_each_rank_needs_its_own_gpu(monkeypatch):
    from namazu.distributed.group import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices("cuda", 2)
    check_devices("cpu", 4)
    with pytest.raises(ValueError, match="needs 4 GPUs on this node .* found 2"):
        check_devices("auto", 4)


@pytest.fixture(scope="module")
def nvfp4_ckpt(tmp_path_factory):
    from namazu.quant.calibrate import calibrate, finalize
    from namazu.quant.modelopt_checkpoint import save_quantized
    from namazu.quant.quantize import quantize_model
    from namazu.quant.selective import QuantPolicy

    root = tmp_path_factory.mktemp("tp_nvfp4")
    src, out = root / "bf16", root / "nvfp4"
    # Four heads, and an expert intermediate of 64 so each rank's slice is one 16-wide NVFP4 block.
    model = write_model_dir(str(src), num_attention_heads=4, moe_intermediate_size=64, initializer_range=0.15)
    policy = QuantPolicy.preset("experts")
    cov, lin, total = calibrate(model, random_windows(2, 32), policy, min_tokens=4, progress=False)
    quantize_model(model, policy, finalize(cov, lin, total, 4, True, False)[0])
    save_quantized(model, out, policy, source_dir=src)
    return out


def test_nvfp4_greedy_tp4_equals_tp1_with_and_without_speculation(nvfp4_ckpt):
    from namazu.quant.nvfp4_experts import NvFP4Experts

    with LLM(str(nvfp4_ckpt), executor="inline", dtype="float32", max_num_seqs=64, **SPEC) as tp1:
        assert any(isinstance(m, NvFP4Experts) for m in tp1.engine.executor.worker.runner.model.modules())
        prompts = _prompts(tp1.engine.model_config.vocab_size, seed=3)
        want = {spec: _generate(tp1, prompts, _greedy(8, spec)) for spec in (False, True)}
    with _tp_llm(nvfp4_ckpt) as tp4:
        for spec in (False, True):
            got = _generate(tp4, prompts, _greedy(8, spec))
            assert_same_outputs(str(nvfp4_ckpt), prompts, _greedy(8, spec), got, want[spec])
        logs = tp4.engine.collective_rpc(tp_helpers.probe_log)
        assert all(log == logs[0] for log in logs)


def test_device_drafts_are_rank0s_under_async_scheduling(bf16_ckpt, tp1):
    """A device proposer whose drafts differ per rank: every rank must verify rank 0's drafts (else their
    forwards would mix different inputs), so outputs equal TP=1's and every rank commits the same."""
    prompts = _prompts(tp1.engine.model_config.vocab_size, seed=4)[:16]
    want = _generate(tp1, prompts, _greedy(8, spec=False))
    with _tp_llm(bf16_ckpt, speculative_method=None, drafter=tp_helpers.RankDependentProposer(),
                 async_scheduling=True) as llm:
        got = _generate(llm, prompts, _greedy(8, spec=True))
        logs = llm.engine.collective_rpc(tp_helpers.probe_log)
        stats = llm.engine.get_stats()
        procs = llm.engine.executor.procs
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]     # a clean shutdown
    _assert_same(tp1, prompts, _greedy(8, spec=True), got, want)
    assert all(log == logs[0] for log in logs)
    assert stats.num_draft_tokens > 0
