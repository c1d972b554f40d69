// NVFP4 routed experts on the CPU (W4A16, and W4A4 emulation): sort pairs by expert, then per expert
// gate_up GEMM -> SiLU-and-mul -> down GEMM, then the top-k weighted sum.
//
// Decode is bound by reading weights, so the inner loop streams each weight row once per tile of up to
// 8 tokens (AVX-512: two rows at a time, so each activation load feeds two FMAs) and expands FP4 to
// fp32 in registers (a 16-entry table lookup by permute), never writing a dequantized copy. Where the
// CPU has AVX512_BF16 (W4A16 only), the expanded weights (exact in bf16) and bf16 activations go to
// bf16 dot products with fp32 accumulation: about 2x the fp32 path once a few tokens share an expert.
// Built without -march flags: the AVX2 and AVX-512 paths carry target attributes and are picked at run
// time, so one build runs on any x86-64 (and the scalar path anywhere else).
#include "nvfp4_moe_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define NVFP4_X86 1
#endif

namespace {

constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
constexpr int kTokTile = 8;   // the most token rows a micro-tile takes
constexpr int kRowBlock = 16;  // weight rows per parallel work item
// Below this many multiply-adds a parallel region costs more than it saves (waking threads; on a loaded
// machine a spinning thread can wait out a whole time slice for a descheduled peer), so it runs serially.
constexpr int64_t kMinParallelWork = int64_t{1} << 21;

// E4M3 (fn: no infinities, 0x7F/0xFF are NaN) byte -> fp32, as a table built once.
struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 0x7;
      float mag;
      if (exp == 0xF && man == 0x7) {
        mag = NAN;
      } else if (exp == 0) {
        mag = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
      } else {
        mag = std::ldexp(1.0f + man / 8.0f, exp - 7);
      }
      v[b] = sign ? -mag : mag;
    }
  }
};
const E4M3Table kE4M3;

// fp32 -> nearest E4M3 value (ties to even), for non-negative inputs already clamped to <= 448.
float round_e4m3(float x) {
  if (!(x > 0.0f)) return 0.0f;
  if (x < 0.015625f) return std::nearbyint(x * 512.0f) / 512.0f;  // subnormal grid, step 2^-9
  int e;
  std::frexp(x, &e);  // x = f * 2^e, f in [0.5, 1): 3 mantissa bits -> step 2^(e-4)
  const float step = std::ldexp(1.0f, e - 4);
  return std::nearbyint(x / step) * step;
}

// Nearest E2M1 value, exact ties to the even code, saturating at 6 (matches the torch reference).
float round_e2m1(float v) {
  const float a = std::min(std::fabs(v), 6.0f);
  float r;
  if (a < 2.0f) {
    r = std::nearbyint(a * 2.0f) * 0.5f;
  } else if (a < 4.0f) {
    r = std::nearbyint(a);
  } else {
    r = std::nearbyint(a * 0.5f) * 2.0f;
  }
  return std::copysign(r, v);
}

// fp32 -> nearest bf16 (ties to even), returned as fp32; NaN passes through.
float round_bf16(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return v;
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &b, 4);
  return v;
}

void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float r = round_bf16(src[i]);
    uint32_t b;
    std::memcpy(&b, &r, 4);
    dst[i] = static_cast<uint16_t>(b >> 16);
  }
}

// W4A4: round a row to NVFP4 with the expert's calibrated input scale, in place (dequantized fp32).
void fake_quant_row(float* x, int64_t n, float input_scale) {
  for (int64_t b = 0; b < n; b += 16) {
    float amax = 0.0f;
    for (int j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(x[b + j]));
    // Same operation order as namazu.quant.nvfp4.quantize_activation, so SF rounds identically.
    const float sf = round_e4m3(std::min((1.0f / input_scale) * (amax / 6.0f), 448.0f));
    const float denom = sf * input_scale;
    for (int j = 0; j < 16; ++j) x[b + j] = denom > 0.0f ? round_e2m1(x[b + j] / denom) * denom : 0.0f;
  }
}

// Activation rows are stored with every 16-block reordered as [8 even elements, 8 odd elements]: the
// low nibbles of a block's 8 packed bytes are its even elements and the high nibbles its odd ones, so
// in this order the codes expand to a vector without any interleaving.
void to_nibble_order(float* row, int64_t n) {
  float tmp[16];
  for (int64_t b = 0; b < n; b += 16) {
    for (int j = 0; j < 8; ++j) {
      tmp[j] = row[b + 2 * j];
      tmp[8 + j] = row[b + 2 * j + 1];
    }
    std::memcpy(row + b, tmp, sizeof(tmp));
  }
}

// One micro-tile: NR weight rows x NT token rows over 16-blocks [b0, b1) of K; writes the dot products
// (without the global scale) to res[r * NT + t].
// Weight row r starts at wp + r * wp_stride (packed) and ws + r * ws_stride (scales); token t at x + t * ldx.
template <int NR, int NT>
void tile_scalar(const uint8_t* wp, const uint8_t* ws, int64_t wp_stride, int64_t ws_stride, int64_t b0,
                 int64_t b1, const void* xv, int64_t ldx, float* res) {
  const float* x = static_cast<const float*>(xv);
  float acc[NR * NT * 16] = {};
  for (int r = 0; r < NR; ++r) {
    for (int64_t b = b0; b < b1; ++b) {
      const float s = kE4M3.v[ws[r * ws_stride + b]];
      float w[16];
      for (int j = 0; j < 8; ++j) {
        const uint8_t q = wp[r * wp_stride + b * 8 + j];
        w[j] = kE2M1[q & 0xF] * s;
        w[8 + j] = kE2M1[q >> 4] * s;
      }
      for (int t = 0; t < NT; ++t) {
        float* a = acc + (r * NT + t) * 16;
        const float* xt = x + t * ldx + b * 16;
        for (int j = 0; j < 16; ++j) a[j] += w[j] * xt[j];
      }
    }
  }
  for (int i = 0; i < NR * NT; ++i) {
    float sum = 0.0f;
    for (int j = 0; j < 16; ++j) sum += acc[i * 16 + j];
    res[i] = sum;
  }
}

#ifdef NVFP4_X86
template <int NR, int NT>
__attribute__((target("avx2,fma"))) void tile_avx2(const uint8_t* wp, const uint8_t* ws, int64_t wp_stride,
                                                    int64_t ws_stride, int64_t b0, int64_t b1, const void* xv,
                                                    int64_t ldx, float* res) {
  const float* x = static_cast<const float*>(xv);
  static_assert(NR == 1, "the AVX2 tile has registers for one weight row");
  // Magnitudes by the low 3 bits of a code (permutevar8x32 ignores the rest); its bit 3 is the sign.
  const __m256 lut = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i lo_sign = _mm256_set1_epi32(0x08), hi_sign = _mm256_set1_epi32(0x80);
  __m256 ae[NT], ao[NT];
  for (int t = 0; t < NT; ++t) ae[t] = ao[t] = _mm256_setzero_ps();
  for (int64_t b = b0; b < b1; ++b) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wp + b * 8)));
    const __m256 s = _mm256_set1_ps(kE4M3.v[ws[b]]);
    const __m256 we = _mm256_mul_ps(_mm256_xor_ps(_mm256_permutevar8x32_ps(lut, c),
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, lo_sign), 28))), s);
    const __m256 wo = _mm256_mul_ps(_mm256_xor_ps(_mm256_permutevar8x32_ps(lut, _mm256_srli_epi32(c, 4)),
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, hi_sign), 24))), s);
    for (int t = 0; t < NT; ++t) {
      const float* xt = x + t * ldx + b * 16;
      ae[t] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xt), ae[t]);
      ao[t] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xt + 8), ao[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const __m256 v = _mm256_add_ps(ae[t], ao[t]);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    res[t] = _mm_cvtss_f32(r);
  }
  (void)wp_stride;
  (void)ws_stride;
}

#define NVFP4_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

// One 16-block of NR weight rows against NT token rows, into the accumulators a[r][t].
template <int NR, int NT>
NVFP4_AVX512 inline __attribute__((always_inline)) void block_avx512(
    __m512 (&a)[NR][NT], const uint8_t* wp, const uint8_t* ws, int64_t wp_stride, int64_t ws_stride, int64_t b,
    const float* x, int64_t ldx) {
  const __m512 lut = _mm512_loadu_ps(kE2M1);  // permutexvar reads only the low 4 bits of each index
  const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
  __m512 w[NR];
  for (int r = 0; r < NR; ++r) {
    // The 8 packed bytes in both halves; bytes >> 0 index the even elements, >> 4 the odd ones.
    const __m128i q =
        _mm_castpd_si128(_mm_loaddup_pd(reinterpret_cast<const double*>(wp + r * wp_stride + b * 8)));
    const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(q), shifts);
    w[r] = _mm512_mul_ps(_mm512_permutexvar_ps(idx, lut), _mm512_set1_ps(kE4M3.v[ws[r * ws_stride + b]]));
  }
  for (int t = 0; t < NT; ++t) {
    const __m512 xv = _mm512_loadu_ps(x + t * ldx + b * 16);
    for (int r = 0; r < NR; ++r) a[r][t] = _mm512_fmadd_ps(w[r], xv, a[r][t]);
  }
}

template <int NR, int NT>
NVFP4_AVX512 void tile_avx512(const uint8_t* wp, const uint8_t* ws, int64_t wp_stride, int64_t ws_stride,
                              int64_t b0, int64_t b1, const void* xv, int64_t ldx, float* res) {
  const float* x = static_cast<const float*>(xv);
  // With few (row, token) pairs, one accumulator each would serialise on FMA latency: odd blocks then
  // go to a second set.
  constexpr bool kTwoSets = NR * NT <= 4;
  __m512 a0[NR][NT], a1[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      a0[r][t] = _mm512_setzero_ps();
      a1[r][t] = _mm512_setzero_ps();
    }
  int64_t b = b0;
  if constexpr (kTwoSets) {
    for (; b + 1 < b1; b += 2) {
      block_avx512<NR, NT>(a0, wp, ws, wp_stride, ws_stride, b, x, ldx);
      block_avx512<NR, NT>(a1, wp, ws, wp_stride, ws_stride, b + 1, x, ldx);
    }
  }
  for (; b < b1; ++b) block_avx512<NR, NT>(a0, wp, ws, wp_stride, ws_stride, b, x, ldx);
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) res[r * NT + t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][t], a1[r][t]));
}

#define NVFP4_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))

// One 16-block of a weight row as 16 fp32 values in nibble order (exactly representable in bf16).
NVFP4_AVX512_BF16 inline __attribute__((always_inline)) __m512 decode_block_bf16path(const uint8_t* wp,
                                                                                   const uint8_t* ws, int64_t b) {
  const __m512 lut = _mm512_loadu_ps(kE2M1);
  const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
  const __m128i q = _mm_castpd_si128(_mm_loaddup_pd(reinterpret_cast<const double*>(wp + b * 8)));
  const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(q), shifts);
  return _mm512_mul_ps(_mm512_permutexvar_ps(idx, lut), _mm512_set1_ps(kE4M3.v[ws[b]]));
}

// Two 16-blocks (b, b+1) of NR weight rows against NT bf16 token rows with bf16 dot products: each fp32
// lane accumulates a pair of products; weights and activations share the nibble order, so the pairing
// is consistent and the sum is the dot product.
template <int NR, int NT>
NVFP4_AVX512_BF16 inline __attribute__((always_inline)) void pair_bf16(
    __m512 (&a)[NR][NT], const uint8_t* wp, const uint8_t* ws, int64_t wp_stride, int64_t ws_stride, int64_t b,
    bool tail, const uint16_t* x, int64_t ldx) {
  __m512bh w[NR];
  for (int r = 0; r < NR; ++r) {
    const __m512 lo = decode_block_bf16path(wp + r * wp_stride, ws + r * ws_stride, b);
    const __m512 hi = tail ? _mm512_setzero_ps() : decode_block_bf16path(wp + r * wp_stride, ws + r * ws_stride, b + 1);
    w[r] = _mm512_cvtne2ps_pbh(hi, lo);
  }
  for (int t = 0; t < NT; ++t) {
    const uint16_t* xt = x + t * ldx + b * 16;
    const __m512i xi = tail ? _mm512_maskz_loadu_epi16(0xFFFF, xt) : _mm512_loadu_si512(xt);
    const __m512bh xb = reinterpret_cast<const __m512bh&>(xi);
    for (int r = 0; r < NR; ++r) a[r][t] = _mm512_dpbf16_ps(a[r][t], w[r], xb);
  }
}

template <int NR, int NT>
NVFP4_AVX512_BF16 void tile_avx512_bf16(const uint8_t* wp, const uint8_t* ws, int64_t wp_stride, int64_t ws_stride,
                                        int64_t b0, int64_t b1, const void* xv, int64_t ldx, float* res) {
  const uint16_t* x = static_cast<const uint16_t*>(xv);
  constexpr bool kTwoSets = NR * NT <= 4;
  __m512 a0[NR][NT], a1[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      a0[r][t] = _mm512_setzero_ps();
      a1[r][t] = _mm512_setzero_ps();
    }
  int64_t b = b0;
  if constexpr (kTwoSets) {
    for (; b + 3 < b1; b += 4) {
      pair_bf16<NR, NT>(a0, wp, ws, wp_stride, ws_stride, b, false, x, ldx);
      pair_bf16<NR, NT>(a1, wp, ws, wp_stride, ws_stride, b + 2, false, x, ldx);
    }
  }
  for (; b + 1 < b1; b += 2) pair_bf16<NR, NT>(a0, wp, ws, wp_stride, ws_stride, b, false, x, ldx);
  if (b < b1) pair_bf16<NR, NT>(a0, wp, ws, wp_stride, ws_stride, b, true, x, ldx);
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) res[r * NT + t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][t], a1[r][t]));
}
#endif

using TileFn = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const void*, int64_t,
                        float*);

// A vector path: micro-tiles for 1..tokens token rows, each over `rows` weight rows, reading fp32 or
// bf16 activations.
struct Path {
  int rows;
  int tokens;
  bool bf16;
  TileFn tile[kTokTile];
};

#define NVFP4_TILES(fn, nr) {&fn<nr, 1>, &fn<nr, 2>, &fn<nr, 3>, &fn<nr, 4>, &fn<nr, 5>, &fn<nr, 6>, &fn<nr, 7>, &fn<nr, 8>}
const Path kScalarPath = {1, 8, false, NVFP4_TILES(tile_scalar, 1)};
#ifdef NVFP4_X86
// AVX2 has 16 registers: one weight row against 4 tokens (8 accumulators). AVX-512 has 32: two rows
// against 8 tokens (16 accumulators), so every activation load feeds two FMAs.
const Path kAvx2Path = {1, 4, false, NVFP4_TILES(tile_avx2, 1)};
const Path kAvx512Path = {2, 8, false, NVFP4_TILES(tile_avx512, 2)};
const Path kAvx512Bf16Path = {2, 8, true, NVFP4_TILES(tile_avx512_bf16, 2)};
#endif

const Path& path_for(int isa) {
#ifdef NVFP4_X86
  if (isa == NVFP4_ISA_AVX512_BF16) return kAvx512Bf16Path;
  if (isa == NVFP4_ISA_AVX512) return kAvx512Path;
  if (isa == NVFP4_ISA_AVX2) return kAvx2Path;
#endif
  return kScalarPath;
}

// One grouped GEMM: for every expert e with rows, dst[row, r] = src[row, :] . dequant(w[e, r, :]).
// src rows (fp32, or bf16 bits for a bf16 path) of expert e are offsets[e]..offsets[e+1], contiguous,
// K wide, in nibble order; dst is `out_rows` wide.
void grouped_gemm(const std::vector<int64_t>& offsets, int64_t E, const void* src, int64_t K,
                  const uint8_t* packed, const uint8_t* scale, const float* gs, int64_t out_rows, float* dst,
                  const Path& path, int threads) {
  struct Item {
    int64_t e, r0;
  };
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;  // an expert without tokens: its weights are not read
    for (int64_t r = 0; r < out_rows; r += kRowBlock) items.push_back({e, r});
  }
  const int64_t n_items = static_cast<int64_t>(items.size()), nb = K / 16;
  const int64_t rows = offsets[E] - offsets[0];
  // multiply-adds plus weight values expanded
  const bool parallel = n_items > 1 && (rows * out_rows + n_items * kRowBlock) * K >= kMinParallelWork;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
  for (int64_t it = 0; it < n_items; ++it) {
    const int64_t e = items[it].e, r0 = items[it].r0, r1 = std::min(out_rows, r0 + kRowBlock);
    const int64_t m0 = offsets[e], m = offsets[e + 1] - m0;
    const uint8_t* wp = packed + (e * out_rows) * (K / 2);
    const uint8_t* ws = scale + (e * out_rows) * (K / 16);
    float res[kRowBlock * kTokTile];
    for (int64_t t0 = 0; t0 < m; t0 += path.tokens) {
      const int nt = static_cast<int>(std::min<int64_t>(path.tokens, m - t0));
      const void* xt = static_cast<const char*>(src) + (m0 + t0) * K * (path.bf16 ? 2 : 4);
      // Whole rows per pass: K-chunking (to keep the token tile in L1) measured slower here, the
      // long sequential weight streams matter more. out_rows is a multiple of 16, so a row block always
      // splits into whole tiles of path.rows.
      for (int64_t r = r0; r < r1; r += path.rows) {
        path.tile[nt - 1](wp + r * (K / 2), ws + r * (K / 16), K / 2, K / 16, 0, nb, xt, K,
                          res + (r - r0) * nt);
      }
      for (int64_t r = r0; r < r1; ++r) {
        for (int t = 0; t < nt; ++t) dst[(m0 + t0 + t) * out_rows + r] = res[(r - r0) * nt + t] * gs[e];
      }
    }
  }
}

int run(const Nvfp4MoeCpuArgs& a) {
  const int64_t N = a.num_tokens, H = a.hidden, I = a.inter, E = a.num_experts, k = a.top_k;
  if (N < 0 || k < 0 || E <= 0 || H <= 0 || I <= 0 || H % 16 || I % 16) return NVFP4_MOE_BAD_SHAPE;
  const int threads = a.num_threads > 0 ? a.num_threads : omp_get_max_threads();
  int isa = nvfp4_moe_cpu_resolve_isa(a.isa);
  // bf16 dot products only where the activations are bf16 anyway, and not for W4A4 (fp32 emulation).
  if (isa == NVFP4_ISA_AVX512_BF16 && (a.a13_scale || !a.act_bf16)) isa = NVFP4_ISA_AVX512;
  const Path& path = path_for(isa);
  const int64_t M = N * k;

  // Counting sort of the (token, slot) pairs by expert, stable in pair order.
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t p = 0; p < M; ++p) {
    const int64_t e = a.topk_ids[p];
    if (e < 0 || e >= E) return NVFP4_MOE_BAD_EXPERT_ID;
    ++offsets[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1), row_of_pair(M), expert_of_row(M);
  for (int64_t p = 0; p < M; ++p) {
    const int64_t e = a.topk_ids[p], row = fill[e]++;
    row_of_pair[p] = row;
    expert_of_row[row] = e;
  }

  const bool big = M * (H + I) >= kMinParallelWork;  // element-wise passes: parallel only when large
  // Expert-sorted activations, the gate_up output and the down input/output, all fp32.
  std::vector<float> xs(M * H), h13(M * 2 * I), act(M * I), y(M * H);
  // bf16 paths read these copies (x is bf16 already, so only the SiLU product is rounded, as on a GPU).
  std::vector<uint16_t> xs16(path.bf16 ? M * H : 0), act16(path.bf16 ? M * I : 0);
#pragma omp parallel for schedule(static) num_threads(threads) if (big)
  for (int64_t p = 0; p < M; ++p) {
    float* dst = xs.data() + row_of_pair[p] * H;
    std::memcpy(dst, a.x + (p / k) * H, H * sizeof(float));
    if (a.a13_scale) fake_quant_row(dst, H, a.a13_scale[a.topk_ids[p]]);
    to_nibble_order(dst, H);
    if (path.bf16) to_bf16(dst, xs16.data() + row_of_pair[p] * H, H);
  }
  grouped_gemm(offsets, E, path.bf16 ? static_cast<const void*>(xs16.data()) : xs.data(), H, a.w13_packed, a.w13_scale, a.w13_gs, 2 * I, h13.data(), path, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (big)
  for (int64_t row = 0; row < M; ++row) {
    float* g = h13.data() + row * 2 * I;
    float* o = act.data() + row * I;
    if (a.a2_scale && a.act_bf16) {
      for (int64_t j = 0; j < 2 * I; ++j) g[j] = round_bf16(g[j]);
      for (int64_t j = 0; j < I; ++j) o[j] = round_bf16(g[j] / (1.0f + std::exp(-g[j])) * g[I + j]);
    } else {
      for (int64_t j = 0; j < I; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * g[I + j];
    }
    if (a.a2_scale) fake_quant_row(o, I, a.a2_scale[expert_of_row[row]]);
    to_nibble_order(o, I);
    if (path.bf16) to_bf16(o, act16.data() + row * I, I);
  }
  grouped_gemm(offsets, E, path.bf16 ? static_cast<const void*>(act16.data()) : act.data(), I, a.w2_packed, a.w2_scale, a.w2_gs, H, y.data(), path, threads);

  // Top-k weighted sum, slots in order, so the result does not depend on the thread count.
#pragma omp parallel for schedule(static) num_threads(threads) if (big)
  for (int64_t n = 0; n < N; ++n) {
    float* o = a.out + n * H;
    std::fill(o, o + H, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const float w = a.topk_weights[n * k + j];
      const float* yr = y.data() + row_of_pair[n * k + j] * H;
      for (int64_t c = 0; c < H; ++c) o[c] += w * yr[c];
    }
  }
  return NVFP4_MOE_OK;
}

}  // namespace

extern "C" int nvfp4_moe_cpu_resolve_isa(int isa) {
#ifdef NVFP4_X86
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool has_bf16 = has512 && __builtin_cpu_supports("avx512bf16");
  if ((isa == NVFP4_ISA_AUTO || isa == NVFP4_ISA_AVX512_BF16) && has_bf16) return NVFP4_ISA_AVX512_BF16;
  if ((isa == NVFP4_ISA_AUTO || isa == NVFP4_ISA_AVX512 || isa == NVFP4_ISA_AVX512_BF16) && has512)
    return NVFP4_ISA_AVX512;
  if (isa != NVFP4_ISA_SCALAR && has2) return NVFP4_ISA_AVX2;
#endif
  (void)isa;
  return NVFP4_ISA_SCALAR;
}

extern "C" int nvfp4_moe_cpu(const Nvfp4MoeCpuArgs* args) {
  try {
    return run(*args);
  } catch (const std::bad_alloc&) {
    return NVFP4_MOE_OUT_OF_MEMORY;
  }
}
