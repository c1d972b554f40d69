// NVFP4 W4A16 routed experts on the CPU over the decode layout (nvfp4_decode_cpu.h).
//
// Decode is bound by reading weights; at 1 token the old kernel (nvfp4_moe_cpu.cpp) spent ~15 vector
// instructions per 16 weights expanding codes to fp32 and reached a quarter of the copy bandwidth. Here
// the codes never become floats: a byte shuffle maps a 32-byte load of nibbles to 64 signed 8-bit values
// (2 * E2M1), unpacking against zero widens them to 16 bits, and vpmaddwd multiplies them with the
// activations quantized to 16-bit integers, 16 multiply-adds per instruction with exact integer sums per
// 16-block. The nibbles are placed so that lane j of each multiply-add holds a pair of block j's
// products: 8 of them added as int32 give a tile row's 8 block sums in 8 lanes, and one FMA with the 8
// block scales (weight x activation) finishes the tile row. Weights never become floats.
//
// Activations: each 16-block of a GEMM input is stored as int16 with a power-of-two scale 2^(e-15), e
// the block max's binary exponent. For bf16 inputs every element within 2^7 of its block's max is exact
// (8 significant bits fit in 15); smaller ones round to the block's grid, an error of at most 2^-16 of
// the block max. fp32 inputs round the same way (a 2^-16 relative error against the block max, below
// bf16's rounding of the result). A block whose max is below 2^-100 counts as zero; a non-finite input
// makes its block's scale NaN, so NaN reaches the output as in the reference.
//
// Each expert's weights are read from memory once per step: work items are (expert, 16 output rows);
// within one the 4-row groups run over all the expert's tokens in tiles of 1-4 while their 16 KB stream
// (K = 7168) stays in L1/L2. OpenMP threads take items dynamically (experts and output tiles).
#include "nvfp4_decode_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <new>
#include <vector>

#include "nvfp4_moe_cpu.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define NVFP4_X86 1
#endif

namespace {

constexpr int64_t kRowBlock = 16;  // output rows per parallel work item (4 tile groups)
constexpr int64_t kPrefetchTiles = 6;  // software prefetch distance of the weight stream, in 288-byte tiles
constexpr int kMaxTokTile = 4;     // token rows per tile (their accumulators change once per K tile, so they may spill)
// Below this many weight reads + multiply-adds a parallel region costs more than it saves.
constexpr int64_t kMinParallelWork = int64_t{1} << 21;
constexpr int8_t kCode2x[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  // 2 * E2M1

// E4M3 magnitude byte (0..0x7E) -> its value / 256, what F16C yields for the byte shifted left by 7.
struct ScaleTable {
  float v[128];
  ScaleTable() {
    for (int b = 0; b < 128; ++b) {
      const int exp = b >> 3, man = b & 7;
      const float mag = exp == 0 ? std::ldexp(static_cast<float>(man), -9) : std::ldexp(1.0f + man / 8.0f, exp - 7);
      v[b] = mag / 256.0f;
    }
  }
};
const ScaleTable kScale;

// One row of K values -> kp int16 (zero padded) and kp/16 block scales.
void quantize_row(const float* src, int64_t k, int64_t kp, int16_t* q, float* s) {
  for (int64_t b = 0; b < kp / 16; ++b) {
    int16_t* qb = q + b * 16;
    if (b * 16 >= k) {
      std::memset(qb, 0, 16 * sizeof(int16_t));
      s[b] = 0.0f;
      continue;
    }
    const float* v = src + b * 16;
    float amax = 0.0f;
    bool bad = false;
    for (int j = 0; j < 16; ++j) {
      const float a = std::fabs(v[j]);
      bad |= !(a <= FLT_MAX);  // inf or NaN
      amax = a > amax ? a : amax;
    }
    if (bad || !(amax >= 0x1p-100f)) {
      std::memset(qb, 0, 16 * sizeof(int16_t));
      s[b] = bad ? NAN : 0.0f;
      continue;
    }
    int e;
    std::frexp(amax, &e);  // amax in [2^(e-1), 2^e)
    const float inv = std::ldexp(1.0f, 15 - e);
    s[b] = std::ldexp(1.0f, e - 15);
    for (int j = 0; j < 16; ++j) {
      const float r = std::nearbyint(v[j] * inv);  // |r| <= 2^15; only fp32 inputs can reach 2^15
      qb[j] = static_cast<int16_t>(std::max(-32767.0f, std::min(32767.0f, r)));
    }
  }
  // Into the tile order: pair i of block j of a 128-element tile at i * 16 + j * 2, so that one 16-bit
  // multiply-add of 16 weights and 16 activations sums a pair of each of the tile's 8 blocks per lane.
  int16_t tmp[NVFP4_TILE_K];
  for (int64_t c = 0; c < kp; c += NVFP4_TILE_K) {
    std::memcpy(tmp, q + c, sizeof(tmp));
    for (int j = 0; j < 8; ++j)
      for (int e = 0; e < 16; ++e) q[c + (e / 2) * 16 + j * 2 + (e % 2)] = tmp[j * 16 + e];
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, const int16_t* const*, const float* const*, float*);

// One 4-row group over nkc K tiles against NT token rows (activations in tile order):
// res[r * NT + t] = 2 x the dot product / gs (codes are 2 * E2M1).
template <int NT>
void tile_scalar(const uint8_t* tp, int64_t nkc, const int16_t* const* xq, const float* const* xs, float* res) {
  double acc[4][NT] = {};
  for (int64_t kc = 0; kc < nkc; ++kc) {
    const uint8_t* T = tp + kc * NVFP4_TILE_BYTES;
    for (int r = 0; r < 4; ++r) {
      int w[8][16];  // [pair vector i][16-bit lane s]: what the i-th unpacked register holds
      for (int i = 0; i < 8; ++i) {
        const int u = i / 4, nib = (i % 4) / 2, half = i % 2;
        for (int sl = 0; sl < 16; ++sl) {
          const int byte = T[r * 64 + u * 32 + (sl >= 8) * 16 + half * 8 + (sl % 8)];
          w[i][sl] = kCode2x[(byte >> (4 * nib)) & 0xF];
        }
      }
      for (int t = 0; t < NT; ++t) {
        const int16_t* x = xq[t] + kc * NVFP4_TILE_K;
        for (int j = 0; j < 8; ++j) {
          int64_t dot = 0;
          for (int i = 0; i < 8; ++i)
            for (int p = 0; p < 2; ++p) dot += static_cast<int64_t>(w[i][2 * j + p]) * x[i * 16 + 2 * j + p];
          acc[r][t] += static_cast<double>(dot) * 256.0 * (kScale.v[T[256 + r * 8 + j]] * xs[t][kc * 8 + j]);
        }
      }
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < NT; ++t) res[r * NT + t] = static_cast<float>(acc[r][t]);
}

#ifdef NVFP4_X86
#define NVFP4_AVX2 __attribute__((target("avx2,fma,f16c")))

NVFP4_AVX2 inline __attribute__((always_inline)) float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

template <int NT>
NVFP4_AVX2 void tile_avx2(const uint8_t* tp, int64_t nkc, const int16_t* const* xq, const float* const* xs,
                          float* res) {
  const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                       0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i zero = _mm256_setzero_si256();
  __m256 acc[4][NT];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t kc = 0; kc < nkc; ++kc) {
    const uint8_t* T = tp + kc * NVFP4_TILE_BYTES;
    // The weight stream runs kPrefetchTiles ahead: the hardware prefetcher alone left a third of the time
    // waiting on memory at 1 token. (Past the group's end it fetches the next group, which follows.)
    const char* ahead = reinterpret_cast<const char*>(T) + kPrefetchTiles * NVFP4_TILE_BYTES;
    for (int line = 0; line < NVFP4_TILE_BYTES; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    // 32 scale bytes: rows 0-1 then 2-3, 8 blocks each; byte << 7 is the half-float of scale / 256, and
    // lane j of a row's vector is block j's, as in the integer sums below.
    const __m256i s01 = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(T + 256))), 7);
    const __m256i s23 = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(T + 272))), 7);
    const __m256 ws[4] = {_mm256_cvtph_ps(_mm256_castsi256_si128(s01)), _mm256_cvtph_ps(_mm256_extracti128_si256(s01, 1)),
                          _mm256_cvtph_ps(_mm256_castsi256_si128(s23)), _mm256_cvtph_ps(_mm256_extracti128_si256(s23, 1))};
    __m256 xa[NT];
    for (int t = 0; t < NT; ++t) xa[t] = _mm256_loadu_ps(xs[t] + kc * 8);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      // Lane j of isum[t] sums block j: 8 pair products per unpacked register, at most
      // 16 * 3072 * 32767 < 2^31 over the block, so the integer sums are exact.
      __m256i isum[NT];
#pragma GCC unroll 2
      for (int u = 0; u < 2; ++u) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(T + r * 64 + u * 32));
        const __m256i wl = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4));
        const __m256i wh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        // code * 256 as int16
        const __m256i w[4] = {_mm256_unpacklo_epi8(zero, wl), _mm256_unpackhi_epi8(zero, wl),
                              _mm256_unpacklo_epi8(zero, wh), _mm256_unpackhi_epi8(zero, wh)};
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const int i = u * 4 + q;
#pragma GCC unroll 4
          for (int t = 0; t < NT; ++t) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + kc * NVFP4_TILE_K + i * 16));
            const __m256i p = _mm256_madd_epi16(w[q], xv);
            isum[t] = i == 0 ? p : _mm256_add_epi32(isum[t], p);
          }
        }
      }
      for (int t = 0; t < NT; ++t)
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(ws[r], xa[t]), acc[r][t]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < NT; ++t) res[r * NT + t] = hsum(acc[r][t]);
}
#endif

struct DecodePath {
  int tokens;
  TileFn tile[kMaxTokTile];
};
const DecodePath kScalarDecode = {4, {&tile_scalar<1>, &tile_scalar<2>, &tile_scalar<3>, &tile_scalar<4>}};
#ifdef NVFP4_X86
const DecodePath kAvx2Decode = {4, {&tile_avx2<1>, &tile_avx2<2>, &tile_avx2<3>, &tile_avx2<4>}};
#endif

const DecodePath& decode_path(int isa) {
#ifdef NVFP4_X86
  if (isa == NVFP4_ISA_AVX2) return kAvx2Decode;
#endif
  (void)isa;
  return kScalarDecode;
}

// One grouped GEMM over the decode layout: for every expert e with rows,
// dst[row, r] = x[src_row[row]] . dequant(w[e, r]). xq/xs rows are kp / kp/16 wide.
void grouped_gemm(const std::vector<int64_t>& offsets, int64_t E, const int16_t* xq, const float* xs,
                  const int64_t* src_row, int64_t kp, const uint8_t* w, const float* gs, int64_t out_rows, float* dst,
                  const DecodePath& path, int threads) {
  struct Item {
    int64_t e, r0;
  };
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;  // an expert without tokens: its weights are not read
    for (int64_t r = 0; r < out_rows; r += kRowBlock) items.push_back({e, r});
  }
  const int64_t n_items = static_cast<int64_t>(items.size()), nkc = kp / NVFP4_TILE_K;
  const int64_t group_bytes = nkc * NVFP4_TILE_BYTES;
  const int64_t rows = offsets[E] - offsets[0];
  // multiply-adds plus weights decoded
  const bool parallel = n_items > 1 && (rows * out_rows + n_items * kRowBlock) * kp >= kMinParallelWork;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
  for (int64_t it = 0; it < n_items; ++it) {
    const int64_t e = items[it].e, r0 = items[it].r0, r1 = std::min(out_rows, r0 + kRowBlock);
    const int64_t m0 = offsets[e], m = offsets[e + 1] - m0;
    const uint8_t* we = w + e * (out_rows / NVFP4_TILE_ROWS) * group_bytes;
    const float g = gs[e] * 0.5f;  // codes enter as 2 * E2M1
    float res[NVFP4_TILE_ROWS * kMaxTokTile];
    const int16_t* qp[kMaxTokTile];
    const float* sp[kMaxTokTile];
    for (int64_t rg = r0; rg < r1; rg += NVFP4_TILE_ROWS) {
      const uint8_t* tp = we + (rg / NVFP4_TILE_ROWS) * group_bytes;
      for (int64_t t0 = 0; t0 < m; t0 += path.tokens) {
        const int nt = static_cast<int>(std::min<int64_t>(path.tokens, m - t0));
        for (int t = 0; t < nt; ++t) {
          const int64_t src = src_row[m0 + t0 + t];
          qp[t] = xq + src * kp;
          sp[t] = xs + src * (kp / 16);
        }
        path.tile[nt - 1](tp, nkc, qp, sp, res);
        for (int r = 0; r < NVFP4_TILE_ROWS; ++r)
          for (int t = 0; t < nt; ++t) dst[(m0 + t0 + t) * out_rows + rg + r] = res[r * nt + t] * g;
      }
    }
  }
}

int64_t padded(int64_t k) { return (k + NVFP4_TILE_K - 1) / NVFP4_TILE_K * NVFP4_TILE_K; }

int run(const Nvfp4DecodeArgs& a) {
  const int64_t N = a.num_tokens, H = a.hidden, I = a.inter, E = a.num_experts, k = a.top_k;
  if (N < 0 || k < 0 || E <= 0 || H <= 0 || I <= 0 || H % 16 || I % 16) return NVFP4_MOE_BAD_SHAPE;
  const int threads = a.num_threads > 0 ? a.num_threads : omp_get_max_threads();
  const DecodePath& path = decode_path(nvfp4_decode_resolve_isa(a.isa));
  const int64_t M = N * k, Hp = padded(H), Ip = padded(I);

  // Counting sort of the (token, slot) pairs by expert, stable in pair order.
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t p = 0; p < M; ++p) {
    const int64_t e = a.topk_ids[p];
    if (e < 0 || e >= E) return NVFP4_MOE_BAD_EXPERT_ID;
    ++offsets[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1), row_of_pair(M), token_of_row(M), ident(M);
  for (int64_t p = 0; p < M; ++p) {
    const int64_t row = fill[a.topk_ids[p]]++;
    row_of_pair[p] = row;
    token_of_row[row] = p / k;
    ident[row] = row;
  }

  const bool big = M * (H + I) >= kMinParallelWork;
  // W4A16: a token's k pairs share one input row, so each token is quantized once.
  std::vector<int16_t> xq(N * Hp), aq(M * Ip);
  std::vector<float> xs(N * Hp / 16), as(M * Ip / 16), h13(M * 2 * I), act(M * I), y(M * H);
#pragma omp parallel for schedule(static) num_threads(threads) if (big)
  for (int64_t n = 0; n < N; ++n) quantize_row(a.x + n * H, H, Hp, xq.data() + n * Hp, xs.data() + n * (Hp / 16));
  grouped_gemm(offsets, E, xq.data(), xs.data(), token_of_row.data(), Hp, a.w13, a.w13_gs, 2 * I, h13.data(), path,
               threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (big)
  for (int64_t row = 0; row < M; ++row) {
    const float* g = h13.data() + row * 2 * I;
    float* o = act.data() + row * I;
    for (int64_t j = 0; j < I; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * g[I + j];
    quantize_row(o, I, Ip, aq.data() + row * Ip, as.data() + row * (Ip / 16));
  }
  grouped_gemm(offsets, E, aq.data(), as.data(), ident.data(), Ip, a.w2, a.w2_gs, H, y.data(), path, threads);

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

extern "C" int64_t nvfp4_decode_layout_bytes(int64_t num_mats, int64_t rows, int64_t k) {
  return num_mats * (rows / NVFP4_TILE_ROWS) * (padded(k) / NVFP4_TILE_K) * NVFP4_TILE_BYTES;
}

extern "C" int nvfp4_prepack_cpu(const uint8_t* packed, const uint8_t* scale, int64_t num_mats, int64_t rows,
                                 int64_t k, uint8_t* dst, int num_threads) {
  if (num_mats < 0 || rows < 0 || rows % NVFP4_TILE_ROWS || k <= 0 || k % 16) return NVFP4_MOE_BAD_SHAPE;
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int64_t nkc = padded(k) / NVFP4_TILE_K, groups = num_mats * (rows / NVFP4_TILE_ROWS), nb = k / 16;
  int nan = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : nan)
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t kc = 0; kc < nkc; ++kc) {
      uint8_t* T = dst + (g * nkc + kc) * NVFP4_TILE_BYTES;
      for (int rr = 0; rr < NVFP4_TILE_ROWS; ++rr) {
        const int64_t row = g * NVFP4_TILE_ROWS + rr;  // over all matrices: rows are contiguous
        const uint8_t* prow = packed + row * (k / 2);
        const uint8_t* srow = scale + row * nb;
        bool neg[8];
        for (int j = 0; j < 8; ++j) {
          const int64_t blk = kc * 8 + j;
          const uint8_t s = blk < nb ? srow[blk] : 0;
          nan |= (s & 0x7F) == 0x7F;
          neg[j] = (s & 0x80) != 0;
          T[256 + rr * 8 + j] = s & 0x7F;
        }
        for (int u = 0; u < 2; ++u) {
          for (int b = 0; b < 32; ++b) {
            const int half = (b & 15) >= 8, slot = (b >= 16) * 8 + (b & 7);
            int byte = 0;
            for (int nib = 0; nib < 2; ++nib) {
              // unpacked register i = u * 4 + nib * 2 + half, 16-bit lane `slot`: pair slot / 2 is block
              // j's elements 2i, 2i + 1
              const int i = u * 4 + nib * 2 + half, blk = slot / 2;
              const int64_t elem = kc * NVFP4_TILE_K + blk * 16 + 2 * i + slot % 2;
              int code = elem < k ? (prow[elem / 2] >> ((elem & 1) * 4)) & 0xF : 0;
              if (neg[blk]) code ^= 8;  // a negative block scale: negate the block's codes instead
              byte |= code << (4 * nib);
            }
            T[rr * 64 + u * 32 + b] = static_cast<uint8_t>(byte);
          }
        }
      }
    }
  }
  return nan ? static_cast<int>(NVFP4_MOE_NAN_SCALE) : static_cast<int>(NVFP4_MOE_OK);
}

extern "C" int nvfp4_decode_resolve_isa(int isa) {
#ifdef NVFP4_X86
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa != NVFP4_ISA_SCALAR && has2) return NVFP4_ISA_AVX2;
#endif
  (void)isa;
  return NVFP4_ISA_SCALAR;
}

extern "C" int nvfp4_moe_cpu_decode(const Nvfp4DecodeArgs* args) {
  try {
    return run(*args);
  } catch (const std::bad_alloc&) {
    return NVFP4_MOE_OUT_OF_MEMORY;
  }
}
