// NVFP4 routed-experts layer on the CPU: C ABI shared by the torch binding and any other caller.
//
// Layout (REFERENCE.md section 2, stacked over experts): packed E2M1 codes uint8 [E, out, in/2] with the
// first element in the low nibble, E4M3 block scales (raw bytes) [E, out, in/16], fp32 global scale [E].
// w13 holds gate rows then up rows ([E, 2I, H/2]); w2 is [E, H, I/2].
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Vector paths; a request for one the CPU lacks falls back to the best one it has. AVX512_BF16 feeds
// bf16 activations to bf16 dot products (FP4 x E4M3 weights are exact in bf16, accumulation is fp32):
// W4A16 only, as on Hopper; W4A4 emulation keeps fp32 activations.
enum {
  NVFP4_ISA_AUTO = 0,
  NVFP4_ISA_SCALAR = 1,
  NVFP4_ISA_AVX2 = 2,
  NVFP4_ISA_AVX512 = 3,
  NVFP4_ISA_AVX512_BF16 = 4,
};

typedef struct Nvfp4MoeCpuArgs {
  int64_t num_tokens;    // N
  int64_t hidden;        // H (multiple of 16)
  int64_t inter;         // I (multiple of 16)
  int64_t num_experts;   // E
  int64_t top_k;         // k
  const float* x;             // [N, H]
  const int64_t* topk_ids;    // [N, k]
  const float* topk_weights;  // [N, k]
  const uint8_t* w13_packed;  // [E, 2I, H/2]
  const uint8_t* w13_scale;   // [E, 2I, H/16] e4m3 bytes
  const float* w13_gs;        // [E]
  const uint8_t* w2_packed;   // [E, H, I/2]
  const uint8_t* w2_scale;    // [E, H, I/16] e4m3 bytes
  const float* w2_gs;         // [E]
  const float* a13_scale;     // [E] W4A4 input scale of gate/up, or null for W4A16
  const float* a2_scale;      // [E] W4A4 input scale of down, or null for W4A16
  float* out;                 // [N, H], fully written
  int num_threads;            // <= 0: OpenMP's default
  int isa;                    // NVFP4_ISA_*
  int act_bf16;               // the caller's activations are bf16: W4A4 then rounds the gate_up output and
                              // the SiLU product to bf16 (as Blackwell pipelines store them between GEMMs),
                              // and W4A16 may take the AVX512_BF16 path; fp32 callers keep fp32 throughout
} Nvfp4MoeCpuArgs;

// Status codes of nvfp4_moe_cpu.
enum {
  NVFP4_MOE_OK = 0,
  NVFP4_MOE_BAD_SHAPE = 1,      // a size is negative, or H / I is not a positive multiple of 16
  NVFP4_MOE_BAD_EXPERT_ID = 2,  // a topk id is outside [0, E)
  NVFP4_MOE_OUT_OF_MEMORY = 3,
};

int nvfp4_moe_cpu(const Nvfp4MoeCpuArgs* args);

// The vector path `isa` resolves to on this CPU: NVFP4_ISA_SCALAR, _AVX2, _AVX512 or _AVX512_BF16.
int nvfp4_moe_cpu_resolve_isa(int isa);

#ifdef __cplusplus
}
#endif
