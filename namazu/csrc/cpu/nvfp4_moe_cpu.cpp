// NVFP4 routed experts on the CPU (W4A16, and W4A4 emulation): sort pairs by expert, then per expert
// gate_up GEMM -> SiLU-and-mul -> down GEMM, then the top-k weighted sum.
//
// Decode is bound by reading weights, so the inner loop streams each weight row once per tile of up to
// 8 tokens and expands FP4 to fp32 in registers (a 16-entry table lookup by permute), never writing a
// dequantized copy. Built without -march flags: the AVX2 and AVX-512 paths carry target attributes and
// are picked at run time, so one build runs on any x86-64 (and the scalar path anywhere else).
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
constexpr int kTokTile = 8;   // tokens sharing one pass over a weight row
constexpr int kRowBlock = 16;  // weight rows per parallel work item

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

// res[t] = gs * sum_k dequant(w)[k] * x[t*ldx + k] for t < NT: one weight row against NT token rows.
template <int NT>
void row_dot_scalar(const uint8_t* wp, const uint8_t* ws, int64_t K, const float* x, int64_t ldx, float gs,
                    float* res) {
  float acc[NT] = {};
  float w[16];
  for (int64_t b = 0; b < K / 16; ++b) {
    const float s = kE4M3.v[ws[b]];
    for (int j = 0; j < 8; ++j) {
      const uint8_t q = wp[b * 8 + j];
      w[2 * j] = kE2M1[q & 0xF] * s;
      w[2 * j + 1] = kE2M1[q >> 4] * s;
    }
    for (int t = 0; t < NT; ++t) {
      const float* xt = x + t * ldx + b * 16;
      float a = 0.0f;
      for (int j = 0; j < 16; ++j) a += w[j] * xt[j];
      acc[t] += a;
    }
  }
  for (int t = 0; t < NT; ++t) res[t] = acc[t] * gs;
}

#ifdef NVFP4_X86
// 8 packed bytes -> 16 codes in element order (low nibble first), zero-extended to bytes.
__attribute__((target("avx2"))) inline __m128i unpack_codes(const uint8_t* p) {
  long long q;
  std::memcpy(&q, p, 8);
  const __m128i bytes = _mm_cvtsi64_si128(q);
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return _mm_unpacklo_epi8(lo, hi);
}

template <int NT>
__attribute__((target("avx2,fma"))) void row_dot_avx2(const uint8_t* wp, const uint8_t* ws, int64_t K,
                                                       const float* x, int64_t ldx, float gs, float* res) {
  // 8-entry magnitude table; the sign bit of the code (bit 3) is moved to the float sign bit.
  const __m256 lut = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i seven = _mm256_set1_epi32(7), eight = _mm256_set1_epi32(8);
  __m256 acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 16; ++b) {
    const __m128i codes = unpack_codes(wp + b * 8);
    const __m256 s = _mm256_set1_ps(kE4M3.v[ws[b]]);
    const __m256i c0 = _mm256_cvtepu8_epi32(codes);
    const __m256i c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8));
    const __m256 m0 = _mm256_permutevar8x32_ps(lut, _mm256_and_si256(c0, seven));
    const __m256 m1 = _mm256_permutevar8x32_ps(lut, _mm256_and_si256(c1, seven));
    const __m256 w0 = _mm256_mul_ps(
        _mm256_xor_ps(m0, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c0, eight), 28))), s);
    const __m256 w1 = _mm256_mul_ps(
        _mm256_xor_ps(m1, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c1, eight), 28))), s);
    for (int t = 0; t < NT; ++t) {
      const float* xt = x + t * ldx + b * 16;
      acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt), acc0[t]);
      acc1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), acc1[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const __m256 a = _mm256_add_ps(acc0[t], acc1[t]);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    res[t] = _mm_cvtss_f32(r) * gs;
  }
}

template <int NT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) void row_dot_avx512(
    const uint8_t* wp, const uint8_t* ws, int64_t K, const float* x, int64_t ldx, float gs, float* res) {
  const __m512 lut = _mm512_loadu_ps(kE2M1);
  // Two accumulators per token break the FMA dependency chain when few tokens share the row.
  __m512 acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  const int64_t nb = K / 16;
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    const __m512 w0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(unpack_codes(wp + b * 8)), lut),
                                    _mm512_set1_ps(kE4M3.v[ws[b]]));
    const __m512 w1 = _mm512_mul_ps(
        _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(unpack_codes(wp + b * 8 + 8)), lut),
        _mm512_set1_ps(kE4M3.v[ws[b + 1]]));
    for (int t = 0; t < NT; ++t) {
      const float* xt = x + t * ldx + b * 16;
      acc0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), acc0[t]);
      acc1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), acc1[t]);
    }
  }
  if (b < nb) {
    const __m512 w0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(unpack_codes(wp + b * 8)), lut),
                                    _mm512_set1_ps(kE4M3.v[ws[b]]));
    for (int t = 0; t < NT; ++t) acc0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * ldx + b * 16), acc0[t]);
  }
  for (int t = 0; t < NT; ++t) res[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t])) * gs;
}
#endif

using RowDot = void (*)(const uint8_t*, const uint8_t*, int64_t, const float*, int64_t, float, float*);

// Dispatch table per path: entry nt-1 handles a tile of nt tokens.
#define NVFP4_ROW_TABLE(fn) {&fn<1>, &fn<2>, &fn<3>, &fn<4>, &fn<5>, &fn<6>, &fn<7>, &fn<8>}
const RowDot kScalar[kTokTile] = NVFP4_ROW_TABLE(row_dot_scalar);
#ifdef NVFP4_X86
const RowDot kAvx2[kTokTile] = NVFP4_ROW_TABLE(row_dot_avx2);
const RowDot kAvx512[kTokTile] = NVFP4_ROW_TABLE(row_dot_avx512);
#endif

const RowDot* row_table(int isa) {
#ifdef NVFP4_X86
  if (isa == NVFP4_ISA_AVX512) return kAvx512;
  if (isa == NVFP4_ISA_AVX2) return kAvx2;
#endif
  return kScalar;
}

// One grouped GEMM: for every expert e with rows, dst[row, r] = src[row, :] . dequant(w[e, r, :]).
// src rows of expert e are offsets[e]..offsets[e+1], contiguous, K wide; dst is `out_rows` wide.
void grouped_gemm(const std::vector<int64_t>& offsets, int64_t E, const float* src, int64_t K,
                  const uint8_t* packed, const uint8_t* scale, const float* gs, int64_t out_rows, float* dst,
                  const RowDot* table, int threads) {
  struct Item {
    int64_t e, r0;
  };
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;  // an expert without tokens: its weights are not read
    for (int64_t r = 0; r < out_rows; r += kRowBlock) items.push_back({e, r});
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t it = 0; it < n_items; ++it) {
    const int64_t e = items[it].e, r0 = items[it].r0, r1 = std::min(out_rows, r0 + kRowBlock);
    const int64_t m0 = offsets[e], m = offsets[e + 1] - m0;
    const uint8_t* wp = packed + (e * out_rows) * (K / 2);
    const uint8_t* ws = scale + (e * out_rows) * (K / 16);
    float res[kTokTile];
    for (int64_t t0 = 0; t0 < m; t0 += kTokTile) {
      const int nt = static_cast<int>(std::min<int64_t>(kTokTile, m - t0));
      const float* xt = src + (m0 + t0) * K;
      for (int64_t r = r0; r < r1; ++r) {
        table[nt - 1](wp + r * (K / 2), ws + r * (K / 16), K, xt, K, gs[e], res);
        for (int t = 0; t < nt; ++t) dst[(m0 + t0 + t) * out_rows + r] = res[t];
      }
    }
  }
}

int run(const Nvfp4MoeCpuArgs& a) {
  const int64_t N = a.num_tokens, H = a.hidden, I = a.inter, E = a.num_experts, k = a.top_k;
  if (N < 0 || k < 0 || E <= 0 || H <= 0 || I <= 0 || H % 16 || I % 16) return NVFP4_MOE_BAD_SHAPE;
  const int threads = a.num_threads > 0 ? a.num_threads : omp_get_max_threads();
  const RowDot* table = row_table(nvfp4_moe_cpu_resolve_isa(a.isa));
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

  // Expert-sorted activations, the gate_up output and the down input/output, all fp32.
  std::vector<float> xs(M * H), h13(M * 2 * I), act(M * I), y(M * H);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < M; ++p) {
    float* dst = xs.data() + row_of_pair[p] * H;
    std::memcpy(dst, a.x + (p / k) * H, H * sizeof(float));
    if (a.a13_scale) fake_quant_row(dst, H, a.a13_scale[a.topk_ids[p]]);
  }
  grouped_gemm(offsets, E, xs.data(), H, a.w13_packed, a.w13_scale, a.w13_gs, 2 * I, h13.data(), table, threads);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t row = 0; row < M; ++row) {
    float* g = h13.data() + row * 2 * I;
    float* o = act.data() + row * I;
    if (a.a2_scale && a.round_bf16) {
      for (int64_t j = 0; j < 2 * I; ++j) g[j] = round_bf16(g[j]);
      for (int64_t j = 0; j < I; ++j) o[j] = round_bf16(g[j] / (1.0f + std::exp(-g[j])) * g[I + j]);
    } else {
      for (int64_t j = 0; j < I; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * g[I + j];
    }
    if (a.a2_scale) fake_quant_row(o, I, a.a2_scale[expert_of_row[row]]);
  }
  grouped_gemm(offsets, E, act.data(), I, a.w2_packed, a.w2_scale, a.w2_gs, H, y.data(), table, threads);

  // Top-k weighted sum, slots in order, so the result does not depend on the thread count.
#pragma omp parallel for schedule(static) num_threads(threads)
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
  if ((isa == NVFP4_ISA_AUTO || isa == NVFP4_ISA_AVX512) && has512) return NVFP4_ISA_AVX512;
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
