// NVFP4 W4A16 grouped GEMM for large batches (>= 1024 tokens) on Hopper (sm_90a): the contract of
// nvfp4_grouped_gemm.h (the same Nvfp4GemmArgs, epilogues and output layouts) with row blocks of
// BM = 64 or 128 rows instead of 16 (block_dispatch with block_m = BM, so block_expert is per BM rows), kernels with C names for the cubin loader (kernels/cuda_decode.py).
//
// Why another kernel: at 1,024+ tokens an expert has 20-100 rows, and the 16-row grouped GEMM reads and
// expands each weight tile once per 16 rows, in every warp that uses it. Here a CTA (8 warps) owns BM
// rows x 128 weight rows (gate_up: 64 gate + the matching 64 up rows, so SiLU-and-mul stays in the
// epilogue) and expands each 128 x 32 weight tile exactly once, into shared memory as bf16, where all
// eight warps read it with ldmatrix; the tensor-core work per expanded value grows with BM.
//
// Per K chunk of 32: each thread loads one 16-value block (8 nibble bytes + its E4M3 scale) of the next
// chunk into registers and cp.async stages the next chunk of A, the warps multiply the current chunk, then
// the thread expands its block into the other bf16 buffer; one __syncthreads per chunk. Shared memory:
// A 2 x BM x 40 bf16, B 2 x 128 x 40 bf16 (rows padded to 80 B: ldmatrix rows on distinct banks), the
// byte table: 41 KB at BM = 128, under the 48 KB of static shared memory.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "nvfp4_grouped_gemm.h"

namespace {

constexpr int kBlockN = 128;   // weight rows per CTA
constexpr int kChunkK = 32;
constexpr int kStride = kChunkK + 8;
constexpr int kThreads = 256;  // 8 warps: 2 along M x 4 along N

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float e2m1_value(int code) {
  const int mag = code & 7;
  const float v = mag < 2 ? 0.5f * mag : ldexpf(1.0f + 0.5f * (mag & 1), (mag >> 1) - 1);
  return (code & 8) ? -v : v;
}

__device__ __forceinline__ uint32_t bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

template <int BM, bool kGateUp>
__device__ __forceinline__ void prefill_gemm(const Nvfp4GemmArgs& args) {
  constexpr int kWarpRows = BM / 2, kMT = kWarpRows / 16;
  __shared__ __align__(16) __nv_bfloat16 as[2][BM][kStride];
  __shared__ __align__(16) __nv_bfloat16 bs[2][kBlockN][kStride];
  __shared__ uint32_t lut[256];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int wm = warp / 4, wn = warp % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * BM;
  if (row0 >= *args.total_rows) return;
  for (int i = tid; i < 256; i += kThreads) lut[i] = bits(__floats2bfloat162_rn(e2m1_value(i & 0xF), e2m1_value(i >> 4)));

  const int64_t e = args.block_expert[blockIdx.x];  // the dispatch was built with block_m = BM
  const int64_t K = args.k_dim, n_out = args.n_out, w_rows = kGateUp ? 2 * n_out : n_out;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * (kGateUp ? kBlockN / 2 : kBlockN);
  const __nv_bfloat16* a_base = static_cast<const __nv_bfloat16*>(args.a);

  // A staging: BM rows x 4 copies of 16 B per chunk.
  constexpr int kACopies = BM * 4 / kThreads;
  const __nv_bfloat16* a_src[kACopies];
  for (int i = 0; i < kACopies; ++i) {
    const int c = tid + i * kThreads, r = c / 4;
    const int64_t pair = args.sorted_pairs[row0 + r];
    const bool ok = pair < args.num_pairs;
    const int64_t src_row = kGateUp ? (ok ? pair / args.top_k : -1) : row0 + r;
    a_src[i] = src_row >= 0 ? a_base + src_row * K + (c % 4) * 8 : nullptr;
  }
  auto stage_a = [&](int buf, int64_t k0) {
    for (int i = 0; i < kACopies; ++i) {
      const int c = tid + i * kThreads;
      cp_async16(&as[buf][c / 4][(c % 4) * 8], a_src[i] ? a_src[i] + k0 : a_base, a_src[i] != nullptr);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };

  // The thread's weight block: CTA row r = tid / 2, 16 values at 16 * (tid % 2) of each chunk.
  const int wr = tid / 2, wb = tid % 2;
  const int64_t wn_row = kGateUp && wr >= kBlockN / 2 ? n_out + n0 + (wr - kBlockN / 2) : n0 + wr;
  const bool w_ok = (n0 + (kGateUp ? wr % (kBlockN / 2) : wr)) < n_out && wn_row < w_rows;
  const uint8_t* wq = args.w_packed + (e * w_rows + (w_ok ? wn_row : 0)) * (K / 2) + wb * 8;
  const uint8_t* ws = args.w_scale + (e * w_rows + (w_ok ? wn_row : 0)) * (K / 16) + wb;
  uint2 q = make_uint2(0, 0);
  uint32_t s = 0;
  auto load_w = [&](int64_t k0) {
    if (w_ok) {
      q = __ldcs(reinterpret_cast<const uint2*>(wq + k0 / 2));
      s = __ldcs(ws + k0 / 16);
    }
  };
  auto expand_w = [&](int buf) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(s), __NV_E4M3);
    const __nv_bfloat162 sc = __float2bfloat162_rn(__half2float(__half(h)));
    uint32_t v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t l = lut[((i < 4 ? q.x : q.y) >> (8 * (i % 4))) & 0xFF];
      v[i] = bits(__hmul2(*reinterpret_cast<__nv_bfloat162*>(&l), sc));
    }
    uint4* dst = reinterpret_cast<uint4*>(&bs[buf][wr][wb * 16]);
    dst[0] = make_uint4(v[0], v[1], v[2], v[3]);
    dst[1] = make_uint4(v[4], v[5], v[6], v[7]);
  };

  float acc[kMT][4][4] = {};
  const int64_t chunks = K / kChunkK;
  stage_a(0, 0);
  load_w(0);
  __syncthreads();  // the byte table
  expand_w(0);
  asm volatile("cp.async.wait_group 0;\n" ::);
  __syncthreads();
  // The warp's two pairs of n8 tiles in the B buffer (gate_up: gate 16wn.. and up 64 + 16wn..).
  const int nb0 = kGateUp ? 16 * wn : 32 * wn, nb1 = kGateUp ? kBlockN / 2 + 16 * wn : 32 * wn + 16;
  for (int64_t c = 0; c < chunks; ++c) {
    const int buf = static_cast<int>(c & 1);
    const bool more = c + 1 < chunks;
    if (more) {
      stage_a(buf ^ 1, (c + 1) * kChunkK);
      load_w((c + 1) * kChunkK);
    }
#pragma unroll
    for (int ks = 0; ks < kChunkK / 16; ++ks) {
      uint32_t b[2][4];
      const int bn = (lane / 16) * 8 + lane % 8, bk = ks * 16 + ((lane / 8) % 2) * 8;
      ldmatrix_x4(b[0], &bs[buf][nb0 + bn][bk]);
      ldmatrix_x4(b[1], &bs[buf][nb1 + bn][bk]);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        uint32_t a[4];
        ldmatrix_x4(a, &as[buf][wm * kWarpRows + mt * 16 + lane % 16][ks * 16 + (lane / 16) * 8]);
        // b[p][0..1]: (b0, b1) of the pair's first n8 tile, b[p][2..3]: of its second.
        mma_bf16(acc[mt][0], a, b[0][0], b[0][1]);
        mma_bf16(acc[mt][1], a, b[0][2], b[0][3]);
        mma_bf16(acc[mt][2], a, b[1][0], b[1][1]);
        mma_bf16(acc[mt][3], a, b[1][2], b[1][3]);
      }
    }
    if (more) expand_w(buf ^ 1);
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
  }

  // acc[mt][j]: rows wm*BM/2 + 16mt + g (+8), columns 2t, 2t+1 of n8 tile j (gate_up: j < 2 gate, j >= 2
  // the up columns of the same outputs).
  const float gs = args.w_gs[e];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t p = row0 + wm * kWarpRows + mt * 16 + g + 8 * hr;
      if constexpr (kGateUp) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int qq = 0; qq < 2; ++qq) {
            const int64_t n = n0 + 16 * wn + 8 * j + 2 * t + qq;
            if (n >= n_out) continue;
            const float gate = acc[mt][j][2 * hr + qq] * gs, up = acc[mt][j + 2][2 * hr + qq] * gs;
            static_cast<__nv_bfloat16*>(args.out)[p * n_out + n] = __float2bfloat16(gate / (1.0f + __expf(-gate)) * up);
          }
        }
      } else {
        const int64_t pair = args.sorted_pairs[p];
        if (pair >= args.num_pairs) continue;
        const float scale = gs * args.topk_weights[pair];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int qq = 0; qq < 2; ++qq) {
            const int64_t n = n0 + 32 * wn + 8 * j + 2 * t + qq;
            if (n < n_out) static_cast<float*>(args.out)[pair * n_out + n] = acc[mt][j][2 * hr + qq] * scale;
          }
        }
      }
    }
  }
}

}  // namespace

#define NVFP4_PREFILL_KERNELS(BM)                                                                            \
  extern "C" __global__ void __launch_bounds__(kThreads) nvfp4_prefill_gemm_m##BM##_gate_up(Nvfp4GemmArgs a) { \
    prefill_gemm<BM, true>(a);                                                                               \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(kThreads) nvfp4_prefill_gemm_m##BM##_down(Nvfp4GemmArgs a) {    \
    prefill_gemm<BM, false>(a);                                                                              \
  }
NVFP4_PREFILL_KERNELS(64)
NVFP4_PREFILL_KERNELS(128)

// Launches one large-batch grouped GEMM with row blocks of block_m (64 or 128) on `stream`; the rows must
// come from block_dispatch with that block_m. Returns cudaSuccess, cudaErrorInvalidValue, or the launch error.
extern "C" int nvfp4_prefill_gemm_sm90(int block_m, const Nvfp4GemmArgs* args, cudaStream_t stream) {
  if ((block_m != 64 && block_m != 128) || args->k_dim <= 0 || args->k_dim % kChunkK || args->n_out <= 0 ||
      args->max_rows % block_m || args->top_k <= 0) {
    return cudaErrorInvalidValue;
  }
  if (args->max_rows == 0) return cudaSuccess;
  const int64_t cols = args->gate_up ? kBlockN / 2 : kBlockN;
  const dim3 grid(static_cast<unsigned>(args->max_rows / block_m), static_cast<unsigned>((args->n_out + cols - 1) / cols));
  if (block_m == 64) {
    if (args->gate_up) nvfp4_prefill_gemm_m64_gate_up<<<grid, kThreads, 0, stream>>>(*args);
    else nvfp4_prefill_gemm_m64_down<<<grid, kThreads, 0, stream>>>(*args);
  } else {
    if (args->gate_up) nvfp4_prefill_gemm_m128_gate_up<<<grid, kThreads, 0, stream>>>(*args);
    else nvfp4_prefill_gemm_m128_down<<<grid, kThreads, 0, stream>>>(*args);
  }
  return static_cast<int>(cudaGetLastError());
}
