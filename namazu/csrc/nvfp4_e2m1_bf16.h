// Four E2M1 codes -> bf16 without a table in memory: two byte permutes (PRMT) pick each value's high
// and low bf16 byte from 8-byte register tables of the 8 magnitudes, two more interleave them, and the
// sign bits are moved into place. Exact (every E2M1 value is a bf16). Host builds (tests) get a C
// version of __byte_perm, so the same logic is checked on the CPU against the format's table.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define NVFP4_HD __host__ __device__ __forceinline__
#else
#define NVFP4_HD static inline
#endif

// __byte_perm(x, y, s) for selectors without the sign-replicate bit: byte i of the result is byte
// (s >> 4i) & 7 of the 8 bytes y:x (x the low word).
NVFP4_HD uint32_t nvfp4_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, s);
#else
  const uint64_t v = ((uint64_t)y << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#endif
}

// w16 holds four codes, value j in bits 4j .. 4j+3 (two packed NVFP4 bytes, low nibble first). *lo gets
// bf16x2 (v0, v1), *hi gets (v2, v3), the first of each pair in the low half.
NVFP4_HD void nvfp4_e2m1x4_to_bf16(uint32_t w16, uint32_t* lo, uint32_t* hi) {
  // Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as bf16: 0000 3F00 3F80 3FC0 4000 4040 4080 40C0.
  const uint32_t sel = w16 & 0x7777u;  // the magnitude indices, already in selector form
  const uint32_t h = nvfp4_byte_perm(0x3F3F3F00u, 0x40404040u, sel);
  const uint32_t l = nvfp4_byte_perm(0xC0800000u, 0xC0804000u, sel);
  *lo = nvfp4_byte_perm(l, h, 0x5140u) | ((w16 << 12) & 0x8000u) | ((w16 << 24) & 0x80000000u);
  *hi = nvfp4_byte_perm(l, h, 0x7362u) | ((w16 << 4) & 0x8000u) | ((w16 << 16) & 0x80000000u);
}
