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

// A finished row: o = acc / l in the output's dtype, lse = (m + log2 l) ln 2 (natural log) and the
// stats (m, log2 l); a row without an allowed key (l = 0) gets o = 0, lse -inf and stats (+inf, 0).
template <typename T>
static inline void store_row(const float* acc, float m, float l, int64_t D, T* o, float* lse, float* st_m,
                             float* st_l) {
  if (l == 0.f) {
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(0.f);
    *lse = NEG_INF;
    *st_m = POS_INF;
    *st_l = 0.f;
    return;
  }
  for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] / l);
  const float log2l = std::log2(l);
  *lse = (m + log2l) * LN2;
  *st_m = m;
  *st_l = log2l;
}

}  // namespace sia
