// NVFP4 W4A16 split-K decode kernels for the MoE experts on Hopper (sm_90a). See nvfp4_moe_decode.h for
// the layout and the contract.
//
// Why split-K: at 1-64 tokens a step touches 8-400 experts with 1-16 rows each, so a grid over (expert
// block, output tile) alone has too few CTAs to keep enough loads in flight for HBM; splitting K
// multiplies the CTAs (and the bytes in flight) by `split`, at the price of an fp32 partial per split
// that a small reduction kernel sums (deterministically: no atomics, so a graph replay is bit-exact).
//
// The weight stream never touches shared memory: each lane loads its 16 nibble bytes and 2 scale bytes of
// a tile straight into registers (ld.global.cs: read once, evict first), expands them to bf16 with a
// 256-entry byte -> bf16x2 table and one multiply by the block scale (exact: at most 6 significant bits),
// (DQ = lut) or with register byte permutes (DQ = prmt, nvfp4_e2m1_bf16.h: no shared-memory lookups, whose
// bank conflicts may bound the table version; which wins is measured on the device), and feeds
// mma.m16n8k16. The next K chunk's tiles are loaded before the current one is multiplied, so
// every warp keeps two chunks of loads in flight. A rows that are padding (the common case at decode:
// 1-2 real rows of 16) are neither loaded nor written.
#include "nvfp4_moe_decode.h"
#include "nvfp4_e2m1_bf16.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace {

constexpr int kBlockM = NVFP4_DECODE_BLOCK_M;
constexpr int kTileK = NVFP4_DECODE_TILE_K;
constexpr int kTileBytes = NVFP4_DECODE_TILE_BYTES;
constexpr int kScaleOffset = 512;

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float e2m1_value(int code) {
  const int mag = code & 7;
  const float v = mag < 2 ? 0.5f * mag : ldexpf(1.0f + 0.5f * (mag & 1), (mag >> 1) - 1);
  return (code & 8) ? -v : v;
}

__device__ __forceinline__ __nv_bfloat162 e4m3_bf162(uint32_t byte) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3);
  return __float2bfloat162_rn(__half2float(__half(h)));
}

__device__ __forceinline__ uint32_t bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

__device__ __forceinline__ uint32_t scaled(const uint32_t* lut, uint32_t byte, __nv_bfloat162 s) {
  uint32_t v = lut[byte];
  return bits(__hmul2(*reinterpret_cast<__nv_bfloat162*>(&v), s));
}

struct Chunk {  // one lane's loads for one K chunk: A rows g and g+8, and NT weight tiles
  uint4 a_lo[4], a_hi[4];
};

__device__ __forceinline__ void load_a(Chunk& c, const __nv_bfloat16* lo, const __nv_bfloat16* hi, int64_t k) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    c.a_lo[i] = lo ? __ldg(reinterpret_cast<const uint4*>(lo + k) + i) : make_uint4(0, 0, 0, 0);
    c.a_hi[i] = hi ? __ldg(reinterpret_cast<const uint4*>(hi + k) + i) : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ uint32_t word(const uint4 (&v)[4], int i) {
  const uint4 q = v[i / 4];
  const int j = i % 4;
  return j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w;
}

template <int NT, int WARPS, bool kPrmt>
__device__ __forceinline__ void decode_gemm(const Nvfp4DecodeArgs& args) {
  __shared__ uint32_t lut[256];  // packed byte -> (e2m1(low nibble), e2m1(high nibble)) as bf16x2
  const int64_t row0 = static_cast<int64_t>(blockIdx.z) * kBlockM;
  if (row0 >= *args.total_rows) return;  // the whole CTA: the grid is sized by an upper bound
  for (int i = threadIdx.x; i < 256; i += WARPS * 32) {
    lut[i] = bits(__floats2bfloat162_rn(e2m1_value(i & 0xF), e2m1_value(i >> 4)));
  }
  __syncthreads();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int64_t n_tiles = args.rows / 8, K = args.k_dim, chunks = K / kTileK;
  const int64_t tile0 = (static_cast<int64_t>(blockIdx.x) * WARPS + warp) * NT;
  if (tile0 >= n_tiles) return;
  // A split may own no chunk (split > K/128): it still writes its zero partial, which the reduction reads.
  const int64_t c_begin = chunks * blockIdx.y / args.split, c_end = chunks * (blockIdx.y + 1) / args.split;
  const int64_t e = args.block_expert[blockIdx.z];
  const int64_t pair_lo = args.sorted_pairs[row0 + g], pair_hi = args.sorted_pairs[row0 + g + 8];
  const bool ok_lo = pair_lo < args.num_pairs, ok_hi = pair_hi < args.num_pairs;
  const __nv_bfloat16* a = static_cast<const __nv_bfloat16*>(args.a);
  // Lane t's 32 values of a chunk start at 32t; the row pointers are null for padding rows.
  const __nv_bfloat16* a_lo = ok_lo ? a + (pair_lo / args.a_div) * K + 32 * t : nullptr;
  const __nv_bfloat16* a_hi = ok_hi ? a + (pair_hi / args.a_div) * K + 32 * t : nullptr;
  const uint8_t* w = args.w_tiles + ((e * n_tiles + tile0) * chunks) * kTileBytes;

  float acc[NT][4] = {};
  Chunk cur, nxt;
  uint4 q[NT], qn[NT];
  uint32_t s[NT], sn[NT];
  auto load_w = [&](uint4 (&qq)[NT], uint32_t (&ss)[NT], int64_t c) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const bool in = tile0 + j < n_tiles;
      const uint8_t* tile = w + ((in ? j : 0) * chunks + c) * kTileBytes;
      qq[j] = in ? __ldcs(reinterpret_cast<const uint4*>(tile) + lane) : make_uint4(0, 0, 0, 0);
      ss[j] = in ? *reinterpret_cast<const uint16_t*>(tile + kScaleOffset + g * 8 + 2 * t) : 0u;
    }
  };
  if (c_begin < c_end) {
    load_a(cur, a_lo, a_hi, c_begin * kTileK);
    load_w(q, s, c_begin);
  }
  for (int64_t c = c_begin; c < c_end; ++c) {
    if (c + 1 < c_end) {  // the next chunk's loads fly while this one is multiplied
      load_a(nxt, a_lo, a_hi, (c + 1) * kTileK);
      load_w(qn, sn, c + 1);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const __nv_bfloat162 s0 = e4m3_bf162(s[j] & 0xFF), s1 = e4m3_bf162(s[j] >> 8);
#pragma unroll
      for (int st = 0; st < 8; ++st) {
        // Step st: real k = 32t + 4st .. +3, i.e. nibble bytes 2st and 2st+1 of this lane, block 2t + st/4.
        const uint32_t packed = st < 2 ? q[j].x : st < 4 ? q[j].y : st < 6 ? q[j].z : q[j].w;
        const uint32_t pair = (packed >> (16 * (st & 1))) & 0xFFFF;
        const __nv_bfloat162 sc = st < 4 ? s0 : s1;
        uint32_t b0, b1;
        if constexpr (kPrmt) {
          uint32_t v0, v1;
          nvfp4_e2m1x4_to_bf16(pair, &v0, &v1);
          b0 = bits(__hmul2(*reinterpret_cast<__nv_bfloat162*>(&v0), sc));
          b1 = bits(__hmul2(*reinterpret_cast<__nv_bfloat162*>(&v1), sc));
        } else {
          b0 = scaled(lut, pair & 0xFF, sc);
          b1 = scaled(lut, pair >> 8, sc);
        }
        mma_bf16(acc[j], word(cur.a_lo, 2 * st), word(cur.a_hi, 2 * st), word(cur.a_lo, 2 * st + 1),
                 word(cur.a_hi, 2 * st + 1), b0, b1);
      }
    }
    if (c + 1 < c_end) {
      cur = nxt;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        q[j] = qn[j];
        s[j] = sn[j];
      }
    }
  }

  // acc[j][0..1]: row g, columns 2t, 2t+1 of n8 tile j; acc[j][2..3]: row g + 8.
  float* out = args.partial + static_cast<int64_t>(blockIdx.y) * args.num_pairs * args.rows;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (tile0 + j >= n_tiles) break;
    const int64_t n = (tile0 + j) * 8 + 2 * t;
    if (ok_lo) *reinterpret_cast<float2*>(out + pair_lo * args.rows + n) = make_float2(acc[j][0], acc[j][1]);
    if (ok_hi) *reinterpret_cast<float2*>(out + pair_hi * args.rows + n) = make_float2(acc[j][2], acc[j][3]);
  }
}

}  // namespace

// The variants as C-named kernels, so the cubin loader finds them without demangling.
#define NVFP4_DECODE_VARIANTS(X) X(2, 4) X(4, 4) X(8, 4) X(4, 8)
#define NVFP4_DECODE_KERNEL(NT, WARPS)                                                          \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                      \
      nvfp4_decode_gemm_nt##NT##_w##WARPS##_lut(Nvfp4DecodeArgs args) {                        \
    decode_gemm<NT, WARPS, false>(args);                                                         \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                      \
      nvfp4_decode_gemm_nt##NT##_w##WARPS##_prmt(Nvfp4DecodeArgs args) {                       \
    decode_gemm<NT, WARPS, true>(args);                                                          \
  }
NVFP4_DECODE_VARIANTS(NVFP4_DECODE_KERNEL)

extern "C" __global__ void __launch_bounds__(256) nvfp4_decode_reduce_gate_up(Nvfp4DecodeReduceArgs args) {
  const int64_t inter = args.rows / 2, total = args.num_pairs * inter, plane = args.num_pairs * args.rows;
  for (int64_t i = blockIdx.x * 256ll + threadIdx.x; i < total; i += static_cast<int64_t>(gridDim.x) * 256) {
    const int64_t pair = i / inter, n = i % inter;
    const float* p = args.partial + pair * args.rows + n;
    float gate = 0.f, up = 0.f;
    for (int64_t y = 0; y < args.split; ++y) {
      gate += p[y * plane];
      up += p[y * plane + inter];
    }
    const float gs = args.w_gs[args.pair_expert[pair]];
    gate *= gs;
    up *= gs;
    static_cast<__nv_bfloat16*>(args.out)[i] = __float2bfloat16(gate / (1.0f + __expf(-gate)) * up);
  }
}

extern "C" __global__ void __launch_bounds__(256) nvfp4_decode_reduce_down(Nvfp4DecodeReduceArgs args) {
  const int64_t tokens = args.num_pairs / args.top_k, total = tokens * args.rows, plane = args.num_pairs * args.rows;
  for (int64_t i = blockIdx.x * 256ll + threadIdx.x; i < total; i += static_cast<int64_t>(gridDim.x) * 256) {
    const int64_t token = i / args.rows, n = i % args.rows;
    float sum = 0.f;
    for (int64_t slot = 0; slot < args.top_k; ++slot) {
      const int64_t pair = token * args.top_k + slot;
      const float* p = args.partial + pair * args.rows + n;
      float v = 0.f;
      for (int64_t y = 0; y < args.split; ++y) v += p[y * plane];
      sum += v * args.topk_weights[pair] * args.w_gs[args.pair_expert[pair]];
    }
    static_cast<float*>(args.out)[i] = sum;
  }
}

namespace {
struct Shape {
  int nt, warps, prmt;
};
#define NVFP4_DECODE_SHAPE(NT, WARPS) Shape{NT, WARPS, 0}, Shape{NT, WARPS, 1},
constexpr Shape kShapes[] = {NVFP4_DECODE_VARIANTS(NVFP4_DECODE_SHAPE)};
constexpr int kVariants = sizeof(kShapes) / sizeof(kShapes[0]);
#define NVFP4_DECODE_FN(NT, WARPS) &nvfp4_decode_gemm_nt##NT##_w##WARPS##_lut, &nvfp4_decode_gemm_nt##NT##_w##WARPS##_prmt,
void (*const kKernels[])(Nvfp4DecodeArgs) = {NVFP4_DECODE_VARIANTS(NVFP4_DECODE_FN)};
}  // namespace

extern "C" int nvfp4_decode_variant_count(void) { return kVariants; }

extern "C" int nvfp4_decode_variant_shape(int variant, int* nt, int* warps, int* prmt) {
  if (variant < 0 || variant >= kVariants) return cudaErrorInvalidValue;
  *nt = kShapes[variant].nt;
  *warps = kShapes[variant].warps;
  *prmt = kShapes[variant].prmt;
  return cudaSuccess;
}

extern "C" int nvfp4_decode_moe_sm90(int variant, const Nvfp4DecodeArgs* gemm, const Nvfp4DecodeReduceArgs* reduce,
                                     int gate_up, cudaStream_t stream) {
  if (variant < 0 || variant >= kVariants || gemm->k_dim <= 0 || gemm->k_dim % kTileK || gemm->rows <= 0 ||
      gemm->rows % 8 || gemm->max_rows % kBlockM || gemm->split <= 0 || gemm->a_div <= 0 ||
      gemm->max_rows / kBlockM > 65535 || reduce->top_k <= 0 || reduce->split != gemm->split ||
      reduce->rows != gemm->rows || reduce->num_pairs != gemm->num_pairs || (gate_up && gemm->rows % 16)) {
    return cudaErrorInvalidValue;
  }
  if (gemm->max_rows == 0 || gemm->num_pairs == 0) return cudaSuccess;
  const Shape sh = kShapes[variant];
  const int64_t cols_per_cta = 8ll * sh.nt * sh.warps;
  const dim3 grid(static_cast<unsigned>((gemm->rows + cols_per_cta - 1) / cols_per_cta),
                  static_cast<unsigned>(gemm->split), static_cast<unsigned>(gemm->max_rows / kBlockM));
  kKernels[variant]<<<grid, sh.warps * 32, 0, stream>>>(*gemm);
  const int64_t total = gate_up ? reduce->num_pairs * (reduce->rows / 2) : reduce->num_pairs / reduce->top_k * reduce->rows;
  const unsigned blocks = static_cast<unsigned>(total / 256 + 1 < 4096 ? total / 256 + 1 : 4096);
  if (gate_up) {
    nvfp4_decode_reduce_gate_up<<<blocks, 256, 0, stream>>>(*reduce);
  } else {
    nvfp4_decode_reduce_down<<<blocks, 256, 0, stream>>>(*reduce);
  }
  return static_cast<int>(cudaGetLastError());
}
