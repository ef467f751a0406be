// kvsieve::decode_product: a decoding step's few rows times a weight matrix on a CPU, each weight read once.
//
// Built and loaded with kvsieve's other CPU kernels by kvsieve/kernels/native.py; called by kvsieve/kernels/products.py
// (float weights, and int8 weights with a scale per output row for kvsieve/quantize.py). A decoding step multiplies one row
// per request by every weight matrix, so its floor is reading the weights. PyTorch's CPU product for a few rows
// (MKL's matrix-vector kernel) reads them at a third to a half of the memory's speed on the machine we measure on,
// and inductor's reduction over a weight row (one chain of additions per output, no fused multiply-add) at about
// two thirds (docs/STUDIES.md, decoding). Here:
//
// - the weight's output rows are shared out among PyTorch's threads in contiguous ranges (at::parallel_for), so
//   each thread streams its part of the weight once, front to back;
// - one weight row at a time is multiplied by every input row (up to MAX_ROWS) while it is in the registers,
//   with two accumulators per input row (independent chains of fused multiply-adds); where two weight rows are
//   read at once (more than four input rows) the weight is prefetched AHEAD bytes ahead of the loads, else the
//   lines being loaded are prefetched as they are loaded;
// - int8 and bfloat16 weights are widened to float32 in the registers; the sums are float32 throughout, an int8
//   row's sum then multiplied by its scale.
//
// The arithmetic uses GCC's generic vectors, which the compiler maps onto the machine's vector instructions (the
// library is built for the machine it runs on).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vectors.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using namespace kvsieve_vectors;

typedef int8_t bytes16 __attribute__((vector_size(16)));
typedef int32_t ints16 __attribute__((vector_size(64)));
constexpr int MAX_ROWS = 8;       // input rows multiplied at once (a decoding batch)
// Bytes of the weight prefetched ahead of the loads where two weight rows are read at once. Where one is (up to four
// input rows), prefetching ahead slowed the stream (SmolLM2's 211 products, one row, x the weights' sum(): 1.40x with
// 512 bytes ahead, 1.55x with 2K, 1.32x with the lines being loaded where the memory was fast; 1.17x with 512
// bytes, 1.13x with the loaded lines or none where it was slow; four rows 1.31x, 1.24x, 1.62x with 512 bytes, the
// loaded lines, none); with two weight rows at once (eight input rows) 512 bytes ahead stayed best (34.8 ms against
// 36.4 for the lines being loaded; docs/STUDIES.md).
constexpr int64_t AHEAD = 512;
constexpr int64_t GRAIN = 64;     // output rows a thread takes at least

inline vec widen(const float* p) { return load(p); }

inline vec widen(const int8_t* p) {
  bytes16 b;
  std::memcpy(&b, p, sizeof b);
  ints16 i;
  for (int k = 0; k < W; ++k) i[k] = b[k];  // GCC turns this loop into one sign extension (vpmovsxbd on x86)
  return __builtin_convertvector(i, vec);
}

inline vec widen(const at::BFloat16* p) { return load(reinterpret_cast<const uint16_t*>(p)); }  // vectors.h

inline float scalar(float w) { return w; }
inline float scalar(int8_t w) { return static_cast<float>(w); }
inline float scalar(at::BFloat16 w) { return static_cast<float>(w); }

// Weight rows j .. j+J-1 times R input rows `x` (R x in) into out (R x outs), each sum times scale[j] where there is
// a scale. K accumulators per input and weight row (K x J = 2 independent chains per input row): one weight row
// with two accumulators for up to four input rows; two weight rows at once for more, so that each input vector
// loaded serves both (the loads, not the memory, bound 8 rows of one weight row at a time).
template <typename T, int R, int J>
void product_block(const float* x, const T* weight, const float* scale, int64_t in, int64_t outs, int64_t j,
                   float* out) {
  constexpr int K = 2 / J;
  constexpr int64_t STEP = K * W;
  vec acc[R][J][K] = {};
  int64_t i = 0;
  for (; i + STEP <= in; i += STEP) {
    vec xv[R][K];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < K; ++k) xv[r][k] = load(x + r * in + i + k * W);
    for (int b = 0; b < J; ++b) {
      const T* w = weight + (j + b) * in + i;
      const char* ahead = reinterpret_cast<const char*>(w) + (J == 2 ? AHEAD : 0);
      for (int64_t line = 0; line < STEP * static_cast<int64_t>(sizeof(T)); line += 64) __builtin_prefetch(ahead + line);
      for (int k = 0; k < K; ++k) {
        const vec wv = widen(w + k * W);
        for (int r = 0; r < R; ++r) acc[r][b][k] += wv * xv[r][k];
      }
    }
  }
  for (; i + W <= in; i += W)
    for (int b = 0; b < J; ++b) {
      const vec wv = widen(weight + (j + b) * in + i);
      for (int r = 0; r < R; ++r) acc[r][b][0] += wv * load(x + r * in + i);
    }
  for (int b = 0; b < J; ++b) {
    const T* w = weight + (j + b) * in;
    for (int r = 0; r < R; ++r) {
      vec total = acc[r][b][0];
      for (int k = 1; k < K; ++k) total += acc[r][b][k];
      float s = sum(total);
      for (int64_t t = i; t < in; ++t) s += scalar(w[t]) * x[r * in + t];
      out[r * outs + j + b] = scale != nullptr ? s * scale[j + b] : s;
    }
  }
}

// Output rows [first, last) of R input rows (`product_block`, two weight rows at a time from 5 input rows).
template <typename T, int R>
void product_rows(const float* x, const T* weight, const float* scale, int64_t in, int64_t outs, int64_t first,
                  int64_t last, float* out) {
  constexpr int J = R <= 4 ? 1 : 2;
  int64_t j = first;
  for (; j + J <= last; j += J) product_block<T, R, J>(x, weight, scale, in, outs, j, out);
  for (; j < last; ++j) product_block<T, R, 1>(x, weight, scale, in, outs, j, out);
}

template <typename T>
using RowsFn = void (*)(const float*, const T*, const float*, int64_t, int64_t, int64_t, int64_t, float*);

template <typename T>
RowsFn<T> rows_fn(int64_t rows) {
  switch (rows) {
    case 1: return product_rows<T, 1>;
    case 2: return product_rows<T, 2>;
    case 3: return product_rows<T, 3>;
    case 4: return product_rows<T, 4>;
    case 5: return product_rows<T, 5>;
    case 6: return product_rows<T, 6>;
    case 7: return product_rows<T, 7>;
    case 8: return product_rows<T, 8>;
    default: return nullptr;
  }
}

template <typename T>
void run(const at::Tensor& x, int64_t rows, const at::Tensor& weight, const float* scale, at::Tensor& out) {
  const int64_t in = weight.size(1), outs = weight.size(0);
  const RowsFn<T> fn = rows_fn<T>(rows);
  const float* xp = x.data_ptr<float>();
  const T* wp = weight.data_ptr<T>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, outs, GRAIN, [&](int64_t first, int64_t last) { fn(xp, wp, scale, in, outs, first, last, op); });
}

// x (..., in) float32, contiguous, of 1 to 8 rows (its leading dimensions: a decoding step's (batch, 1, in) as it
// comes, with no reshape); weight (out, in) float32, bfloat16 or int8, contiguous; scale (out,) float32 (required
// for int8 weights, else absent). Returns x @ weight.T (times scale per column), (..., out) float32.
at::Tensor decode_product(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (..., in) float32, contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(-1) && weight.is_contiguous(),
              "weight must be (out, in) and contiguous, with x's in");
  const int64_t rows = x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
  TORCH_CHECK(rows >= 1 && rows <= MAX_ROWS, "1 to ", MAX_ROWS, " rows, got ", rows);
  const auto kind = weight.scalar_type();
  TORCH_CHECK(kind == at::kFloat || kind == at::kBFloat16 || kind == at::kChar, "float32, bfloat16 or int8 weights");
  TORCH_CHECK((kind == at::kChar) == scale.has_value(), "a scale goes with int8 weights, and only with them");
  at::Tensor scales;
  if (scale.has_value()) {
    scales = scale->contiguous();
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == weight.size(0), "one float32 scale per output");
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  at::Tensor out = at::empty(shape, x.options());
  const float* sp = scale.has_value() ? scales.data_ptr<float>() : nullptr;
  if (kind == at::kFloat) run<float>(x, rows, weight, sp, out);
  else if (kind == at::kBFloat16) run<at::BFloat16>(x, rows, weight, sp, out);
  else run<int8_t>(x, rows, weight, sp, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsieve, m) { m.def("decode_product(Tensor x, Tensor weight, Tensor? scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvsieve, CPU, m) { m.impl("decode_product", &decode_product); }
