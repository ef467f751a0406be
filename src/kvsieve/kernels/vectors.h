// The vectors kvsieve's CPU kernels compute with: 16 float32 lanes (one AVX-512 register; GCC's generic vectors,
// which the compiler maps onto the machine's vector instructions, two registers of AVX2 where that is all there is).
// Included by the kernels' sources (kvsieve/kernels/native.py builds them as one translation unit).

#pragma once

#include <cstring>

namespace kvsieve_vectors {

typedef float vec __attribute__((vector_size(64)));
constexpr int W = 16;  // floats per vector

inline vec load(const float* p) {  // unaligned: rows of the cache and of the weights start anywhere
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

inline float sum(vec v) {  // the lanes' sum (once per row or chunk, never in an inner loop)
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

}  // namespace kvsieve_vectors
