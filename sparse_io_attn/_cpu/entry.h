// What the raw ops' entry points (block-sparse and selection, forward, backward, decode) do alike:
// the operand checks and sizes, the forward's result tensors, the backward's row deltas.
// Part of each kernel.cpp's translation unit.
#pragma once

#include "tiles.h"

#include <tuple>

namespace sia {

struct Dims {  // q [B, Hq, Nq, D]; k and v [B, Hkv, Nk, D]
  int64_t B, Hq, Hkv, Nq, Nk, D;
};

// q, k, v checked (on the CPU, the shapes above, one dtype, Hq a multiple of Hkv): their sizes.
static Dims check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "sparse_io_attn cpu: tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3),
              "sparse_io_attn cpu: q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D] expected, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "sparse_io_attn cpu: q, k, v must share a dtype");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "sparse_io_attn cpu: Hq must be a multiple of Hkv");
  return Dims{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
}

// The backward's other inputs checked: dout and out with q's dtype and shape, stats fp32 [2, B, Hq, Nq].
static void check_grad_inputs(const at::Tensor& q, const at::Tensor& dout, const at::Tensor& out,
                              const at::Tensor& stats) {
  TORCH_CHECK(dout.device().is_cpu() && out.device().is_cpu() && stats.device().is_cpu(),
              "sparse_io_attn cpu: tensors must be on the CPU");
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "sparse_io_attn cpu: q, k, v, out, dout must share a dtype");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "sparse_io_attn cpu: out and dout must have ",
              "q's shape ", q.sizes(), ", got ", out.sizes(), " and ", dout.sizes());
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.dim() == 4 && stats.size(0) == 2 &&
                  stats.size(1) == q.size(0) && stats.size(2) == q.size(1) && stats.size(3) == q.size(2),
              "sparse_io_attn cpu: stats must be fp32 [2, B, Hq, Nq]");
}

// A forward's results, unwritten: out (q's dtype and shape), lse fp32 [B, Hq, Nq], stats fp32 [2, B, Hq, Nq].
static std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_results(const at::Tensor& q) {
  const auto f32 = q.options().dtype(at::kFloat);
  return {at::empty(q.sizes(), q.options()), at::empty({q.size(0), q.size(1), q.size(2)}, f32),
          at::empty({2, q.size(0), q.size(1), q.size(2)}, f32)};
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

}  // namespace sia
