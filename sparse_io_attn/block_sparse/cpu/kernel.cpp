// Backend "cpu" of sparse_io_attn: fused block-sparse flash attention, forward and backward.
//
// One translation unit (this file and the headers schedule.h, forward.h, backward.h, decode.h, with
// the shared simd.h, tiles.h, entry.h, softmax.h and split_k.h of sparse_io_attn/_cpu/), JIT-built
// with the other ops' kernels by sparse_io_attn/_cpu/build.py (torch.utils.cpp_extension.load) and
// registered as torch ops in the namespace `sparse_io_attn_cpu` (TORCH_LIBRARY_FRAGMENT: no
// pybind11, which keeps the build short).
//
// Math (the same as the Triton kernels and the torch path): scores in base 2,
// t = (q . k) * c with c = sm_scale * log2(e); online softmax over the kept key blocks of a
// query tile; stats = (row maximum m, log2 of the row sum l); backward recomputes
// P = exp2((t - m) - log2 l), dS = P * (dP - delta), delta = rowsum(dO * O). t is rounded to fp32
// before m (the maximum of those rounded values) is subtracted, never fused into one fma, so the
// largest t of a row gives exactly exp2(0) at any logit size (built with -ffp-contract=off).
//
// Forward: one task per (batch, query head, query tile of BM <= 128 rows), walking the CSR list
// of its query block (partial blocks, then full blocks). Kept key chunks are taken in groups of
// up to GROUP_COLS keys per online-softmax step: one S tile [BM, <= GROUP_COLS] (one brgemm per
// chunk), one max pass and one exp pass per row over the whole group, one rescale of the
// accumulator per group, then one brgemm P V per chunk. Full blocks run without any mask;
// partial blocks apply key/query padding, the causal test and their element-mask bits, and are
// first trimmed to the rows and columns that can hold an allowed element (the bounding box of
// their mask intersected with the causal and length limits: a sliding window's edge blocks cost
// a fraction of a block).
//
// Backward (5 tile products per kept tile, S and dP computed once): one task per (batch, kv head,
// key segment); a key segment is a run of key tiles (<= 128 keys) chosen from the layout only
// (never from the thread count): about TARGET_TASKS tasks in all, cut at equal shares of the
// segment's schedule entries. For each key tile the task loops over the query heads of its GQA
// group and their CSC entries (partial, then full) in order, accumulating dK, dV in buffers of
// the task and dQ^T = K^T dS^T into a per-segment fp32 buffer. A last pass sums the segments'
// dQ^T buffers in segment order (only the query blocks a segment touches are zeroed and read).
// Partial tiles are trimmed like the forward's.
//
// V may have its own head dim Dv; the forward folds optional per-head sinks into each row and returns
// the output's rounding residual when asked (softmax.h's RowStore); the backward takes the caller's
// row deltas when given (entry.h's deltas_into).
//
// Deterministic: every output element is produced by exactly one task summing in a fixed order,
// and the decomposition depends on shapes and layout only; no atomics on data. Results are
// bitwise identical across runs and thread counts. Tasks are handed to at::parallel_for threads
// through a counter (which thread runs a task does not change what it computes).
//
// Tile products are at::native::cpublas::brgemm calls on fp32 tiles (oneDNN's ukernel where
// available; without AMX its fp32 kernel outruns the bf16 VNNI one). Inputs of any
// dtype/strides are read directly when they are fp32 with a contiguous head dim, and otherwise
// packed once per call into fp32 row-major copies; transposed fp32 copies (K^T per key block;
// Q^T, dO^T per query block) are packed once per call. Everything is computed in fp32 and rounded
// once to the input dtype at the end. Large work buffers are cached between calls (BufferCache).
//
// Vector code goes through at::vec::Vectorized<float> with AVX-512 fast paths (exp2, bit-mask
// blends, reductions) selected at compile time; other ISAs use the generic Vectorized code.

#include "forward.h"
#include "backward.h"
#include "decode.h"

namespace sia {

// masks [NM, bq, ceil(bk/32)] -> [NM, bk, ceil(bq/32)]: bit (r, c) -> bit (c, r)
at::Tensor transpose_masks(const at::Tensor& masks, int64_t block_k) {
  TORCH_CHECK(masks.scalar_type() == at::kInt && masks.dim() == 3 && masks.device().is_cpu(),
              "sparse_io_attn cpu: masks must be int32 [num_masks, BLOCK_SIZE_Q, words] on the CPU");
  const auto m = masks.contiguous();
  const int64_t NM = m.size(0), bq = m.size(1), W = m.size(2), WT = cdiv(bq, 32);
  TORCH_CHECK(W == cdiv(block_k, 32), "sparse_io_attn cpu: masks have ", W, " words per row, block_k ", block_k,
              " needs ", cdiv(block_k, 32));
  auto out = at::empty({NM, block_k, WT}, m.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(m.data_ptr<int32_t>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, NM, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t x = lo; x < hi; ++x) {
      uint32_t* d = dst + x * block_k * WT;
      std::fill(d, d + block_k * WT, 0u);
      const uint32_t* s = src + x * bq * W;
      for (int64_t r = 0; r < bq; ++r)
        for (int64_t c = 0; c < block_k; ++c)
          if ((s[r * W + (c >> 5)] >> (c & 31)) & 1u) d[c * WT + (r >> 5)] |= 1u << (r & 31);
    }
  });
  return out;
}

// Which vector code this build uses (for tests and the benchmark header).
std::string capability() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#else
  return "default";
#endif
}

}  // namespace sia


TORCH_LIBRARY_FRAGMENT(sparse_io_attn_cpu, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, Tensor full_ptr, Tensor full_idx, Tensor part_ptr, Tensor part_idx, "
        "Tensor part_mask, Tensor masks, int block_q, int block_k, int stride_lb, int stride_lh, "
        "int? causal_offset, float sm_scale, Tensor? sinks=None, bool residual=False) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, Tensor full_ptr, "
        "Tensor full_idx, Tensor part_ptr, Tensor part_idx, Tensor part_mask, Tensor masks, Tensor masks_t, "
        "int block_q, int block_k, int stride_lb, int stride_lh, int? causal_offset, float sm_scale, "
        "Tensor? delta=None) -> (Tensor, Tensor, Tensor)");
  m.def("fwd_decode(Tensor q, Tensor k, Tensor v, Tensor full_ptr, Tensor full_idx, Tensor part_ptr, "
        "Tensor part_idx, Tensor part_mask, Tensor masks, int block_q, int block_k, int stride_lb, int stride_lh, "
        "int? causal_offset, float sm_scale, Tensor? sinks=None, bool residual=False) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("decode_work_bytes() -> int", &sia::decode_work_bytes);
  m.def("transpose_masks(Tensor masks, int block_k) -> Tensor");
  m.def("capability() -> str", &sia::capability);
  m.def("empty_cache() -> ()", &sia::empty_cache);
}

TORCH_LIBRARY_IMPL(sparse_io_attn_cpu, CPU, m) {
  m.impl("fwd", &sia::fwd);
  m.impl("bwd", &sia::bwd);
  m.impl("fwd_decode", &sia::fwd_decode);
  m.impl("transpose_masks", &sia::transpose_masks);
}
