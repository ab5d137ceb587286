// float32 <-> bfloat16 (stored as uint16) for the engine's CPU kernels: widening by a 16-bit shift; narrowing
// rounded to nearest even, NaN kept quiet. Shared by cpu_kernels.cpp and lora_sgmv.cpp (the float overloads
// let one template serve both dtypes).
#pragma once
#include <cstdint>

namespace actorserve {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  if ((u & 0x7fffffffu) > 0x7f800000u) { *p = static_cast<uint16_t>((u >> 16) | 0x40u); return; }  // NaN
  *p = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace actorserve
