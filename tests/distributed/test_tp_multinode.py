"""A two-node launch on one machine: the engine runs node 0 (rank 0), `python -m namazu.distributed.node`
runs node 1 (rank 1) from torchrun-style variables; the step batches reach rank 1 only through the
control channel. Greedy outputs equal TP=1's (up to near-ties: `assert_same_outputs`), and node 1 exits
cleanly when the engine closes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine_helpers import assert_same_outputs

from namazu import LLM, SamplingParams
from namazu.assets.random_model import write_random_checkpoint
from namazu.distributed.env import free_port

REPO = Path(__file__).resolve().parents[2]


def test_second_node_serves_its_rank_through_the_control_channel(tmp_path, monkeypatch):
    ckpt = write_random_checkpoint(tmp_path / "m", "tiny", seed=9)
    prompts = [[5 + i, 9, 40 + 3 * i, 7] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(ckpt), executor="inline", dtype="float32") as tp1:
        want = [o.outputs[0].token_ids for o in tp1.generate(prompt_token_ids=prompts, sampling_params=params,
                                                             use_tqdm=False)]
    launch = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env = dict(os.environ, **launch, NODE_RANK="1", OMP_NUM_THREADS="1")
    node = subprocess.Popen([sys.executable, "-m", "namazu.distributed.node", "--model", str(ckpt), "--tp", "2",
                             "--dtype", "float32"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for k, v in {**launch, "NODE_RANK": "0"}.items():
            monkeypatch.setenv(k, v)
        with LLM(str(ckpt), tensor_parallel_size=2, dtype="float32") as llm:
            assert len(llm.engine.executor.pids) == 1        # node 0 started rank 0 only
            got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                use_tqdm=False)]
        out, _ = node.communicate(timeout=60)
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    assert_same_outputs(str(ckpt), prompts, params, got, want)
    assert node.returncode == 0, out
