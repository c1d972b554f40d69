"""The cubin grouped GEMM launched through cuda-python against the torch reference (a GPU test: `make
gpu-check` runs it, where a skip is a failure). On CPU machines tests/kernels/test_cubin_loader.py covers the path
up to the driver."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import TOL, make_case, rel_err

from namazu.kernels import moe_dispatch as md

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (these run in `make gpu-check`)", allow_module_level=True)


@pytest.mark.parametrize("num_tokens,experts_used", [(1, None), (33, None), (40, 5)])
def test_cubin_nvfp4_matches_reference(num_tokens, experts_used):
    from namazu.kernels.cubin_loader import cubin_moe_nvfp4

    c = make_case(num_tokens, 512, 256, 16, 4, seed=700 + num_tokens, experts_used=experts_used, device="cuda")
    out = cubin_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    ref = md.torch_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL


def test_cubin_launch_is_captured_by_a_cuda_graph():
    from namazu.kernels.cubin_loader import cubin_moe_nvfp4

    c = make_case(8, 512, 256, 16, 4, seed=800, device="cuda")
    ref = cubin_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)   # loads outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cubin_moe_nvfp4(c.x, c.topk_ids, c.topk_weights, c.nvfp4)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
