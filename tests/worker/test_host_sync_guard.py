"""No host synchronisation inside a step: decode, mixed prefill/decode and verify batches, with every
sampling feature on (logit_bias too), run under the guard; a planted sync is caught."""
import pytest
from engine_helpers import prompts, tiny_checkpoint

from namazu import LLM, SamplingParams
from namazu.spec.drafters import ScriptedDrafter
from namazu.worker.host_sync_guard import HostSyncError


def features(i: int) -> SamplingParams:
    return [
        SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=i, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                       max_tokens=8, prompt_logprobs=2, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.7, allowed_token_ids=list(range(65, 91)), min_tokens=4, max_tokens=8),
        SamplingParams(temperature=0.9, seed=i, logit_bias={70: 100.0, 71: -100.0, 5: 3.5}, max_tokens=8,
                       ignore_eos=True),
    ][i % 5]


@pytest.mark.parametrize("drafter_mode", [None, "random", "random_q"])
def test_steps_do_not_sync(drafter_mode):
    batch = prompts(8, lo=5, hi=50, seed=11)
    drafter = ScriptedDrafter(drafter_mode, 264, seed=1) if drafter_mode else None
    # A 24-token budget splits the long prompts, so prefill chunks share steps with decodes.
    with LLM(tiny_checkpoint(), executor="inline", debug_no_host_sync=True, max_num_batched_tokens=24,
             max_num_seqs=8, drafter=drafter, num_speculative_tokens=2 if drafter else 0) as llm:
        kinds = set()
        submit = llm.engine.executor.submit

        def spy(b):
            prefill = len(b.attn.input_ids) > len(b.attn.logit_rows)
            kinds.add(("mixed" if prefill and len(b.spec.row_layout) else "prefill") if prefill else "decode")
            if b.spec.max_drafts:
                kinds.add("verify")
            return submit(b)

        llm.engine.executor.submit = spy
        outs = llm.generate(prompt_token_ids=batch, sampling_params=[features(i) for i in range(8)],
                            use_tqdm=False)
    assert all(o.finished for o in outs)
    assert {"mixed", "decode"} <= kinds
    if drafter_mode:
        assert "verify" in kinds
    allowed = outs[3].outputs[0].token_ids
    assert all(65 <= t < 91 for t in allowed) and len(allowed) >= 4
    assert set(outs[4].outputs[0].token_ids) == {70}          # +100 wins over any logit of the tiny model


def test_a_planted_sync_is_caught(monkeypatch):
    import namazu.worker.model_runner as mr

    real = mr.sample_from_processed

    def syncing(processed, t):
        processed.max().item()
        return real(processed, t)

    monkeypatch.setattr(mr, "sample_from_processed", syncing)
    with LLM(tiny_checkpoint(), executor="inline", debug_no_host_sync=True) as llm:
        with pytest.raises(HostSyncError):
            llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2),
                         use_tqdm=False)
