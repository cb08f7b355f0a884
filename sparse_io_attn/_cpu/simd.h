// ISA selection, at::vec includes, constants and vector helpers (exp2, mask-bit blends, reductions).
// Part of kernel.cpp's single translation unit (see kernel.cpp for the overview).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2 1
#endif
// a namespace of our own for at::vec's inline code (never the same symbols as libtorch's copies)
#define CPU_CAPABILITY sparse_io_attn_cpu_vec

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

namespace sia {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();
static_assert(VL <= 16 && 32 % VL == 0, "vector length must divide a mask word");
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float FLT_MAX_F = std::numeric_limits<float>::max();

// Scaled scores above the largest finite float become that float (NaN and -inf pass through): the
// row maximum stays finite, so exp2(t - m) never sees inf - inf.
static inline Vec saturate(const Vec& x) { return at::vec::minimum(x, Vec(FLT_MAX_F)); }
constexpr float POS_INF = std::numeric_limits<float>::infinity();
constexpr double LOG2E = 1.4426950408889634;
constexpr float LN2 = 0.6931471805599453f;
constexpr uint32_t FULL_BITS = (VL >= 32) ? 0xFFFFFFFFu : ((1u << VL) - 1u);

// tiles: rows of a query tile, keys of a forward key chunk, keys per online-softmax step, keys
// of a backward key tile; number of backward tasks aimed at
constexpr int64_t MAX_BM = 128;
constexpr int64_t MAX_BN = 256;
constexpr int64_t GROUP_COLS = 256;
constexpr int64_t MAX_BNK = 128;
constexpr int64_t TARGET_TASKS = 32;
constexpr int64_t MAX_DQ_PARTIAL_BYTES = int64_t(2) << 30;

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t round_up(int64_t a, int64_t b) { return cdiv(a, b) * b; }

// ------------------------------------------------------------------------------ vector helpers
// 2^x for x <= 128; exactly 0 for x < -126, -inf and NaN. No denormal is ever produced (denormal
// results and underflow cost a microcode assist per instruction on x86).
static inline Vec vexp2(Vec x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 v = __m512(x);
  const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(v, n);  // [-0.5, 0.5] on live lanes
  // 2^f, degree-6 minimax polynomial (relative error ~1e-7 in fp32)
  __m512 p = _mm512_set1_ps(1.5345741038531283e-04f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3399904166177600e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6184889703267040e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503288458366430e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022646893022740e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314720570438740e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000000005534566f));
  return Vec(_mm512_maskz_scalef_ps(live, p, n));
#else
  return x.exp2();
#endif
}

// horizontal max and sum of one vector's lanes
#if defined(CPU_CAPABILITY_AVX512)
static inline float hmax(Vec v) { return _mm512_reduce_max_ps(__m512(v)); }
static inline float hsum(Vec v) { return _mm512_reduce_add_ps(__m512(v)); }
#else
// one vector's lanes in memory: the portable path of the lane-wise helpers
struct Lanes {
  alignas(64) float x[VL];
  explicit Lanes(Vec v) { v.store(x); }
};
// lane 0, then every larger lane, in order
static inline float hmax(Vec v) { const Lanes l(v); return *std::max_element(l.x, l.x + VL); }
// 0 + lane 0 + lane 1 + ..., in order
static inline float hsum(Vec v) { const Lanes l(v); return std::accumulate(l.x, l.x + VL, 0.f); }
#endif

// lanes whose bit is 0 become -inf
static inline Vec keep_bits(Vec s, uint32_t bits) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_mask_blend_ps(static_cast<__mmask16>(bits), _mm512_set1_ps(NEG_INF), __m512(s)));
#else
  if ((bits & FULL_BITS) == FULL_BITS) return s;
  Lanes l(s);
  for (int64_t i = 0; i < VL; ++i)
    if (!((bits >> i) & 1u)) l.x[i] = NEG_INF;
  return Vec::loadu(l.x);
#endif
}

// bits of the lanes [0, n) of one vector
static inline uint32_t len_bits(int64_t n) {
  if (n <= 0) return 0u;
  if (n >= VL) return FULL_BITS;
  return (1u << n) - 1u;
}

// VL mask bits of a packed mask row starting at bit `bit` (a multiple of VL)
static inline uint32_t word_bits(const int32_t* row, int64_t bit) {
  const uint32_t w = static_cast<uint32_t>(row[bit >> 5]);
  return (w >> (bit & 31)) & FULL_BITS;
}

static inline void scale_row(float* x, int64_t n, float a) {
  const Vec va(a);
  int64_t d = 0;
  for (; d + VL <= n; d += VL) (Vec::loadu(x + d) * va).store(x + d);
  for (; d < n; ++d) x[d] *= a;
}

static inline void add_row(float* x, const float* y, int64_t n) {
  int64_t d = 0;
  for (; d + VL <= n; d += VL) (Vec::loadu(x + d) + Vec::loadu(y + d)).store(x + d);
  for (; d < n; ++d) x[d] += y[d];
}

}  // namespace sia
