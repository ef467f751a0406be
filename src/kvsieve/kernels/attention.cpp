// kvsieve::decode_attention: a decoding step's attention on a CPU (one query per row) in one pass over the cache.
//
// Built and loaded with kvsieve's other CPU kernels by kvsieve/kernels/native.py; called by kvsieve/kernels/attention.py.
// A decoding step's attention reads every cached key and value once and does little arithmetic on them, so its
// floor is the memory's speed. PyTorch's products for it (a (rows x d) by (d x keys) product per KV head, then
// probabilities by values) are matrix kernels that repack their operands, and read the cache at a third to a half
// of that speed (docs/STUDIES.md, decoding). Here:
//
// - the keys of a KV head are split into chunks (`chunk_size`: as few and as long as keep PyTorch's threads evenly
//   busy, at most MAX_CHUNK keys); the chunks of every row and KV head are shared out among the threads
//   (at::parallel_for), each chunk read once from memory;
// - in a chunk, the query heads that share the KV head (up to 4 at a time) take their logits from each key
//   while it is in the registers; the chunk's softmax and its probabilities times the values follow while the
//   chunk is in the cache;
// - the chunks' partial results (their maximum, sum of exponentials and weighted values) are merged with the
//   usual rescaling by exp(m_chunk - m_row) (flash-decoding);
// - `decode_attention_probs` also returns the attention's probabilities, from the same pass (H2O's and A2SF's
//   per-step scores).
//
// A float32 or bfloat16 cache (bfloat16 keys and values are widened to float32 as they load, which is exact); the
// arithmetic is float32 throughout, in GCC's generic vectors, which the compiler maps onto the machine's vector
// instructions (the library is built for the machine it runs on). The output takes the query's dtype.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vectors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using namespace kvsieve_vectors;

typedef int ivec __attribute__((vector_size(64)));
constexpr int64_t MAX_CHUNK = 2048;  // keys per unit of work at most (a chunk's logits stay in the core's caches)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (a softmax's logits minus their maximum): 2^n p(r) with r = x - n ln2, Cephes' polynomial for
// exp(r) on [-ln2/2, ln2/2] (relative error about 1e-7); below -87.3 it returns exp(-87.3), about 1e-38.
inline vec exp_nonpositive(vec x) {
  x = x < -87.33654f ? vec{} - 87.33654f : x;
  vec fx = x * 1.44269504088896341f + 0.5f;
  vec n = __builtin_convertvector(__builtin_convertvector(fx, ivec), vec);
  n = n > fx ? n - 1.f : n;  // floor
  const vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec p = vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// A query head's DV vectors times a key's, lane by lane (two chains of fused multiply-adds); the dot product is the
// sum of the result's lanes. T: the cache's element, float or bfloat16 (its bits, `uint16_t`), widened as it loads.
template <int DV, typename T>
inline vec dot(const vec* q, const T* key) {
  vec a = q[0] * load(key), b = {};
  for (int c = 1; c < DV; ++c) (c % 2 ? b : a) += q[c] * load(key + c * W);
  return a + b;
}

// The lane sums of W vectors: lane j of the result is the sum of x[j]'s lanes (x is overwritten). A tree of shuffles
// (W - 1 additions of whole vectors) instead of W horizontal sums of W - 1 scalar additions each, which took most of
// the attention's time (docs/STUDIES.md, "Decoding near the memory limit"). Each level adds neighbouring groups of lanes of two vectors and interleaves the
// pairs' partial sums: after level `g` a vector holds 2g keys' sums, W / 2g lanes each.
inline vec sums(vec* x) {
  static_assert(W == 16, "the shuffles below are written for 16 lanes");
  const ivec lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const ivec hi1 = lo1 + 1;
  const ivec lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const ivec hi2 = lo2 + 2;
  const ivec lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const ivec hi4 = lo4 + 4;
  const ivec lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const ivec hi8 = lo8 + 8;
  auto pair = [](vec a, vec b, ivec lo, ivec hi) { return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi); };
  for (int i = 0; i < 8; ++i) x[i] = pair(x[2 * i], x[2 * i + 1], lo1, hi1);
  for (int i = 0; i < 4; ++i) x[i] = pair(x[2 * i], x[2 * i + 1], lo2, hi2);
  for (int i = 0; i < 2; ++i) x[i] = pair(x[2 * i], x[2 * i + 1], lo4, hi4);
  return pair(x[0], x[1], lo8, hi8);
}

// One chunk of `len` keys of one KV head for HEADS query heads of DV vectors each: the heads' logits (scaled) into
// `logits` (a row of `stride` per head), then their maximum `m`, sum of exponentials `s` and unnormalised output
// `o` (HEADS x D).
template <int DV, int HEADS, typename T>
void chunk_heads(const float* q, const T* k, int64_t k_step, const T* v, int64_t v_step, int64_t len,
                 float scale, float* logits, int64_t stride, float* m, float* s, float* o) {
  constexpr int D = DV * W;
  vec qv[HEADS][DV];
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < DV; ++c) qv[h][c] = load(q + h * D + c * W);
  int64_t n = 0;
  for (; n + W <= len; n += W) {  // W keys at a time (they stay in L1 while each head reads them)
    for (int h = 0; h < HEADS; ++h) {
      vec dots[W];
      for (int j = 0; j < W; ++j) dots[j] = dot<DV>(qv[h], k + (n + j) * k_step);
      store(logits + h * stride + n, sums(dots) * scale);
    }
  }
  for (; n < len; ++n)
    for (int h = 0; h < HEADS; ++h) logits[h * stride + n] = sum(dot<DV>(qv[h], k + n * k_step)) * scale;
  for (int h = 0; h < HEADS; ++h) {
    float* row = logits + h * stride;
    const float top = *std::max_element(row, row + len);
    vec total = {};
    int64_t i = 0;
    for (; i + W <= len; i += W) {
      const vec e = exp_nonpositive(load(row + i) - top);
      store(row + i, e);
      total += e;
    }
    float tail = 0.f;
    for (; i < len; ++i) {
      row[i] = std::exp(row[i] - top);
      tail += row[i];
    }
    m[h] = top;
    s[h] = sum(total) + tail;
  }
  vec out[HEADS][DV] = {};
  for (int64_t i = 0; i < len; ++i) {
    vec vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = load(v + i * v_step + c * W);
    for (int h = 0; h < HEADS; ++h) {
      const vec p = vec{} + logits[h * stride + i];
      for (int c = 0; c < DV; ++c) out[h][c] += p * vv[c];
    }
  }
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < DV; ++c) store(o + h * D + c * W, out[h][c]);
}

// All `heads` query heads of one KV head over one chunk of `len` keys, up to 4 at a time (`logits`: a row of
// `stride` per head).
template <int DV, typename T>
void chunk(const float* q, const T* k, int64_t k_step, const T* v, int64_t v_step, int64_t len,
           int64_t heads, float scale, float* logits, int64_t stride, float* m, float* s, float* o) {
  constexpr int D = DV * W;
  for (int64_t h = 0; h < heads; h += 4) {
    const int64_t group = std::min<int64_t>(4, heads - h);
    auto run = group == 4   ? chunk_heads<DV, 4, T>
               : group == 3 ? chunk_heads<DV, 3, T>
               : group == 2 ? chunk_heads<DV, 2, T>
                            : chunk_heads<DV, 1, T>;
    run(q + h * D, k, k_step, v, v_step, len, scale, logits + h * stride, stride, m + h, s + h, o + h * D);
  }
}

template <typename T>
using ChunkFn = void (*)(const float*, const T*, int64_t, const T*, int64_t, int64_t, int64_t, float, float*, int64_t,
                         float*, float*, float*);

template <typename T>
ChunkFn<T> chunk_for(int64_t dim) {
  switch (dim) {
    case 16: return chunk<1, T>;
    case 32: return chunk<2, T>;
    case 64: return chunk<4, T>;
    case 96: return chunk<6, T>;
    case 128: return chunk<8, T>;
    case 256: return chunk<16, T>;
    default: return nullptr;
  }
}

// Keys per chunk for `lanes` (rows x KV heads) of `keys` keys on `threads` threads: the chunk count per lane that
// gives the busiest thread the fewest keys (whole chunks, shared out evenly), the fewest chunks among equals. Short
// chunks cost time of their own (SmolLM2's 30 layers at 2K keys, one row on two threads: 256 keys a chunk, 24 chunks
// a layer, 3.41 ms; 1024 keys, 6 chunks, 2.92 ms), and a thread left without a chunk idles (1024 keys a chunk at
// 1K keys: 3 chunks for 2 threads, 1.98 ms against 1.57 with 512; docs/STUDIES.md).
int64_t chunk_size(int64_t lanes, int64_t keys, int64_t threads) {
  int64_t best = keys, best_load = -1;
  for (int64_t parts = (keys + MAX_CHUNK - 1) / MAX_CHUNK; parts <= keys; ++parts) {
    const int64_t size = (keys + parts - 1) / parts;
    const int64_t load = (lanes * parts + threads - 1) / threads * size;
    if (best_load < 0 || load < best_load) best = size, best_load = load;
    if (lanes * parts >= 4 * threads) break;  // more chunks than this only shorten them
  }
  return best;
}

// Where a lane (one row's KV head) reads its keys and values: the first key's and value's element offsets, the
// steps between keys and between values, and how many keys it attends to.
struct Lanes {
  std::vector<int64_t> key_at, value_at, ends;
  int64_t key_step, value_step;
};

// The common checks of both layouts: CPU tensors, float32 or bfloat16, one query per row, d contiguous and built for.
void check_tensors(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(), "CPU tensors only");
  const auto kind = key.scalar_type();
  TORCH_CHECK((kind == at::kFloat || kind == at::kBFloat16) && value.scalar_type() == kind &&
                  (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16),
              "float32 or bfloat16 tensors only, keys and values of one dtype");
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1, "one query per row");
  TORCH_CHECK(key.stride(-1) == 1 && value.stride(-1) == 1, "keys and values contiguous in d");
  TORCH_CHECK(key.size(-1) == query.size(3) && value.size(-1) == query.size(3), "keys, values and queries of one d");
  TORCH_CHECK(chunk_for<float>(query.size(3)) != nullptr, "head dimension ", query.size(3),
              " is not one of 16, 32, 64, 96, 128, 256");
}

// The lanes of a padded cache: key, value (b, g, n, d); lengths (b,) int64, row b attending to its first lengths[b]
// keys (all n without).
Lanes padded_lanes(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const std::optional<at::Tensor>& lengths) {
  const int64_t rows = query.size(0), kv_heads = key.size(1), keys = key.size(2);
  TORCH_CHECK(key.dim() == 4 && key.sizes() == value.sizes() && key.size(0) == rows && query.size(1) % kv_heads == 0,
              "query (b, h, 1, d) and key/value (b, g, n, d) with h a multiple of g");
  std::vector<int64_t> per_row(rows, keys);
  if (lengths.has_value()) {
    const at::Tensor counts = lengths->to(at::kLong).contiguous();
    TORCH_CHECK(counts.numel() == rows, "one length per row");
    const int64_t* c = counts.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) {
      TORCH_CHECK(c[b] >= 1 && c[b] <= keys, "a row's length must be in 1..", keys, ", got ", c[b]);
      per_row[b] = c[b];
    }
  }
  Lanes lanes{{}, {}, {}, key.stride(2), value.stride(2)};
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t g = 0; g < kv_heads; ++g) {
      lanes.key_at.push_back(b * key.stride(0) + g * key.stride(1));
      lanes.value_at.push_back(b * value.stride(0) + g * value.stride(1));
      lanes.ends.push_back(per_row[b]);
    }
  return lanes;
}

// The lanes of a segmented cache: key, value (total, d), KV head g of row b holding the lengths[b, g] entries from
// entry starts[b, g] on (starts, lengths (b, g) int64).
Lanes segment_lanes(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& starts,
                    const at::Tensor& lengths) {
  TORCH_CHECK(key.dim() == 2 && key.sizes() == value.sizes(), "segmented keys and values (total, d)");
  TORCH_CHECK(starts.dim() == 2 && starts.sizes() == lengths.sizes() && starts.size(0) == query.size(0) &&
                  query.size(1) % starts.size(1) == 0,
              "starts and lengths (b, g) with the query's h a multiple of g");
  const at::Tensor first = starts.to(at::kLong).contiguous(), counts = lengths.to(at::kLong).contiguous();
  const int64_t* f = first.data_ptr<int64_t>();
  const int64_t* c = counts.data_ptr<int64_t>();
  Lanes lanes{{}, {}, {}, key.stride(0), value.stride(0)};
  for (int64_t lane = 0; lane < first.numel(); ++lane) {
    TORCH_CHECK(c[lane] >= 1 && f[lane] >= 0 && f[lane] + c[lane] <= key.size(0), "segment ", lane, " (", f[lane],
                ", ", c[lane], " entries) is not within the ", key.size(0), " entries");
    lanes.key_at.push_back(f[lane] * key.stride(0));
    lanes.value_at.push_back(f[lane] * value.stride(0));
    lanes.ends.push_back(c[lane]);
  }
  return lanes;
}

// query (b, h, 1, d) over the keys and values each lane (row b, KV head g) reads (`lanes`); (b, h, 1, d): query head
// i reads KV head i / (h/g). Where `probs` is given ((b, h, width) float32, contiguous, width at least every lane's
// length) it receives each query head's attention over the keys (the softmax, 0 past the lane's length): the chunks'
// exponentials, rescaled once the chunks are merged, so the keys are read once for both (H2O's and A2SF's per-step
// scores).
at::Tensor attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const Lanes& lanes,
                  double scale, float* probs, int64_t width) {
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(3);
  const int64_t kv_heads = static_cast<int64_t>(lanes.ends.size()) / rows, group = heads / kv_heads;
  const auto& ends = lanes.ends;
  const int64_t longest = *std::max_element(ends.begin(), ends.end());
  const int64_t size = chunk_size(rows * kv_heads, longest, at::get_num_threads());
  const int64_t chunks = (longest + size - 1) / size;
  const at::Tensor q = query.to(at::kFloat).contiguous();  // the query and everything computed: float32
  const auto options = q.options();
  at::Tensor part_m = at::empty({rows, kv_heads, chunks, group}, options);
  at::Tensor part_s = at::empty({rows, kv_heads, chunks, group}, options);
  at::Tensor part_o = at::empty({rows, kv_heads, chunks, group, dim}, options);
  const float* qp = q.data_ptr<float>();
  float* pm = part_m.data_ptr<float>();
  float* ps = part_s.data_ptr<float>();
  float* po = part_o.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // Each chunk's partial result, for a cache of elements T (float, or bfloat16's bits widened as they load).
  auto partials = [&](auto element) {
    using T = decltype(element);
    const ChunkFn<T> run = chunk_for<T>(dim);
    const T* kp = static_cast<const T*>(key.data_ptr());
    const T* vp = static_cast<const T*>(value.data_ptr());
    at::parallel_for(0, rows * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> logits(group * size);
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t lane = unit / chunks, b = lane / kv_heads, g = lane % kv_heads, c = unit % chunks;
        const int64_t first = c * size, last = std::min(ends[lane], first + size);
        if (first >= last) {  // past this lane's keys
          std::fill(pm + unit * group, pm + (unit + 1) * group, NEG_INF);
          continue;
        }
        run(qp + (b * heads + g * group) * dim, kp + lanes.key_at[lane] + first * lanes.key_step, lanes.key_step,
            vp + lanes.value_at[lane] + first * lanes.value_step, lanes.value_step, last - first, group, sc,
            logits.data(), size, pm + unit * group, ps + unit * group, po + unit * group * dim);
        if (probs != nullptr)  // the chunk's exponentials, relative to its own maximum until the merge
          for (int64_t h = 0; h < group; ++h)
            std::copy(logits.data() + h * size, logits.data() + h * size + (last - first),
                      probs + ((b * heads + g * group + h) * width) + first);
      }
    });
  };
  if (key.scalar_type() == at::kBFloat16)
    partials(uint16_t{});
  else
    partials(float{});
  at::Tensor out = at::empty({rows, heads, 1, dim}, options);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bg = begin; bg < end; ++bg) {  // merge the chunks: bg * group + h is the query head
      for (int64_t h = 0; h < group; ++h) {
        float top = NEG_INF;
        for (int64_t c = 0; c < chunks; ++c) top = std::max(top, pm[(bg * chunks + c) * group + h]);
        float* row = op + (bg * group + h) * dim;
        std::fill(row, row + dim, 0.f);
        float total = 0.f;
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t at = (bg * chunks + c) * group + h;
          if (pm[at] == NEG_INF) continue;
          const float weight = std::exp(pm[at] - top);
          total += weight * ps[at];
          for (int64_t i = 0; i < dim; ++i) row[i] += weight * po[at * dim + i];
        }
        for (int64_t i = 0; i < dim; ++i) row[i] /= total;
        if (probs == nullptr) continue;
        float* p = probs + (bg * group + h) * width;
        for (int64_t c = 0; c < chunks; ++c) {  // each chunk's exponentials times exp(m_chunk - m_row) / sum
          const int64_t at = (bg * chunks + c) * group + h, first = c * size, last = std::min(ends[bg], first + size);
          if (pm[at] == NEG_INF) continue;
          const float factor = std::exp(pm[at] - top) / total;
          for (int64_t i = first; i < last; ++i) p[i] *= factor;
        }
        std::fill(p + ends[bg], p + width, 0.f);
      }
    }
  });
  return out.to(query.scalar_type());
}

// query (b, h, 1, d); key, value (b, g, n, d) with h a multiple of g and d contiguous; lengths (b,) int64: row b
// attends to its first lengths[b] keys (all n without). Returns (b, h, 1, d).
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& lengths, double scale) {
  check_tensors(query, key, value);
  return attend(query, key, value, padded_lanes(query, key, value, lengths), scale, nullptr, 0);
}

// The attention and, besides it, its probabilities (b, h, n) (`attend`).
std::tuple<at::Tensor, at::Tensor> decode_attention_probs(const at::Tensor& query, const at::Tensor& key,
                                                          const at::Tensor& value,
                                                          const std::optional<at::Tensor>& lengths, double scale) {
  check_tensors(query, key, value);
  const Lanes lanes = padded_lanes(query, key, value, lengths);
  at::Tensor probs = at::empty({query.size(0), query.size(1), key.size(2)}, query.options().dtype(at::kFloat));
  at::Tensor out = attend(query, key, value, lanes, scale, probs.data_ptr<float>(), key.size(2));
  return {out, probs};
}

// query (b, h, 1, d) over a segmented cache: key, value (total, d), KV head g of row b holding the lengths[b, g]
// entries from entry starts[b, g] on (per-head budgets: each head keeps its own count, `kvsieve.kv.heads`).
// Returns (b, h, 1, d).
at::Tensor segment_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& starts, const at::Tensor& lengths, double scale) {
  check_tensors(query, key, value);
  return attend(query, key, value, segment_lanes(query, key, value, starts, lengths), scale, nullptr, 0);
}

}  // namespace

TORCH_LIBRARY(kvsieve, m) {
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? lengths, float scale) -> Tensor");
  m.def(
      "decode_attention_probs(Tensor query, Tensor key, Tensor value, Tensor? lengths, float scale) -> (Tensor, "
      "Tensor)");
  m.def("segment_attention(Tensor query, Tensor key, Tensor value, Tensor starts, Tensor lengths, float scale) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(kvsieve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_probs", &decode_attention_probs);
  m.impl("segment_attention", &segment_attention);
}
