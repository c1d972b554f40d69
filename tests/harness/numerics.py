"""Comparing two computations of the same value: equal up to the rounding their summation order allows.

BLAS libraries (MKL, OpenBLAS, oneDNN, cuBLAS) choose a GEMM's blocking, and with it the order in which
each dot product is summed, by shape, memory layout, thread count and CPU. Two ways of computing the same
product (a fused q/k/v weight and three separate ones, M rows at once or one at a time) therefore agree
to rounding, not to the bit, and which bits differ is a property of the machine. Tests of such pairs
compare with this tolerance; tests of one computation against itself (a round trip, a copy, a row-wise
op on the same values) stay exact.
"""
from __future__ import annotations

import torch

# A length-K fp32 dot product summed in two orders differs by about sqrt(K) ulps of its magnitude
# (K * u in the worst case); through a drafter layer or two (attention, MLP, norms) the difference seen
# on namazu's shapes is up to ~20 ulps of the tensor's largest entry (docs/engine.md, "What is
# bit-identical, and where"). 128 ulps leaves room for another machine's blocking and is still about
# 1e-5 of the tensor's scale: any real defect (a wrong weight slice, rotation or mask) is O(1) there.
REORDER_ULPS = 128


def assert_equal_up_to_reordering(got: torch.Tensor, want: torch.Tensor, what: object = "",
                                  ulps: int = REORDER_ULPS) -> None:
    """got equals want up to `ulps` units in the last place of want's largest magnitude, in want's
    dtype (a scale-relative bound: each entry's error comes from sums over the whole scale)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    scale = float(want.abs().max()) if want.numel() else 0.0
    tol = ulps * torch.finfo(want.dtype).eps * scale
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= tol, f"{what}: max |difference| {err:.3e} > {tol:.3e} ({ulps} ulps of {scale:.3e})"
