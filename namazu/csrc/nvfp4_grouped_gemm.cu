// NVFP4 W4A16 grouped GEMM for the MoE experts on Hopper (sm_90a). See nvfp4_grouped_gemm.h for the
// contract. Hopper has no FP4 tensor cores, so the win is bandwidth: weights stream from HBM at 4.5
// bits per value and are expanded to bf16 in registers right before the tensor-core MMA.
//
// One CTA (4 warps) computes a 16-row x 64-column output tile of one expert (gate_up: 64 gate and the
// matching 64 up columns, so SiLU-and-mul happens in the epilogue). K is staged 128 values at a time
// through shared memory by cp.async, three stages deep, so several chunks of the weight stream are in
// flight while the tensor cores work on an earlier one.
//
// Fragment mapping (mma.m16n8k16, B "col"): thread (g = lane / 4, t = lane % 4) needs, for weight row
// g of an n8 tile and one 16-value block, the values k = 2t, 2t+1 and 2t+8, 2t+9: exactly the two
// nibbles of packed byte t and of byte t+4 of that block, scaled by the block's single E4M3 scale. A
// 256-entry table maps a packed byte to its two E2M1 values as bf16x2; times the scale it is exact in
// bf16 (at most 6 significant bits).
#include "nvfp4_grouped_gemm.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace {

constexpr int kBlockM = NVFP4_GEMM_BLOCK_M;
constexpr int kBlockN = 64;           // output columns per CTA (16 per warp)
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunkK = NVFP4_GEMM_K_ALIGN;  // values of K per stage
constexpr int kStages = 3;
constexpr int kAStride = kChunkK + 8;         // bf16 per A row in smem (+16 B: rows land on other banks)
constexpr int kWStride = kChunkK / 2 + 16;    // bytes per weight row in smem (80 B: conflict-free uint2 reads)
constexpr int kSStride = kChunkK / 16;        // scale bytes per weight row per stage

template <bool kGateUp>
struct Smem {
  static constexpr int kRows = kGateUp ? 2 * kBlockN : kBlockN;  // weight rows staged per stage
  __nv_bfloat16 a[kStages][kBlockM][kAStride];
  uint8_t w[kStages][kRows][kWStride];
  uint8_t s[kStages][kRows][kSStride];
  uint32_t lut[256];  // packed byte -> (e2m1(low nibble), e2m1(high nibble)) as bf16x2
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async of `bytes` (4, 8 or 16); src_bytes = 0 zero-fills the destination without reading.
template <int kBytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
  const int src_bytes = valid ? kBytes : 0;
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "n"(kBytes), "r"(src_bytes));
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// E2M1 code -> value: magnitudes 0, 0.5 (subnormal) and 2^(e-1) * (1 + m/2) for exponent e >= 1.
__device__ __forceinline__ float e2m1_value(int code) {
  const int mag = code & 7;
  const float v = mag < 2 ? 0.5f * mag : ldexpf(1.0f + 0.5f * (mag & 1), (mag >> 1) - 1);
  return (code & 8) ? -v : v;
}

__device__ __forceinline__ float e4m3_value(uint8_t byte) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3);
  return __half2float(__half(h));
}

__device__ __forceinline__ uint32_t bf162_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// Two bf16x2 B registers for packed bytes (lo_byte: k = 2t, 2t+1; hi_byte: k = 2t+8, 2t+9) and a scale.
__device__ __forceinline__ void dequant_b(const uint32_t* lut, uint32_t lo_byte, uint32_t hi_byte,
                                          __nv_bfloat162 scale, uint32_t& b0, uint32_t& b1) {
  uint32_t l = lut[lo_byte], h = lut[hi_byte];
  b0 = bf162_bits(__hmul2(*reinterpret_cast<__nv_bfloat162*>(&l), scale));
  b1 = bf162_bits(__hmul2(*reinterpret_cast<__nv_bfloat162*>(&h), scale));
}

template <bool kGateUp>
__global__ void __launch_bounds__(kThreads) nvfp4_grouped_gemm_kernel(Nvfp4GemmArgs args) {
  using S = Smem<kGateUp>;
  __shared__ __align__(16) S sm;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
  if (row0 >= *args.total_rows) return;  // past the real rows: the grid is sized by an upper bound

  for (int i = tid; i < 256; i += kThreads) {
    __nv_bfloat162 v = __floats2bfloat162_rn(e2m1_value(i & 0xF), e2m1_value(i >> 4));
    sm.lut[i] = bf162_bits(v);
  }

  const int64_t e = args.block_expert[blockIdx.x];
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBlockN;
  const int64_t K = args.k_dim, n_out = args.n_out;
  const int64_t w_rows = kGateUp ? 2 * n_out : n_out;
  const uint8_t* w_base = args.w_packed + e * w_rows * (K / 2);
  const uint8_t* s_base = args.w_scale + e * w_rows * (K / 16);
  const __nv_bfloat16* a_base = static_cast<const __nv_bfloat16*>(args.a);

  // Each thread's A rows to stage: 16 rows x 16 chunks of 8 bf16 = 256 copies, 2 per thread.
  int64_t a_src_row[2];
  bool a_valid[2];
  for (int i = 0; i < 2; ++i) {
    const int r = (tid + i * kThreads) / (kChunkK / 8);
    const int64_t pair = args.sorted_pairs[row0 + r];
    a_valid[i] = pair < args.num_pairs;
    a_src_row[i] = kGateUp ? (a_valid[i] ? pair / args.top_k : 0) : row0 + r;
  }

  auto load_stage = [&](int stage, int64_t k0) {
    for (int i = 0; i < 2; ++i) {
      const int c = tid + i * kThreads, r = c / (kChunkK / 8), col = (c % (kChunkK / 8)) * 8;
      cp_async<16>(&sm.a[stage][r][col], a_base + a_src_row[i] * K + k0 + col, a_valid[i]);
    }
    // Weights: kRows x 64 bytes = kRows * 4 copies of 16 bytes.
    for (int c = tid; c < S::kRows * 4; c += kThreads) {
      const int r = c / 4, col = (c % 4) * 16;
      const int64_t n = kGateUp && r >= kBlockN ? n_out + n0 + (r - kBlockN) : n0 + r;
      const bool ok = (n0 + (r % kBlockN)) < n_out;
      cp_async<16>(&sm.w[stage][r][col], w_base + (ok ? n : 0) * (K / 2) + k0 / 2 + col, ok);
    }
    for (int r = tid; r < S::kRows; r += kThreads) {
      const int64_t n = kGateUp && r >= kBlockN ? n_out + n0 + (r - kBlockN) : n0 + r;
      const bool ok = (n0 + (r % kBlockN)) < n_out;
      cp_async<8>(&sm.s[stage][r][0], s_base + (ok ? n : 0) * (K / 16) + k0 / 16, ok);
    }
  };

  float acc[2][4] = {};     // gate (or down) columns: two n8 tiles per warp
  float acc_up[2][4] = {};  // up columns (gate_up only)
  const int64_t k_tiles = K / kChunkK;
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s * kChunkK);
    cp_async_commit();
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt is visible to all, and everyone is done with stage kt-1
    const int64_t next = kt + kStages - 1;
    if (next < k_tiles) load_stage(static_cast<int>(next % kStages), next * kChunkK);
    cp_async_commit();
    const int st = static_cast<int>(kt % kStages);
#pragma unroll
    for (int ks = 0; ks < kChunkK / 16; ++ks) {
      uint32_t a[4];
      a[0] = *reinterpret_cast<const uint32_t*>(&sm.a[st][g][ks * 16 + 2 * t]);
      a[1] = *reinterpret_cast<const uint32_t*>(&sm.a[st][g + 8][ks * 16 + 2 * t]);
      a[2] = *reinterpret_cast<const uint32_t*>(&sm.a[st][g][ks * 16 + 2 * t + 8]);
      a[3] = *reinterpret_cast<const uint32_t*>(&sm.a[st][g + 8][ks * 16 + 2 * t + 8]);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int half = 0; half < (kGateUp ? 2 : 1); ++half) {
          const int r = half * kBlockN + warp * 16 + j * 8 + g;
          const uint2 wq = *reinterpret_cast<const uint2*>(&sm.w[st][r][ks * 8]);
          const __nv_bfloat162 scale = __float2bfloat162_rn(e4m3_value(sm.s[st][r][ks]));
          uint32_t b0, b1;
          dequant_b(sm.lut, (wq.x >> (8 * t)) & 0xFF, (wq.y >> (8 * t)) & 0xFF, scale, b0, b1);
          mma_bf16(half ? acc_up[j] : acc[j], a, b0, b1);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue. acc[j][0..1]: row g, columns 2t, 2t+1 of n8 tile j; acc[j][2..3]: row g+8.
  const float gs = args.w_gs[e];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t col = n0 + warp * 16 + j * 8 + 2 * t;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t p = row0 + g + 8 * hr;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int64_t n = col + q;
        if (n >= n_out) continue;
        const float v = acc[j][2 * hr + q] * gs;
        if constexpr (kGateUp) {
          const float u = acc_up[j][2 * hr + q] * gs;
          static_cast<__nv_bfloat16*>(args.out)[p * n_out + n] = __float2bfloat16(v / (1.0f + __expf(-v)) * u);
        } else {
          const int64_t pair = args.sorted_pairs[p];
          if (pair < args.num_pairs) {
            static_cast<float*>(args.out)[pair * n_out + n] = v * args.topk_weights[pair];
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" int nvfp4_grouped_gemm_sm90(const Nvfp4GemmArgs* args, cudaStream_t stream) {
  if (args->k_dim <= 0 || args->k_dim % kChunkK || args->n_out <= 0 || args->max_rows % kBlockM ||
      args->top_k <= 0) {
    return cudaErrorInvalidValue;
  }
  if (args->max_rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(args->max_rows / kBlockM),
                  static_cast<unsigned>((args->n_out + kBlockN - 1) / kBlockN));
  if (args->gate_up) {
    nvfp4_grouped_gemm_kernel<true><<<grid, kThreads, 0, stream>>>(*args);
  } else {
    nvfp4_grouped_gemm_kernel<false><<<grid, kThreads, 0, stream>>>(*args);
  }
  return static_cast<int>(cudaGetLastError());
}
