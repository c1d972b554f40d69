"""The fused Triton MoE kernels under TRITON_INTERPRET=1 (CPU, tiny shapes) against the torch reference.

Triton fixes interpreter vs compiler when a function is decorated, its own standard library included,
so the variable must be set before triton is first imported: this module sets it on machines without
CUDA (where the interpreter is the only way Triton runs at all) and skips if triton came in earlier.
GPU runs of the same checks are in test_kernels_gpu.py.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from kernel_cases import TOL, make_case, rel_err  # noqa: E402

from namazu.kernels import moe_dispatch as md  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (pinned in requirements-dev.txt)")
if not triton.knobs.runtime.interpret:
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (or a GPU is present: see "
                "test_kernels_gpu.py); run this file on its own", allow_module_level=True)


@pytest.fixture(scope="module")
def tm():
    import namazu.kernels.triton_moe as mod
    return importlib.reload(mod)  # decorated again in interpreter mode if it was imported before


def poison(monkeypatch, mod):
    monkeypatch.setattr(mod, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                device=device))


@pytest.mark.parametrize("num_tokens,experts_used", [(1, None), (7, None), (9, 3)])
def test_bf16_matches_reference(tm, monkeypatch, num_tokens, experts_used):
    c = make_case(num_tokens, 64, 32, 6, 2, seed=30 + num_tokens, experts_used=experts_used)
    poison(monkeypatch, tm)
    out = tm.triton_moe_bf16(c.x, c.topk_ids, c.topk_weights, c.w13, c.w2)
    ref = md.torch_moe_bf16(c.x, c.topk_ids, c.topk_weights, c.w13, c.w2)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("num_tokens,experts_used", [(1, None), (7, None), (9, 3)])
def test_nvfp4_matches_reference(tm, monkeypatch, num_tokens, experts_used):
    # hidden 96: a K tail that is not a whole tile; 8 experts with only 3 used: idle experts skipped
    c = make_case(num_tokens, 96, 48, 8, 2, seed=40 + num_tokens, experts_used=experts_used)
    poison(monkeypatch, tm)
    out = tm.triton_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    ref = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL


def test_no_tokens(tm):
    c = make_case(0, 32, 32, 4, 2, seed=50)
    assert tm.triton_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4).shape == (0, 32)
    assert tm.triton_moe_bf16(c.x, c.topk_ids, c.topk_weights, c.w13, c.w2).shape == (0, 32)


def test_w4a4_is_refused(tm):
    c = make_case(2, 32, 32, 4, 2, seed=51, w4a4=True)
    with pytest.raises(ValueError, match="W4A16"):
        tm.triton_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)


def test_committed_tile_configs_are_valid(tm):
    for fmt, table in tm.TILE_CONFIGS.items():
        assert table[-1][0] == float("inf"), f"{fmt}: the last bucket must cover every size"
        for _, cfg in table:
            assert cfg.block_k % 32 == 0 and cfg.block_m >= 16 and cfg.block_n >= 16


def test_every_committed_config_compiles_for_hopper():
    """Ahead-of-time compile for sm_90 with Triton's own ptxas (no GPU needed), outside the interpreter."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, "-m", "namazu.kernels.triton_moe", "--arch", "90"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    from namazu.kernels.triton_moe import TILE_CONFIGS
    n_variants = 2 * sum(len(t) for t in TILE_CONFIGS.values())
    assert res.stdout.count("sm_90 ok") == n_variants, res.stdout
    # Every variant streams its tiles through cp.async (software-pipelined), or decode would wait on
    # each weight load in turn.
    for line in res.stdout.splitlines():
        assert int(line.split(" cp.async")[0].rsplit(" ", 1)[-1]) > 0, line


def test_tiles_fit_the_gpus_shared_memory(tm):
    """The committed tiles fit bf16 as they are; a float32 model's launch (twice the bytes) is refitted
    under the per-block limit (an H100/H200's 227 KiB: the prefill tile asked for 240 KiB on the first
    GPU run), and only as far as needed."""
    h200 = 232448
    for fmt, table in tm.TILE_CONFIGS.items():
        for _, cfg in table:
            w_bytes = 0.5 if fmt == "nvfp4" else 2
            for gate_up in (True, False):
                assert tm.fit_shared_memory(cfg, 2, w_bytes, gate_up, h200) == cfg
    prefill = tm.TILE_CONFIGS["bf16"][-1][1]
    assert tm.shared_memory_bytes(prefill, 4, 4, True) == 245760 > h200
    fitted = tm.fit_shared_memory(prefill, 4, 4, True, h200)
    assert tm.shared_memory_bytes(fitted, 4, 4, True) <= h200
    assert (fitted.block_m, fitted.block_n, fitted.block_k, fitted.num_stages) == (64, 128, 64, 2)
    tiny = tm.TileConfig(16, 32, 32, num_warps=1, num_stages=1)
    assert tm.fit_shared_memory(tiny, 4, 4, True, 1024) == tiny    # nothing smaller to try: left as is
