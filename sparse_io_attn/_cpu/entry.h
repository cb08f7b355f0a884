// What the raw ops' entry points (block-sparse and selection, forward, backward, decode) do alike:
// the operand checks and sizes, the forward's result tensors, the backward's row deltas.
// Part of each kernel.cpp's translation unit.
#pragma once

#include "softmax.h"
#include "tiles.h"

#include <tuple>

namespace sia {

struct Dims {  // q [B, Hq, Nq, D]; k [B, Hkv, Nk, D]; v [B, Hkv, Nk, Dv]
  int64_t B, Hq, Hkv, Nq, Nk, D, Dv;
};

// q, k, v checked (on the CPU, the shapes above, one dtype, Hq a multiple of Hkv): their sizes.
static Dims check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "sparse_io_attn cpu: tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && v.size(0) == k.size(0) && v.size(1) == k.size(1) &&
                  v.size(2) == k.size(2) && q.size(0) == k.size(0) && q.size(3) == k.size(3),
              "sparse_io_attn cpu: q [B, Hq, Nq, D], k [B, Hkv, Nk, D] and v [B, Hkv, Nk, Dv] expected, got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "sparse_io_attn cpu: q, k, v must share a dtype");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "sparse_io_attn cpu: Hq must be a multiple of Hkv");
  return Dims{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
}

// The backward's other inputs checked: dout and out with q's dtype and shape [B, Hq, Nq, Dv], stats
// fp32 [2, B, Hq, Nq].
static void check_grad_inputs(const at::Tensor& q, const at::Tensor& v, const at::Tensor& dout, const at::Tensor& out,
                              const at::Tensor& stats) {
  TORCH_CHECK(dout.device().is_cpu() && out.device().is_cpu() && stats.device().is_cpu(),
              "sparse_io_attn cpu: tensors must be on the CPU");
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "sparse_io_attn cpu: q, k, v, out, dout must share a dtype");
  const std::vector<int64_t> shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  TORCH_CHECK(dout.sizes() == shape && out.sizes() == shape, "sparse_io_attn cpu: out and dout must have shape ",
              shape, ", got ", out.sizes(), " and ", dout.sizes());
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.dim() == 4 && stats.size(0) == 2 &&
                  stats.size(1) == q.size(0) && stats.size(2) == q.size(1) && stats.size(3) == q.size(2),
              "sparse_io_attn cpu: stats must be fp32 [2, B, Hq, Nq]");
}

// A forward's results, unwritten: out [B, Hq, Nq, Dv] (q's dtype), lse fp32 [B, Hq, Nq], stats fp32
// [2, B, Hq, Nq], and the output's rounding residual (out's shape and dtype when asked for and the
// dtype is not fp32, else empty).
struct Results {
  at::Tensor out, lse, stats, res;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> tuple() const { return {out, lse, stats, res}; }
};

static Results forward_results(const at::Tensor& q, const at::Tensor& v, bool residual) {
  const auto f32 = q.options().dtype(at::kFloat);
  const std::vector<int64_t> shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  const bool res = residual && q.scalar_type() != at::kFloat;
  return {at::empty(shape, q.options()), at::empty({q.size(0), q.size(1), q.size(2)}, f32),
          at::empty({2, q.size(0), q.size(1), q.size(2)}, f32),
          res ? at::empty(shape, q.options()) : at::empty({0}, q.options())};
}

// The sinks argument checked (fp32 [Hq] contiguous on the CPU, base 2): its data, or null for none.
static const float* sinks_of(const std::optional<at::Tensor>& sinks, int64_t Hq) {
  if (!sinks.has_value()) return nullptr;
  const at::Tensor& s = *sinks;
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 1 &&
                  s.size(0) == Hq,
              "sparse_io_attn cpu: sinks must be a contiguous fp32 CPU tensor [Hq] = [", Hq, "], got ", s.sizes());
  return s.data_ptr<float>();
}

// Where the finished rows of a forward go (softmax.h's RowStore).
template <typename T>
static RowStore<T> row_store(Results& r, const float* sinks2) {
  float* st = r.stats.data_ptr<float>();
  return RowStore<T>{r.out.data_ptr<T>(), r.res.numel() ? r.res.data_ptr<T>() : nullptr, r.lse.data_ptr<float>(),
                     st, st + r.lse.numel(), sinks2, r.out.size(3)};
}

// A backward's results, unwritten: dq, dk, dv with q's, k's, v's dtype and shape.
static std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_results(const at::Tensor& q, const at::Tensor& k,
                                                                   const at::Tensor& v) {
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options()), at::empty(v.sizes(), v.options())};
}

// delta = rowsum(dO * O) of every query row in fp32 (D summed in order), row i of (b, h) at
// dst[(b * Hq + h) * ld_bh + i * ld_i].
static void row_deltas(const at::Tensor& out, const at::Tensor& dout, float* dst, int64_t ld_bh, int64_t ld_i) {
  const int64_t Hq = out.size(1), Nq = out.size(2), D = out.size(3);
  dispatch(out.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* o = typed<scalar_t>(out);
    const scalar_t* g = typed<scalar_t>(dout);
    const int64_t o0 = out.stride(0), o1 = out.stride(1), o2 = out.stride(2), o3 = out.stride(3);
    const int64_t g0 = dout.stride(0), g1 = dout.stride(1), g2 = dout.stride(2), g3 = dout.stride(3);
    at::parallel_for(0, out.size(0) * Hq, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t bh = lo; bh < hi; ++bh) {
        const int64_t b = bh / Hq, h = bh % Hq;
        for (int64_t i = 0; i < Nq; ++i) {
          const scalar_t* orow = o + b * o0 + h * o1 + i * o2;
          const scalar_t* grow = g + b * g0 + h * g1 + i * g2;
          float acc = 0.f;
          for (int64_t d = 0; d < D; ++d) acc += static_cast<float>(orow[d * o3]) * static_cast<float>(grow[d * g3]);
          dst[bh * ld_bh + i * ld_i] = acc;
        }
      }
    });
  });
}

// The backward's row deltas at dst (as row_deltas): the caller's fp32 [B, Hq, Nq] `delta` when given
// (formed from the forward's fp32 output: _attention/delta.py), else rowsum(dO * O).
static void deltas_into(const std::optional<at::Tensor>& delta, const at::Tensor& out, const at::Tensor& dout,
                        float* dst, int64_t ld_bh, int64_t ld_i) {
  if (!delta.has_value()) {
    row_deltas(out, dout, dst, ld_bh, ld_i);
    return;
  }
  const int64_t BH = out.size(0) * out.size(1), Nq = out.size(2);
  const at::Tensor& d = *delta;
  TORCH_CHECK(d.device().is_cpu() && d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 3 &&
                  d.size(0) == out.size(0) && d.size(1) == out.size(1) && d.size(2) == Nq,
              "sparse_io_attn cpu: delta must be a contiguous fp32 CPU tensor [B, Hq, Nq], got ", d.sizes());
  const float* src = d.data_ptr<float>();
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t i = 0; i < Nq; ++i) dst[bh * ld_bh + i * ld_i] = src[bh * Nq + i];
}

}  // namespace sia
