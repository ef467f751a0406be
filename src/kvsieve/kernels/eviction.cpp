// kvsieve::evict_lowest: a steady evicting row's eviction on a CPU, one entry per KV head, in one pass.
//
// Built and loaded with kvsieve's other CPU kernels by kvsieve/kernels/native.py; called by kvsieve/kernels/eviction.py
// (`steady_eviction`, whose other branch is the same eviction in PyTorch's operators: a GPU's, and where
// this kernel does not serve). A row at its budget whose policy evicts every step (H2O, A2SF, TOVA, StreamingLLM in
// the engine's static and ordinary steps) has, after the step, budget + 1 entries in every layer and KV head, the new one at
// column `budget`. Per (layer, KV head), independently and in parallel:
//
// - the victim is the entry of the lowest score, the oldest (smallest stamp) among equal scores, where entries
//   protected by the policy (the first `sinks` ever cached and the last `recent`, by stamp) score +infinity and a
//   position-only policy's entries all score 0 (`scores` empty): exactly `keep_indices`' complement;
// - the new entry moves into the victim's slot: its key and value (any dtype, copied as bytes) in the batch tables'
//   row `row`, its stamp (`clock`) in the stamp table, and its score among the row's first `budget` scores, which go
//   to `carried` (the tensors the next step's observers read).
//
// PyTorch's operators for the same (`EvictRun.after_step`: about 35 of them on (layers x KV heads, budget + 1)
// tensors, int64 stamps among them, views and a copy per layer) took 1.4 ms of a 20-25 ms step for SmolLM2 at a
// 1024-entry budget; inductor's fused kernel for them 0.6 ms and its guards 0.2 ms more (docs/STUDIES.md, decoding).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace {

constexpr float INF = std::numeric_limits<float>::infinity();
constexpr int64_t NEVER = std::numeric_limits<int64_t>::max();

// The column of one KV head's victim among `budget` entries (stamps `ages`, scores `s`; SCORED false: all 0) and
// the new one (column `budget`, stamp `stamp`, score s[budget]): the lowest score, the oldest stamp among entries
// of that score (stamps are unique), protected entries (stamp below `sinks`, or at or above `newest`) scoring
// +infinity. Three branch-free passes the compiler vectorizes: one branching pass, mispredicted on every protected
// entry (H2O's recent half is scattered through the row), took several times as long.
template <bool SCORED>
int64_t lowest_oldest(const float* s, const int64_t* ages, int64_t budget, int64_t stamp, int64_t sinks,
                      int64_t newest) {
  const bool new_kept = (stamp < sinks) | (stamp >= newest);
  const float new_score = new_kept ? INF : (SCORED ? s[budget] : 0.f);
  float best = new_score;
#pragma omp simd reduction(min : best)
  for (int64_t i = 0; i < budget; ++i) {
    const int64_t age = ages[i];
    const float score = ((age < sinks) | (age >= newest)) ? INF : (SCORED ? s[i] : 0.f);
    best = score < best ? score : best;
  }
  int64_t oldest = new_score == best ? stamp : NEVER;
#pragma omp simd reduction(min : oldest)
  for (int64_t i = 0; i < budget; ++i) {
    const int64_t age = ages[i];
    const float score = ((age < sinks) | (age >= newest)) ? INF : (SCORED ? s[i] : 0.f);
    const int64_t candidate = score == best ? age : NEVER;
    oldest = candidate < oldest ? candidate : oldest;
  }
  int64_t victim = budget;
  for (int64_t i = 0; i < budget; ++i) victim = ages[i] == oldest ? i : victim;
  return victim;
}

at::Tensor evict_lowest(const at::Tensor& keys, const at::Tensor& values, int64_t row, at::TensorList scores,
                        at::TensorList carried, const at::Tensor& stamp_table, const at::Tensor& clock, int64_t budget,
                        int64_t sinks, int64_t recent) {
  TORCH_CHECK(keys.device().is_cpu() && values.device().is_cpu() && stamp_table.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(keys.dim() == 5 && keys.sizes() == values.sizes() && keys.scalar_type() == values.scalar_type(),
              "keys and values: (layers, rows, kv_heads, capacity, d) tables of one dtype");
  TORCH_CHECK(keys.stride(4) == 1 && values.stride(4) == 1, "tables contiguous in d");
  const int64_t layers = stamp_table.size(0), heads = stamp_table.size(1), dim = keys.size(4);
  TORCH_CHECK(stamp_table.dim() == 3 && stamp_table.scalar_type() == at::kLong && stamp_table.stride(2) == 1,
              "stamp table: (layers, kv_heads, capacity) int64, contiguous in its last dimension");
  TORCH_CHECK(keys.size(0) == layers && keys.size(2) == heads && row >= 0 && row < keys.size(1),
              "the tables' layers, KV heads and rows must match the stamp table's and `row`");
  TORCH_CHECK(budget >= 1 && budget < keys.size(3) && budget < stamp_table.size(2), "budget + 1 entries must fit");
  TORCH_CHECK(clock.numel() == 1 && clock.scalar_type() == at::kLong && clock.device().is_cpu(), "clock: int64");
  const bool scored = !scores.empty();
  TORCH_CHECK(!scored || (static_cast<int64_t>(scores.size()) == layers && carried.size() == scores.size()),
              "one scores and one carried tensor per layer (none for a position-only policy)");
  for (int64_t l = 0; scored && l < layers; ++l) {
    TORCH_CHECK(scores[l].scalar_type() == at::kFloat && carried[l].scalar_type() == at::kFloat,
                "scores and carried in float32");
    TORCH_CHECK(scores[l].dim() == 2 && scores[l].size(0) == heads && scores[l].size(1) == budget + 1 &&
                    scores[l].stride(1) == 1,
                "scores per layer: (kv_heads, budget + 1), contiguous in the last dimension");
    TORCH_CHECK(carried[l].dim() == 2 && carried[l].size(0) == heads && carried[l].size(1) == budget &&
                    carried[l].stride(1) == 1,
                "carried per layer: (kv_heads, budget), contiguous in the last dimension");
  }
  int64_t* now = clock.data_ptr<int64_t>();
  const int64_t stamp = *now;  // the new entry's
  const int64_t newest = stamp + 1 - recent;  // stamps at or above it are protected (the clock once advanced)
  at::Tensor victims = at::empty({layers, heads}, stamp_table.options());
  int64_t* out = victims.data_ptr<int64_t>();
  char* kp = static_cast<char*>(keys.data_ptr());
  char* vp = static_cast<char*>(values.data_ptr());
  int64_t* tp = stamp_table.data_ptr<int64_t>();
  const int64_t element = keys.element_size();
  auto move = [&](const at::Tensor& table, char* data, int64_t l, int64_t h, int64_t victim) {  // new entry -> victim
    char* head = data + (l * table.stride(0) + row * table.stride(1) + h * table.stride(2)) * element;
    std::memcpy(head + victim * table.stride(3) * element, head + budget * table.stride(3) * element, dim * element);
  };
  at::parallel_for(0, layers * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t lane = begin; lane < end; ++lane) {
      const int64_t l = lane / heads, h = lane % heads;
      int64_t* ages = tp + l * stamp_table.stride(0) + h * stamp_table.stride(1);
      const float* s = scored ? scores[l].data_ptr<float>() + h * scores[l].stride(0) : nullptr;
      const int64_t victim = scored ? lowest_oldest<true>(s, ages, budget, stamp, sinks, newest)
                                    : lowest_oldest<false>(s, ages, budget, stamp, sinks, newest);
      out[lane] = victim;
      ages[victim] = stamp;
      if (victim != budget) {
        move(keys, kp, l, h, victim);
        move(values, vp, l, h, victim);
      }
      if (scored) {
        float* c = carried[l].data_ptr<float>() + h * carried[l].stride(0);
        std::memcpy(c, s, budget * sizeof(float));
        if (victim != budget) c[victim] = s[budget];
      }
    }
  });
  *now = stamp + 1;
  return victims;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvsieve, m) {
  m.def(
      "evict_lowest(Tensor(a!) keys, Tensor(b!) values, int row, Tensor[] scores, Tensor(c!)[] carried, "
      "Tensor(d!) stamp_table, Tensor(e!) clock, int budget, int sinks, int recent) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvsieve, CPU, m) { m.impl("evict_lowest", &evict_lowest); }
