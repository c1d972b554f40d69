// NVFP4 W4A4 MoE grouped GEMM on Blackwell (sm_100a) with the native block-scaled FP4 MMA; layout, encodings
// and argument structs in nvfp4_moe_sm100.h. Kernels with C names for the cubin loader
// (namazu/kernels/cuda_sm100.py):
//
//   nvfp4_sm100_quant_act   bf16 rows in block_dispatch order -> E2M1 codes + E4M3 scales per 16 values,
//                           with the row's expert input scale (NVFP4 activation rule, as
//                           namazu.quant.nvfp4.quantize_activation); padding rows -> zero codes and scales
//   nvfp4_sm100_gemm_gate_up / nvfp4_sm100_gemm_down
//                           one CTA (4 warps) = 128 rows x 128 MMA columns of one expert; per 128-value K
//                           stage: cp.async A and W bytes into shared memory (canonical K-major, no
//                           swizzle), tcgen05.st the stage's scales into tensor memory, one thread issues
//                           two tcgen05.mma (K = 64 each) and tcgen05.commit to the stage's mbarrier; the
//                           next stage loads while they run (two buffers). Epilogue: tcgen05.ld the fp32
//                           accumulator (row m = TMEM lane m), alpha, SiLU-and-mul (gate_up, bf16 rounding
//                           of g, u and the product as the W4A4 reference) or router weight (down).
//
// Why W4A4 (not W4A16): the block-scaled MMA takes FP4 (or FP6/FP8) for both operands; bf16 activations
// would need kind::f16 on dequantized weights, which is the Hopper path. The accuracy consequence is the
// NVFP4 activation rounding of the checkpoint's calibrated input scales (the engine's w4a4 mode, whose torch
// and cpp emulations round at exactly these points).
//
// Why the ModelOpt weight layout (not the decode layout): the MMA reads K-major rows of packed E2M1 with one
// scale per 16 consecutive K values of a row, which is ModelOpt's [rows, K/2] + [rows, K/16]; a 16-byte
// cp.async moves one core-matrix row as is, and no second copy of the experts is needed.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "nvfp4_moe_sm100.h"

namespace {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// cp.async writes through the generic proxy; tcgen05.mma reads shared memory through the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ void tc_fence_before() { asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory"); }
__device__ __forceinline__ void tc_fence_after() { asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory"); }

__device__ __forceinline__ void tmem_store1(uint32_t taddr, uint32_t v) {
  asm volatile("tcgen05.st.sync.aligned.32x32b.x1.b32 [%0], {%1};\n" ::"r"(taddr), "r"(v) : "memory");
}

__device__ __forceinline__ void tmem_store4(uint32_t taddr, const uint32_t (&v)[4]) {
  asm volatile("tcgen05.st.sync.aligned.32x32b.x4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(taddr), "r"(v[0]),
               "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}

__device__ __forceinline__ void tmem_load16(uint32_t taddr, float (&v)[16]) {
  uint32_t r[16];
  asm volatile(
      "tcgen05.ld.sync.aligned.32x32b.x16.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "
      "%14, %15}, [%16];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7]),
        "=r"(r[8]), "=r"(r[9]), "=r"(r[10]), "=r"(r[11]), "=r"(r[12]), "=r"(r[13]), "=r"(r[14]), "=r"(r[15])
      : "r"(taddr)
      : "memory");
  asm volatile("tcgen05.wait::ld.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __uint_as_float(r[i]);
}

// D[tmem] (+)= (A * SFA) . (B * SFB)^T for one 128 x 128 x 64 step; accumulate = 0 overwrites D.
__device__ __forceinline__ void mma_fp4(uint32_t d_tmem, uint64_t adesc, uint64_t bdesc, uint32_t idesc,
                                        uint32_t sfa_tmem, uint32_t sfb_tmem, uint32_t accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %4, 0;\n"
      " tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X [%0], %1, %2, %3, [%5], [%6], p;\n}\n"
      ::"r"(d_tmem), "l"(adesc), "l"(bdesc), "r"(idesc), "r"(accumulate), "r"(sfa_tmem), "r"(sfb_tmem)
      : "memory");
}

__device__ __forceinline__ void mma_commit(uint64_t* bar) {
  asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n" ::"r"(
                   smem_u32(bar))
               : "memory");
}

struct Tile {
  const uint8_t* a;       // A codes of the block's first row
  const uint8_t* a_sf;    // A scales of the block's first row
  const uint8_t* w;       // the expert's packed weights
  const uint8_t* w_sf;    // the expert's weight scales
  int64_t kb, ks;         // bytes and scales per row
  int64_t n0, n_out;
  int gate_up;
};

// Stage `s` of the tile into buffer `buf`: 128 rows x 64 bytes of A and of W by cp.async (16 bytes a core
// matrix row, 4 per thread per operand), and this warp's lane partition of the stage's scales (2 MMAs x
// A and B) by tcgen05.st, in the arrangement kSfLane names (nvfp4_moe_sm100.h: 32 x 4 words duplicated in
// every partition, or one word per lane = row).
template <bool kSfLane>
__device__ __forceinline__ void load_stage(const Tile& t, int s, uint32_t a_smem, uint32_t b_smem, uint32_t tmem,
                                           int buf) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int i = tid + NVFP4_SM100_THREADS * q;
    const uint32_t row = i >> 2, chunk = i & 3;
    const int64_t kbyte = (int64_t)s * (NVFP4_SM100_BK / 2) + chunk * 16;
    const uint32_t off = nvfp4_sm100_smem_offset(row, chunk * 16);
    cp_async16(a_smem + off, t.a + row * t.kb + kbyte);
    const int64_t wrow = nvfp4_sm100_weight_row(t.gate_up, t.n0, t.n_out, row);
    cp_async16(b_smem + off, t.w + wrow * t.kb + kbyte);
  }
  const uint32_t warp = tid >> 5, lane = tid & 31;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t word = (int64_t)s * (NVFP4_SM100_BK / 16) + j * 4;
    const uint32_t col_a = nvfp4_sm100_sf_col(NVFP4_SM100_SFA_COL, buf, j);
    const uint32_t col_b = nvfp4_sm100_sf_col(NVFP4_SM100_SFB_COL, buf, j);
    if constexpr (kSfLane) {
      const uint32_t r = nvfp4_sm100_sf_lane_row(warp, lane);
      const int64_t wrow = nvfp4_sm100_weight_row(t.gate_up, t.n0, t.n_out, r);
      tmem_store1(nvfp4_sm100_tmem_addr(tmem, 32 * warp, col_a),
                  *reinterpret_cast<const uint32_t*>(t.a_sf + r * t.ks + word));
      tmem_store1(nvfp4_sm100_tmem_addr(tmem, 32 * warp, col_b),
                  *reinterpret_cast<const uint32_t*>(t.w_sf + wrow * t.ks + word));
    } else {
      uint32_t sa[4], sb[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint32_t r = nvfp4_sm100_sf_row(lane, c);
        sa[c] = *reinterpret_cast<const uint32_t*>(t.a_sf + r * t.ks + word);
        const int64_t wrow = nvfp4_sm100_weight_row(t.gate_up, t.n0, t.n_out, r);
        sb[c] = *reinterpret_cast<const uint32_t*>(t.w_sf + wrow * t.ks + word);
      }
      tmem_store4(nvfp4_sm100_tmem_addr(tmem, 32 * warp, col_a), sa);
      tmem_store4(nvfp4_sm100_tmem_addr(tmem, 32 * warp, col_b), sb);
    }
  }
}

// Make a loaded stage visible to the MMA: the thread's cp.async done and fenced to the async proxy, its
// tcgen05.st done, then the CTA barrier (tcgen05 ordering across it by the fence pair).
__device__ __forceinline__ void publish_stage() {
  cp_async_wait_all();
  fence_proxy_async();
  asm volatile("tcgen05.wait::st.sync.aligned;\n" ::: "memory");
  tc_fence_before();
  __syncthreads();
  tc_fence_after();
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

template <bool kGateUp>
__device__ __forceinline__ void epilogue(const Nvfp4Sm100Args& p, uint32_t tmem, int64_t row0, int64_t n0,
                                         float alpha) {
  const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = row0 + 32 * warp + lane;
  const uint32_t lane_base = nvfp4_sm100_tmem_addr(tmem, 32 * warp, NVFP4_SM100_ACC_COL);
  if constexpr (kGateUp) {
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + row * p.n_out + n0;
#pragma unroll 1
    for (int c0 = 0; c0 < 64; c0 += 16) {
      float g[16], u[16];
      tmem_load16(lane_base + c0, g);
      tmem_load16(lane_base + 64 + c0, u);
      alignas(16) __nv_bfloat16 h[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float gb = __bfloat162float(__float2bfloat16(alpha * g[i]));
        const float ub = __bfloat162float(__float2bfloat16(alpha * u[i]));
        h[i] = __float2bfloat16(silu(gb) * ub);
      }
      reinterpret_cast<uint4*>(out + c0)[0] = reinterpret_cast<const uint4*>(h)[0];
      reinterpret_cast<uint4*>(out + c0)[1] = reinterpret_cast<const uint4*>(h)[1];
    }
  } else {
    const int32_t pair = p.sorted_pairs[row];
    const bool real = pair < p.num_pairs;
    const float scale = real ? alpha * p.topk_weights[pair] : 0.0f;
    float* out = static_cast<float*>(p.out) + (real ? (int64_t)pair : 0) * p.n_out + n0;
#pragma unroll 1
    for (int c0 = 0; c0 < 128; c0 += 16) {
      float acc[16];
      tmem_load16(lane_base + c0, acc);   // warp-collective: every lane loads, padding rows store nothing
      if (real) {
#pragma unroll
        for (int i = 0; i < 16; i += 4)
          *reinterpret_cast<float4*>(out + c0 + i) =
              make_float4(scale * acc[i], scale * acc[i + 1], scale * acc[i + 2], scale * acc[i + 3]);
      }
    }
  }
}

template <bool kGateUp, bool kSfLane>
__device__ __forceinline__ void gemm_tile(const Nvfp4Sm100Args& p) {
  __shared__ alignas(1024) uint8_t smem_a[2][NVFP4_SM100_STAGE_BYTES];
  __shared__ alignas(1024) uint8_t smem_b[2][NVFP4_SM100_STAGE_BYTES];
  __shared__ alignas(8) uint64_t bars[2];
  __shared__ uint32_t tmem_slot;

  const int64_t row0 = (int64_t)blockIdx.x * NVFP4_SM100_BM;
  if (row0 >= *p.total_rows) return;   // uniform over the CTA: before any collective
  const int e = p.block_expert[blockIdx.x];
  const int64_t n0 = (int64_t)blockIdx.y * nvfp4_sm100_cols_per_cta(kGateUp);
  const int64_t w_rows = kGateUp ? 2 * p.n_out : p.n_out;
  Tile t;
  t.kb = p.k_dim / 2;
  t.ks = p.k_dim / 16;
  t.a = p.a_codes + row0 * t.kb;
  t.a_sf = p.a_scale + row0 * t.ks;
  t.w = p.w_packed + (int64_t)e * w_rows * t.kb;
  t.w_sf = p.w_scale + (int64_t)e * w_rows * t.ks;
  t.n0 = n0;
  t.n_out = p.n_out;
  t.gate_up = kGateUp;

  if (threadIdx.x < 32) {   // warp 0 owns the tensor memory allocation
    asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;\n" ::"r"(smem_u32(&tmem_slot)),
                 "n"(NVFP4_SM100_TMEM_COLS)
                 : "memory");
    asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n" ::: "memory");
  }
  if (threadIdx.x == 0) {
    mbar_init(&bars[0]);
    mbar_init(&bars[1]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  tc_fence_before();
  __syncthreads();
  tc_fence_after();
  const uint32_t tmem = tmem_slot;
  const uint32_t idesc = nvfp4_sm100_instr_desc(NVFP4_SM100_BM, NVFP4_SM100_BN);
  const int stages = (int)(p.k_dim / NVFP4_SM100_BK);

  load_stage<kSfLane>(t, 0, smem_u32(smem_a[0]), smem_u32(smem_b[0]), tmem, 0);
  for (int s = 0; s < stages; ++s) {
    const int buf = s & 1;
    publish_stage();
    if (threadIdx.x == 0) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t off = j * 2 * NVFP4_SM100_LBO;   // the MMA's two 16-byte K columns of core matrices
        mma_fp4(nvfp4_sm100_tmem_addr(tmem, 0, NVFP4_SM100_ACC_COL),
                nvfp4_sm100_smem_desc(smem_u32(smem_a[buf]) + off, NVFP4_SM100_LBO, NVFP4_SM100_SBO),
                nvfp4_sm100_smem_desc(smem_u32(smem_b[buf]) + off, NVFP4_SM100_LBO, NVFP4_SM100_SBO), idesc,
                nvfp4_sm100_tmem_addr(tmem, 0, nvfp4_sm100_sf_col(NVFP4_SM100_SFA_COL, buf, j)),
                nvfp4_sm100_tmem_addr(tmem, 0, nvfp4_sm100_sf_col(NVFP4_SM100_SFB_COL, buf, j)),
                (s > 0 || j > 0) ? 1u : 0u);
      }
      mma_commit(&bars[buf]);
    }
    __syncwarp();   // warp 0 whole again before the next .sync.aligned tcgen05 instruction
    if (s + 1 < stages) {
      const int nbuf = buf ^ 1;
      // Buffer nbuf (shared memory and scale columns) was last read by the MMAs of stage s - 1: the
      // ((s - 1) / 2)-th completion of its barrier.
      if (s >= 1) mbar_wait(&bars[nbuf], ((s - 1) >> 1) & 1);
      __syncwarp();   // lanes leave the spin one by one; tcgen05.st is warp-collective
      tc_fence_after();
      load_stage<kSfLane>(t, s + 1, smem_u32(smem_a[nbuf]), smem_u32(smem_b[nbuf]), tmem, nbuf);
    }
  }
  // The last commit covers every MMA this thread issued before it.
  mbar_wait(&bars[(stages - 1) & 1], ((stages - 1) >> 1) & 1);
  __syncwarp();
  tc_fence_after();
  epilogue<kGateUp>(p, tmem, row0, n0, p.alpha[e]);
  tc_fence_before();
  __syncthreads();
  if (threadIdx.x < 32) {
    tc_fence_after();
    asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;\n" ::"r"(tmem), "n"(NVFP4_SM100_TMEM_COLS)
                 : "memory");
  }
}

}  // namespace

// Two scale arrangements, each a complete kernel pair: which one the MMA reads is the one fact here that rests
// on figures of the PTX ISA rather than its text, so the device check (bench/tune_cuda_moe.py) decides; only
// a pair that passed there can be selected.
#define NVFP4_SM100_GEMM(name, gate_up, sf_lane)                                                          \
  extern "C" __global__ void __launch_bounds__(NVFP4_SM100_THREADS) name(const Nvfp4Sm100Args p) {       \
    gemm_tile<gate_up, sf_lane>(p);                                                                      \
  }
NVFP4_SM100_GEMM(nvfp4_sm100_gemm_gate_up, true, false)
NVFP4_SM100_GEMM(nvfp4_sm100_gemm_down, false, false)
NVFP4_SM100_GEMM(nvfp4_sm100_gemm_gate_up_sflane, true, true)
NVFP4_SM100_GEMM(nvfp4_sm100_gemm_down_sflane, false, true)

// One thread per 16-value block, grid-stride over max_rows x k_dim/16 blocks.
extern "C" __global__ void __launch_bounds__(NVFP4_SM100_QUANT_THREADS)
    nvfp4_sm100_quant_act(const Nvfp4Sm100QuantArgs q) {
  const int64_t blocks_per_row = q.k_dim / 16;
  const int64_t total = q.max_rows * blocks_per_row;
  const int64_t valid_rows = *q.total_rows;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = i / blocks_per_row, blk = i % blocks_per_row;
    uint2 codes = make_uint2(0, 0);
    uint8_t sf = 0;
    const int32_t pair = row < valid_rows ? q.sorted_pairs[row] : (int32_t)q.num_pairs;
    if (pair < q.num_pairs) {
      const float s = q.input_scale[q.block_expert[row / NVFP4_SM100_BM]];
      const int64_t src_row = q.a_div ? pair / q.a_div : row;
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(q.src) +
                                                        src_row * q.k_dim + blk * 16);
      uint4 raw[2] = {src[0], src[1]};
      const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(raw);
      float x[16], amax = 0.0f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        x[j] = __bfloat162float(v[j]);
        amax = fmaxf(amax, fabsf(x[j]));   // fmaxf drops a NaN operand; the NaN check below restores it
      }
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (x[j] != x[j]) amax = x[j];
      // SF = e4m3_sat((1 / input_scale) * (amax / 6)), in the reference's order of fp32 operations.
      const __nv_fp8_storage_t sf8 = __nv_cvt_float_to_fp8((1.0f / s) * (amax / 6.0f), __NV_SATFINITE, __NV_E4M3);
      const float denom = __half2float(__half(__nv_cvt_fp8_to_halfraw(sf8, __NV_E4M3))) * s;
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const uint32_t c = denom > 0.0f ? nvfp4_sm100_e2m1_code(x[j] / denom) : 0u;
        if (j < 8) lo |= c << (4 * j);
        else hi |= c << (4 * (j - 8));
      }
      codes = make_uint2(lo, hi);
      sf = sf8;
    }
    *reinterpret_cast<uint2*>(q.codes + row * (q.k_dim / 2) + blk * 8) = codes;
    q.scale[row * blocks_per_row + blk] = sf;
  }
}
