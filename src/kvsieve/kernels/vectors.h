// The vectors kvsieve's CPU kernels compute with: 16 float32 lanes (one AVX-512 register; GCC's generic vectors,
// which the compiler maps onto the machine's vector instructions, two registers of AVX2 where that is all there is).
// Included by the kernels' sources (kvsieve/kernels/native.py builds them as one translation unit).

#pragma once

#include <cstdint>
#include <cstring>

namespace kvsieve_vectors {

typedef float vec __attribute__((vector_size(64)));
constexpr int W = 16;  // floats per vector

inline vec load(const float* p) {  // unaligned: rows of the cache and of the weights start anywhere
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vec load(const uint16_t* p) {  // bfloat16 (its bits): a float32's top 16 bits, so a shift widens it exactly;
  // the attention's bfloat16 caches and the products' bfloat16 weights both load through here
  typedef unsigned short halves __attribute__((vector_size(32)));
  typedef unsigned int words __attribute__((vector_size(64)));
  halves h;
  std::memcpy(&h, p, sizeof h);
  const words bits = __builtin_convertvector(h, words) << 16;
  vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

inline float sum(vec v) {  // the lanes' sum (once per row or chunk, never in an inner loop)
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

}  // namespace kvsieve_vectors
