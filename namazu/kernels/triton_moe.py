"""Fused MoE in Triton: BF16 weights, and NVFP4 weights dequantized in registers (W4A16, Hopper's path).

Two launches per layer over the block-padded expert order of `moe_dispatch.block_dispatch`:

  gate_up  rows of x gathered by token, times the expert's gate and up rows, SiLU(gate) * up fused in
           the epilogue -> intermediate [padded rows, I] in x's dtype
  down     intermediate times the expert's down rows, times the row's router weight -> [N*k, H];
           the k rows of a token are summed by torch (deterministic, no atomics)

NVFP4 tiles are loaded as packed bytes: the low nibbles multiply the even K columns of the activations
and the high nibbles the odd ones, so no interleave is needed; E2M1 and E4M3 codes become floats by
placing their bits in an fp16 and rescaling (exact, no table). Grids have a static size (an upper bound
of the padded rows); programs past the real row count exit at once, so nothing syncs with the host.

Tile configurations are committed in TILE_CONFIGS (no autotuning at run time).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from namazu.kernels.moe_dispatch import BlockDispatch, block_dispatch
from namazu.kernels.moe_types import NVFP4MoEWeights

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend registry reports Triton as unavailable
    triton = None
    tl = None


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Chosen by rows per expert (N*k / E): decode rows are few, so small block_m and wide K tiles keep the
# weight stream (the bound at decode) in flight; prefill rows fill 64-row tiles. block_k is a multiple
# of 32 so each nibble half is at least the 16 columns a tensor-core dot needs.
# The decode and mid entries come from bench/tune_triton.py on an H200 (Kimi-K2 expert shape, 64 and
# 512 tokens; bench/RESULTS.md, "GPU check"): 1.22x (nvfp4 decode), 1.14x (nvfp4 mid) and 1.11x (bf16 mid)
# the tiles committed before; bf16 decode's best was within 1% of its tile, which stays.
TILE_CONFIGS: dict[str, list[tuple[float, TileConfig]]] = {
    "bf16": [
        (4.0, TileConfig(16, 64, 128, num_warps=4, num_stages=4)),
        (32.0, TileConfig(32, 128, 128, num_warps=8, num_stages=3)),
        (float("inf"), TileConfig(64, 128, 64, num_warps=8, num_stages=3)),
    ],
    "nvfp4": [
        (4.0, TileConfig(16, 64, 128, num_warps=4, num_stages=3)),
        (32.0, TileConfig(32, 128, 128, num_warps=4, num_stages=3)),
        (float("inf"), TileConfig(64, 128, 128, num_warps=8, num_stages=3)),
    ],
}
# Under TRITON_INTERPRET=1 (CPU tests) every program runs in numpy: small tiles keep tests fast.
INTERPRET_CONFIG = TileConfig(16, 32, 32, num_warps=1, num_stages=1)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch and output buffers (a seam for tests that poison them to prove every element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def pick_config(fmt: str, num_pairs: int, num_experts: int) -> TileConfig:
    if interpreting():
        return INTERPRET_CONFIG
    rows_per_expert = num_pairs / max(num_experts, 1)
    for bound, cfg in TILE_CONFIGS[fmt]:
        if rows_per_expert <= bound:
            return cfg
    return TILE_CONFIGS[fmt][-1][1]


if triton is not None:

    @triton.jit
    def _e2m1_to_f32(code):
        # E2M1 s|ee|m -> fp16 bits s|0ee..|m00..: the same value times 2^-14 (subnormal 0.5 included).
        c = code.to(tl.uint16)
        bits = ((c & 8) << 12) | ((c & 7) << 9)
        return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0

    @triton.jit
    def _e4m3_to_f32(byte):
        # E4M3 0|eeee|mmm -> fp16 bits 0|0eeee|mmm0000000: the same value times 2^-8 (block scales >= 0).
        bits = (byte.to(tl.uint16) & 0x7F) << 7
        return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0

    @triton.jit
    def _fp4_weights(w_rows, s_rows, k0, K, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT: tl.constexpr):
        """One [BLOCK_N, BLOCK_K] NVFP4 weight tile as (even-column values, odd-column values), each
        [BLOCK_N, BLOCK_K / 2] in DOT: the low and high nibbles of the packed bytes, times the block scale
        (loaded once per 16-block and broadcast over its 8 bytes). The global scale is applied later."""
        HALF_K: tl.constexpr = BLOCK_K // 2
        NB: tl.constexpr = BLOCK_K // 16
        byte = k0 // 2 + tl.arange(0, HALF_K)
        wb = tl.load(w_rows + byte[None, :], mask=n_ok[:, None] & (byte < K // 2)[None, :], other=0)
        blk = k0 // 16 + tl.arange(0, NB)
        sb = tl.load(s_rows + blk[None, :], mask=n_ok[:, None] & (blk < K // 16)[None, :], other=0)
        scale = tl.reshape(tl.broadcast_to(_e4m3_to_f32(sb)[:, :, None], (BLOCK_N, NB, 8)), (BLOCK_N, HALF_K))
        w_lo = (_e2m1_to_f32(wb & 0xF) * scale).to(DOT)
        w_hi = (_e2m1_to_f32(wb >> 4) * scale).to(DOT)
        return w_lo, w_hi

    @triton.jit
    def _fused_moe_kernel(
        a_ptr, out_ptr, w_ptr, ws_ptr, wgs_ptr, sorted_pairs_ptr, block_expert_ptr, total_rows_ptr,
        topk_w_ptr, num_pairs, K, N_OUT,
        stride_am, stride_om, stride_we, stride_wn, stride_se, stride_sn,
        TOPK: tl.constexpr, GATE_UP: tl.constexpr, FP4: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(total_rows_ptr):
            return
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs_ptr + offs_p)
        row_ok = pair < num_pairs
        # gate_up reads x by token; down reads the intermediate in padded order.
        a_row = (pair // TOPK).to(tl.int64) if GATE_UP else offs_p.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N_OUT
        w_base = w_ptr + e * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        dot_dtype = tl.float32 if UPCAST else a_ptr.dtype.element_ty
        if FP4:
            HALF_K: tl.constexpr = BLOCK_K // 2
            offs_j = tl.arange(0, HALF_K)
            s_base = ws_ptr + e * stride_se
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + 2 * offs_j
                a_ptrs = a_ptr + a_row[:, None] * stride_am + kk[None, :]
                a_mask = row_ok[:, None] & (kk < K)[None, :]
                a_even = tl.load(a_ptrs, mask=a_mask, other=0.0).to(dot_dtype)
                a_odd = tl.load(a_ptrs + 1, mask=a_mask, other=0.0).to(dot_dtype)
                w_lo, w_hi = _fp4_weights(w_base + offs_n[:, None] * stride_wn, s_base + offs_n[:, None] * stride_sn,
                                          k0, K, n_ok, BLOCK_N, BLOCK_K, dot_dtype)
                acc += tl.dot(a_even, tl.trans(w_lo)) + tl.dot(a_odd, tl.trans(w_hi))
                if GATE_UP:
                    up_rows = offs_n + N_OUT
                    w_lo, w_hi = _fp4_weights(w_base + up_rows[:, None] * stride_wn,
                                              s_base + up_rows[:, None] * stride_sn, k0, K, n_ok, BLOCK_N,
                                              BLOCK_K, dot_dtype)
                    acc_up += tl.dot(a_even, tl.trans(w_lo)) + tl.dot(a_odd, tl.trans(w_hi))
            gs = tl.load(wgs_ptr + e)
            acc = acc * gs
            acc_up = acc_up * gs
        else:
            offs_k = tl.arange(0, BLOCK_K)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                k_ok = kk < K
                a = tl.load(a_ptr + a_row[:, None] * stride_am + kk[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(dot_dtype)
                w_mask = n_ok[:, None] & k_ok[None, :]
                w = tl.load(w_base + offs_n[:, None] * stride_wn + kk[None, :], mask=w_mask, other=0.0)
                acc += tl.dot(a, tl.trans(w.to(dot_dtype)))
                if GATE_UP:
                    w = tl.load(w_base + (offs_n + N_OUT)[:, None] * stride_wn + kk[None, :], mask=w_mask,
                                other=0.0)
                    acc_up += tl.dot(a, tl.trans(w.to(dot_dtype)))
        if GATE_UP:
            # SiLU(gate) * up; padded rows have zero inputs and so store zeros.
            res = acc / (1.0 + tl.exp(-acc)) * acc_up
            o_ptrs = out_ptr + offs_p.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])
        else:
            rw = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)
            res = acc * rw[:, None]
            o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def shared_memory_bytes(cfg: TileConfig, a_bytes: float, w_bytes: float, gate_up: bool) -> int:
    """Shared memory a launch's software pipeline holds: per stage an activation tile [block_m, block_k]
    and one weight tile [block_k, block_n] (two with GATE_UP: the gate and up rows)."""
    per_stage = cfg.block_m * cfg.block_k * a_bytes + (2 if gate_up else 1) * cfg.block_k * cfg.block_n * w_bytes
    return int(cfg.num_stages * per_stage)


def fit_shared_memory(cfg: TileConfig, a_bytes: float, w_bytes: float, gate_up: bool, limit: int) -> TileConfig:
    """The committed tiles are sized for bf16; fp32 activations and weights (a float32 model) need twice
    the shared memory and overflow the GPU's per-block limit. Fewer pipeline stages first, then narrower
    K tiles, until the launch fits."""
    while limit and shared_memory_bytes(cfg, a_bytes, w_bytes, gate_up) > limit:
        if cfg.num_stages > 1:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 32:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        else:
            break
    return cfg


@functools.cache
def _shared_memory_limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 0)


def _launch(a: torch.Tensor, out: torch.Tensor, w: torch.Tensor, ws: torch.Tensor | None, wgs: torch.Tensor | None,
            bd: BlockDispatch, topk_w: torch.Tensor, k_dim: int, n_out: int, top_k: int, gate_up: bool,
            cfg: TileConfig) -> None:
    fp4 = ws is not None
    if a.is_cuda:
        # Packed FP4 weights: two values a byte.
        cfg = fit_shared_memory(cfg, a.element_size(), 0.5 if fp4 else w.element_size(), gate_up,
                                _shared_memory_limit(a.device.index or 0))
    if fp4:
        ws_u8 = ws.view(torch.uint8)
        s_strides = (ws_u8.stride(0), ws_u8.stride(1))
    else:
        ws_u8, wgs, s_strides = w, w, (0, 0)  # unused by the BF16 variant
    grid = (bd.max_rows // cfg.block_m, triton.cdiv(n_out, cfg.block_n))
    _fused_moe_kernel[grid](
        a, out, w, ws_u8, wgs, bd.sorted_pairs, bd.block_expert, bd.total_rows, topk_w, bd.num_pairs, k_dim, n_out,
        a.stride(0), out.stride(0), w.stride(0), w.stride(1), s_strides[0], s_strides[1],
        TOPK=top_k, GATE_UP=gate_up, FP4=fp4, UPCAST=interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor, fmt: str, w13_scale=None, w13_gs=None, w2_scale=None, w2_gs=None,
               inter: int | None = None, config: TileConfig | None = None) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("the Triton MoE backend needs the `triton` package")
    n, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    cfg = config or pick_config(fmt, n * top_k, num_experts)
    x = x.contiguous()
    bd = block_dispatch(topk_ids, num_experts, cfg.block_m)
    inter_act = _empty((bd.max_rows, inter), x.dtype, x.device)
    _launch(x, inter_act, w13, w13_scale, w13_gs, bd, topk_weights, hidden, inter, top_k, True, cfg)
    pair_out = _empty((n * top_k, hidden), torch.float32, x.device)
    tw = topk_weights.reshape(-1).float().contiguous()
    _launch(inter_act, pair_out, w2, w2_scale, w2_gs, bd, tw, inter, hidden, top_k, False, cfg)
    return pair_out.view(n, top_k, hidden).sum(1).to(x.dtype)


def triton_moe_bf16(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
    """Fused MoE over BF16 stacked weights (w13 [E, 2I, H] gate rows first, w2 [E, H, I]).
    `config` overrides the committed tile table (bench/tune_triton.py uses it)."""
    return _fused_moe(x, topk_ids, topk_weights, w13.contiguous(), w2.contiguous(), "bf16",
                      inter=w13.shape[1] // 2, config=config)


def triton_moe_nvfp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     w: NVFP4MoEWeights, config: TileConfig | None = None) -> torch.Tensor:
    """Fused MoE over NVFP4 weights, W4A16: packed FP4 dequantized to x's dtype in registers."""
    if w.a13_scale is not None:
        raise ValueError("the Triton MoE kernel is weight-only (W4A16); W4A4 emulation runs on the torch or "
                         "cpp backend")
    return _fused_moe(x, topk_ids, topk_weights, w.w13_packed.contiguous(), w.w2_packed.contiguous(), "nvfp4",
                      w13_scale=w.w13_scale.contiguous(), w13_gs=w.w13_gs.float().contiguous(),
                      w2_scale=w.w2_scale.contiguous(), w2_gs=w.w2_gs.float().contiguous(),
                      inter=w.intermediate_size, config=config)


def aot_compile(arch: int = 90) -> list[str]:
    """Compiles every committed tile configuration for CUDA compute capability `arch` without a GPU
    (Triton's own ptxas), so a machine without one can still prove the kernels build for Hopper.
    Returns one line per variant. Must run without TRITON_INTERPRET (interpreted kernels do not compile)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if interpreting():
        raise RuntimeError("unset TRITON_INTERPRET to compile the kernels ahead of time")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = _fused_moe_kernel
    lines = []
    for fmt, table in TILE_CONFIGS.items():
        fp4 = fmt == "nvfp4"
        for _, cfg in table:
            for gate_up in (True, False):
                sig = {"a_ptr": "*bf16", "out_ptr": "*bf16" if gate_up else "*fp32",
                       "w_ptr": "*u8" if fp4 else "*bf16", "ws_ptr": "*u8" if fp4 else "*bf16",
                       "wgs_ptr": "*fp32" if fp4 else "*bf16", "sorted_pairs_ptr": "*i32",
                       "block_expert_ptr": "*i32", "total_rows_ptr": "*i32", "topk_w_ptr": "*fp32",
                       "num_pairs": "i32", "K": "i32", "N_OUT": "i32", "stride_am": "i32", "stride_om": "i32",
                       "stride_we": "i64", "stride_wn": "i32", "stride_se": "i64", "stride_sn": "i32"}
                consts = {"TOPK": 8, "GATE_UP": gate_up, "FP4": fp4, "UPCAST": False, "BLOCK_M": cfg.block_m,
                          "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
                sig.update(dict.fromkeys(consts, "constexpr"))
                # As the JIT specialises them at Kimi-K2 sizes: pointers, K, N_OUT and the row strides are
                # multiples of 16 (what lets loads be vectorised and software-pipelined).
                aligned = [n for n, t in sig.items() if t.startswith("*")] + [
                    "K", "N_OUT", "stride_am", "stride_om", "stride_we", "stride_wn", "stride_se", "stride_sn"]
                src = ASTSource(fn=kernel, signature=sig,
                                constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()},
                                attrs={(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
                ptx = compiled.asm["ptx"]
                lines.append(f"{fmt} {'gate_up' if gate_up else 'down'} {cfg}: sm_{arch} ok, "
                             f"{compiled.metadata.shared} B shared memory, {ptx.count('cp.async.')} cp.async, "
                             f"{ptx.count('mma.sync')} mma.sync, {ptx.count('wgmma.mma_async')} wgmma")
    return lines


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Compile the fused MoE kernels ahead of time (no GPU needed).")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for Hopper")
    print("\n".join(aot_compile(parser.parse_args().arch)))
