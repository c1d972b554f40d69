"""The NVFP4 format: FP4 E2M1 values, FP8 E4M3 scales per 16 elements along K, one FP32 global scale.

Numerics follow the rules the public engines and NVIDIA's tools use (REFERENCE.md section 2):

- E2M1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, nibble = sign << 3 | index, rounded to nearest with
  ties to the even code and saturation at 6. The sign bit is taken from `x < 0`, so a small negative
  value that rounds to zero keeps its sign (code 8), as the hardware conversion does.
- Two nibbles per byte, the first element in the low nibble: `byte = q[2i] | q[2i+1] << 4`.
- Weights: `s2 = amax(W) / (6 * 448)`, block scale `sf = e4m3(clamp(amax_b / (6 * s2), 2^-9, 448))`
  (a zero block gets 1.0), `q = RNE_sat(W / (fp32(sf) * s2))`: division by the FP8-*rounded* scale, so
  the codes are computed against the scale the kernel will actually multiply by.
- Activations (W4A4): a calibrated `input_scale = amax / (6 * 448)`; per 16-block
  `SF = e4m3_sat(amax16 / 6 / input_scale)`, `q = RNE_sat(x / (fp32(SF) * input_scale))`; the GEMM
  computes `alpha * sum_b SFa_b * SFw_b * <qa_b, qw_b>` with `alpha = input_scale * weight_scale_2`.

Everything here is plain torch and runs on any device; no host sync except the NaN/Inf check on
weights, which is done once at quantization time.
"""
from __future__ import annotations

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9

# Code -> value for all 16 nibbles (codes 8..15 are the negatives; code 8 is -0).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_LUT_CACHE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def e2m1_lut(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16-entry code -> value table on `device` (cached)."""
    key = (torch.device(device), dtype)
    lut = _LUT_CACHE.get(key)
    if lut is None:
        lut = torch.tensor(_E2M1_VALUES, dtype=dtype, device=device)
        _LUT_CACHE[key] = lut
    return lut


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Rounds already-scaled fp32 values to E2M1 codes (uint8 in [0, 15]), nearest-even with saturation.

    Index of |x| = number of decision bounds it passes. A tie sits exactly on a bound; the even code
    wins, so the comparison is `>=` where the upper neighbour is even (0.75 -> 1, 1.75 -> 2, 3.5 -> 4)
    and `>` where the lower one is (0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4). Beyond 5 everything is 6.
    """
    a = x.abs()
    idx = (a > 0.25).to(torch.uint8)
    idx += a >= 0.75
    idx += a > 1.25
    idx += a >= 1.75
    idx += a > 2.5
    idx += a >= 3.5
    idx += a > 5.0
    return idx | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (uint8, any shape) -> values."""
    return e2m1_lut(codes.device, dtype)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, first element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of FP4 values ({codes.shape[-1]}) along the last dim")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 data must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn with saturation to +-448 (torch's own cast turns overflow into NaN)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _check_k(x: torch.Tensor, name: str) -> None:
    if x.dim() < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"{name}: the input dimension must be a multiple of {BLOCK} for NVFP4, "
                         f"got shape {tuple(x.shape)}")


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raises naming `name` if x has NaN or Inf (a quantized NaN would silently become 6 or 0)."""
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = (~finite).sum().item()
        kinds = []
        if bool(torch.isnan(x).any()):
            kinds.append("NaN")
        if bool(torch.isinf(x).any()):
            kinds.append("Inf")
        raise ValueError(f"{name}: cannot quantize a tensor with {'/'.join(kinds)} values "
                         f"({bad} of {x.numel()})")


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., K/16] fp32 per-block max |x|."""
    return x.float().abs().unflatten(-1, (-1, BLOCK)).amax(-1)


def global_scale_for(w: torch.Tensor) -> torch.Tensor:
    """weight_scale_2 of a tensor: amax / (6 * 448), fp32 scalar. An all-zero tensor gets 1.0 (any
    positive value decodes its zero codes to zero; zero would make later divisions undefined)."""
    amax = w.float().abs().amax()
    s2 = amax / (E2M1_MAX * E4M3_MAX)
    return torch.where(amax > 0, s2, torch.ones_like(s2))


# Block-scale multipliers tried by the optional MSE search (1.0 = the max rule; below 1 clips the block max).
SCALE_SEARCH_FACTORS = (1.0, 0.96, 0.92, 0.88, 0.84, 0.8, 0.76, 0.72)


def quantize_weight(w: torch.Tensor, global_scale: torch.Tensor | float | None = None, *, name: str = "weight",
                    scale_search: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes a weight `[..., out, in]` to NVFP4 along its last (input) dimension.

    Returns (packed uint8 [..., out, in/2], block_scale float8_e4m3fn [..., out, in/16],
    global_scale fp32 scalar = weight_scale_2). Pass `global_scale` to share one between tensors
    (gate and up of one expert use the max of their two). NaN/Inf raise a ValueError naming `name`.

    `scale_search=True` picks, per block, the block scale among `SCALE_SEARCH_FACTORS` times the max-rule
    scale that minimizes the block's squared error (still plain NVFP4; any reader decodes it). Off by
    default, where the result is byte-identical to ModelOpt's max calibration.
    """
    _check_k(w, name)
    check_finite(w, name)
    if global_scale is None:
        s2 = global_scale_for(w)
    else:
        s2 = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device).reshape(())
        if not bool(torch.isfinite(s2)) or not bool(s2 > 0):
            raise ValueError(f"{name}: global_scale must be positive and finite, got {float(s2)}")
    amax_b = _block_amax(w)
    sf = amax_b / (E2M1_MAX * s2)
    sf = torch.where(sf == 0, torch.ones_like(sf), sf)
    wb = w.float().unflatten(-1, (-1, BLOCK))
    best_sf8, best_codes, best_err = None, None, None
    for f in SCALE_SEARCH_FACTORS if scale_search else (1.0,):
        sf8 = (sf * f if f != 1.0 else sf).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
        denom = (sf8.float() * s2).unsqueeze(-1)
        codes = e2m1_encode(wb / denom)
        if not scale_search:
            return pack_nibbles(codes.flatten(-2)), sf8, s2
        err = (e2m1_decode(codes) * denom - wb).square().sum(-1)
        if best_err is None:
            best_sf8, best_codes, best_err = sf8, codes, err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_sf8 = torch.where(better, sf8.view(torch.uint8), best_sf8.view(torch.uint8)).view(torch.float8_e4m3fn)
        best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
    return pack_nibbles(best_codes.flatten(-2)), best_sf8, s2


def dequantize_weight(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor | float,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`e2m1(q) * fp32(sf) * s2` -> [..., out, in] in `dtype` (leading dims, e.g. experts, are kept)."""
    if packed.shape[:-1] != block_scale.shape[:-1] or packed.shape[-1] * 2 != block_scale.shape[-1] * BLOCK:
        raise ValueError(f"packed {tuple(packed.shape)} and block_scale {tuple(block_scale.shape)} "
                         f"do not describe the same NVFP4 tensor (expect [..., K/2] and [..., K/16])")
    vals = e2m1_decode(unpack_nibbles(packed)).unflatten(-1, (-1, BLOCK))
    s2 = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    if s2.dim() > 0:  # one global scale per leading index (e.g. per expert): [E] -> [E, 1, 1]
        s2 = s2.reshape(*s2.shape, *([1] * (block_scale.dim() - s2.dim())))
    scale = block_scale.float() * s2
    return (vals * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def input_scale_for(amax: torch.Tensor | float) -> torch.Tensor:
    """input_scale from a calibrated activation amax: amax / (6 * 448), fp32 scalar."""
    return torch.as_tensor(amax, dtype=torch.float32) / (E2M1_MAX * E4M3_MAX)


def quantize_activation(x: torch.Tensor,
                        input_scale: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-16 activation quantization with a static global scale, as Blackwell kernels do it.

    Returns (codes uint8 [..., K] unpacked, block_scale float8_e4m3fn [..., K/16]). The dequantized
    activation is `e2m1(codes) * fp32(block_scale) * input_scale`. `input_scale` may be a scalar or
    broadcast against the leading dims of x (e.g. one per token's expert).
    """
    _check_k(x, "activation")
    s = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device)
    if s.dim() > 0:
        s = s.unsqueeze(-1)
    xb = x.float().unflatten(-1, (-1, BLOCK))
    # SF = (1 / input_scale) * amax16 / 6, saturated to the FP8 range; a block whose SF rounds to 0
    # quantizes to zeros (the kernel multiplies by a zero reciprocal there).
    sf8 = e4m3_round((1.0 / s) * (xb.abs().amax(-1) / E2M1_MAX))
    denom = sf8.float() * s
    scaled = torch.where(denom.unsqueeze(-1) > 0, xb / denom.unsqueeze(-1), torch.zeros_like(xb))
    return e2m1_encode(scaled.flatten(-2)), sf8


def fake_quantize_activation(x: torch.Tensor, input_scale: torch.Tensor | float,
                             include_global: bool = True) -> torch.Tensor:
    """x -> its NVFP4 round trip in fp32. With `include_global=False` the result is `e2m1 * SF` only,
    i.e. what the tensor core multiplies; the caller applies `input_scale` inside alpha."""
    codes, sf8 = quantize_activation(x, input_scale)
    vals = e2m1_decode(codes).unflatten(-1, (-1, BLOCK)) * sf8.float().unsqueeze(-1)
    out = vals.flatten(-2)
    if include_global:
        s = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device)
        out = out * (s.unsqueeze(-1) if s.dim() > 0 else s)
    return out


def nvfp4_bytes(numel: int) -> int:
    """Storage bytes of `numel` NVFP4 values: 4-bit codes plus one 1-byte scale per 16 (4.5 bits/value)."""
    return numel // 2 + numel // BLOCK
