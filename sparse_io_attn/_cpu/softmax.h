// The online-softmax row step and the finished row's store, shared by the forward kernels that take a
// row's scores one tile at a time (block-sparse and selection decode, selection query-major and
// key-major); the block-sparse prefill forward batches its steps over a whole tile (forward.h) and
// shares the store only. Part of each kernel.cpp's translation unit.
//
// Arithmetic (built with -ffp-contract=off, and repeated exactly by every backward): t = fl(c s)
// saturated at the largest finite float, the row maximum m of those t, p = exp2(t - m), so the row's
// largest t gives exactly exp2(0) = 1 at any logit size.
#pragma once

#include "simd.h"

namespace sia {

// Pass 1 of a step over ncv (whole vectors) raw scores s: t = fl(c s) saturated, lanes whose
// bits(jv) are 0 become -inf, t stored over s. Returns the largest t (-inf when none is allowed).
template <typename Bits>
static inline float scaled_max(float* s, int64_t ncv, const Vec& vc, Bits&& bits) {
  Vec vmax(NEG_INF);
  for (int64_t jv = 0; jv < ncv; jv += VL) {
    const Vec x = keep_bits(saturate(Vec::loadu(s + jv) * vc), bits(jv));
    x.store(s + jv);
    vmax = at::vec::maximum(vmax, x);
  }
  return hmax(vmax);
}

// Pass 2: s becomes p = exp2(t - m) (0 where t = -inf; every p is 0 when m = -inf). Returns the sum
// of the p.
static inline float exp2_sum(float* s, int64_t ncv, float m) {
  const Vec vm(m == NEG_INF ? 0.f : m);
  Vec vsum(0.f);
  for (int64_t jv = 0; jv < ncv; jv += VL) {
    const Vec p = vexp2(Vec::loadu(s + jv) - vm);
    p.store(s + jv);
    vsum = vsum + p;
  }
  return hsum(vsum);
}

// One online-softmax step of a row over a tile of nc raw scores s (whole vectors readable): lanes
// whose bits(jv) are 0 (and those past nc) masked, the running maximum m and sum l updated, the
// row's accumulator acc [D] rescaled when m grew; s becomes p = exp2(t - m) (0 where masked).
template <typename Bits>
static inline void softmax_step(float* s, int64_t nc, float c2, float& m, float& l, float* acc, int64_t D,
                                Bits&& bits) {
  const int64_t ncv = round_up(nc, VL);
  const float mo = m;
  const float mn = std::max(mo, scaled_max(s, ncv, Vec(c2), [&](int64_t jv) { return bits(jv) & len_bits(nc - jv); }));
  if (mn > mo && mo != NEG_INF) {  // the running maximum grew: rescale
    const float alpha = std::exp2(mo - mn);
    l *= alpha;
    scale_row(acc, D, alpha);
  }
  l += exp2_sum(s, ncv, mn);
  m = mn;
}

struct AllBits {  // softmax_step's mask when every key of the tile is allowed
  uint32_t operator()(int64_t) const { return FULL_BITS; }
};

// Where a forward's finished rows go: out [rows, Dv] in the output dtype, its rounding residual res
// (fl(o - fl(o)), the backward's delta from the fp32 output: _attention/delta.py; null when not asked
// for), lse and the stats (m, log2 l) [rows]; row (b, h, t) is (b Hq + h) Nq + t. sinks2 [Hq]: the
// heads' sink logits in base 2 (null: none; -inf: none for that head).
template <typename T>
struct RowStore {
  T* out;
  T* res;
  float *lse, *st_m, *st_l;
  const float* sinks2;
  int64_t Dv;

  // Row `row` of head h finished with accumulator acc [Dv], maximum m and sum l. A head's sink joins
  // the denominator: m' = max(m, s), l' = l 2^(m - m') + 2^(s - m') (_attention/sinks.py). Then o =
  // acc / l, lse = (m + log2 l) ln 2 (natural log), stats (m, log2 l); a row without an allowed key
  // and without a sink (l = 0) gets o = 0, lse -inf and stats (+inf, 0); a row without an allowed key
  // never reads acc (callers may leave it unset there), its output 0 with or without a sink.
  void put(int64_t row, int64_t h, const float* acc, float m, float l) const {
    const bool keys = l != 0.f;  // acc is read only then (a caller may leave an empty row's acc unset)
    float a = 1.f;               // acc's rescale to the new maximum
    if (sinks2 != nullptr && sinks2[h] != NEG_INF) {
      const float s = sinks2[h], top = std::max(m, s);
      a = keys ? std::exp2(m - top) : 0.f;
      l = l * a + std::exp2(s - top);
      m = top;
    }
    const float scale = a / l;  // used where l > 0
    T* o = out + row * Dv;
    T* r = res != nullptr ? res + row * Dv : nullptr;
    for (int64_t d = 0; d < Dv; ++d) {
      const float x = !keys ? 0.f : a == 1.f ? acc[d] / l : acc[d] * scale;
      o[d] = static_cast<T>(x);
      if (r != nullptr) r[d] = static_cast<T>(x - static_cast<float>(static_cast<T>(x)));
    }
    if (l == 0.f) {
      lse[row] = NEG_INF;
      st_m[row] = POS_INF;
      st_l[row] = 0.f;
      return;
    }
    const float log2l = std::log2(l);
    lse[row] = (m + log2l) * LN2;
    st_m[row] = m;
    st_l[row] = log2l;
  }
};

}  // namespace sia
