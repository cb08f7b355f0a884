// The problem (shapes, tiles, element masks and their bounding boxes) and the schedule's lists.
// Part of kernel.cpp's single translation unit (see kernel.cpp for the overview).
#pragma once

#include "entry.h"

namespace sia {

// ------------------------------------------------------------------------------ problem
struct Lists {  // one order (CSR rows or CSC columns) of the schedule
  const int32_t *full_ptr, *full_idx, *part_ptr, *part_idx, *part_mask;
  int64_t count(int64_t i) const {
    return (full_ptr[i + 1] - full_ptr[i]) + static_cast<int64_t>(part_ptr[i + 1] - part_ptr[i]);
  }
};

struct Problem : Dims {
  int64_t G, bq, bk, nqb, nkb, W, WT, slb, slh, NM;
  bool causal;
  int64_t delta;
  float c2, sm_scale;
  int64_t BM, BMv, nsubq;  // query tiles: BM rows (a multiple of 16 when a block is split), nsubq per block
  int64_t BN, gcols, lds_f;  // forward: key chunk, keys per softmax step, S leading dimension
  int64_t BNK, nsubk, lds_b;  // backward: key tile, tiles per block, S^T leading dimension
  const int32_t* masks = nullptr;    // [NM, bq, W]
  const int32_t* masks_t = nullptr;  // [NM, bk, WT]
  std::vector<int32_t> boxes;        // [NM, 4]: rows [r0, r1) x columns [c0, c1) holding the set bits
  explicit Problem(const Dims& d) : Dims(d) {}
};

// The bounding box of every element mask (empty masks get r0 >= r1).
static void mask_boxes(Problem& P, int64_t NM) {
  P.boxes.assign(NM * 4, 0);
  at::parallel_for(0, NM, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t x = lo; x < hi; ++x) {
      int64_t r0 = P.bq, r1 = 0, c0 = P.bk, c1 = 0;
      for (int64_t r = 0; r < P.bq; ++r) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(P.masks + (x * P.bq + r) * P.W);
        for (int64_t w = 0; w < P.W; ++w) {
          const uint32_t v = row[w];
          if (!v) continue;
          r0 = std::min(r0, r);
          r1 = r + 1;
          c0 = std::min<int64_t>(c0, w * 32 + __builtin_ctz(v));
          c1 = std::max<int64_t>(c1, w * 32 + 32 - __builtin_clz(v));
        }
      }
      int32_t* b = P.boxes.data() + x * 4;
      b[0] = static_cast<int32_t>(r0);
      b[1] = static_cast<int32_t>(r1);
      b[2] = static_cast<int32_t>(c0);
      b[3] = static_cast<int32_t>(c1);
    }
  });
}

// equal parts of at most `cap` (a multiple of 16 when split): (part size, number of parts)
static std::pair<int64_t, int64_t> split(int64_t n, int64_t cap) {
  if (n <= cap) return {n, 1};
  const int64_t size = round_up(cdiv(n, cdiv(n, cap)), 16);
  return {size, cdiv(n, size)};
}

// The problem of operands of sizes d (check_qkv's).
static Problem make_problem(const Dims& d, int64_t bq, int64_t bk, int64_t slb, int64_t slh,
                            std::optional<int64_t> causal_offset, double sm_scale, const at::Tensor& masks) {
  Problem P(d);
  TORCH_CHECK(bq > 0 && bk > 0, "sparse_io_attn cpu: block sizes must be positive");
  P.G = P.Hq / P.Hkv;
  P.bq = bq;
  P.bk = bk;
  P.nqb = cdiv(P.Nq, bq);
  P.nkb = cdiv(P.Nk, bk);
  P.W = cdiv(bk, 32);
  P.WT = cdiv(bq, 32);
  P.slb = slb;
  P.slh = slh;
  P.causal = causal_offset.has_value();
  P.delta = causal_offset.value_or(0);
  P.sm_scale = static_cast<float>(sm_scale);
  P.c2 = static_cast<float>(sm_scale * LOG2E);
  std::tie(P.BM, P.nsubq) = split(bq, MAX_BM);
  P.BMv = round_up(P.BM, VL);
  P.BN = split(bk, MAX_BN).first;
  P.gcols = std::max(GROUP_COLS, round_up(P.BN, VL));
  P.lds_f = P.gcols + 16;  // + 16: rows not a multiple of 4 KiB apart
  std::tie(P.BNK, P.nsubk) = split(bk, MAX_BNK);
  P.lds_b = P.BMv + 16;
  TORCH_CHECK(masks.scalar_type() == at::kInt && masks.is_contiguous() && masks.dim() == 3 &&
                  masks.size(1) == bq && masks.size(2) == P.W,
              "sparse_io_attn cpu: masks must be contiguous int32 [num_masks, BLOCK_SIZE_Q, ceil(BLOCK_SIZE_KV/32)]");
  P.masks = masks.data_ptr<int32_t>();
  P.NM = masks.size(0);
  mask_boxes(P, masks.size(0));
  return P;
}

// One order of the schedule (rows: CSR over query blocks; otherwise CSC over key blocks), checked
// against the problem before any work, in O(number of entries) once per call, so that a corrupted
// schedule raises instead of reading out of bounds: ptr tensors [NL, outer + 1] whose offsets are
// non-decreasing inside [0, entries], NL covering every (batch, head) layout id, block indices in
// [0, inner), element-mask ids in [-1, number of masks).
static Lists lists_of(const Problem& P, bool rows, const at::Tensor& full_ptr, const at::Tensor& full_idx,
                      const at::Tensor& part_ptr, const at::Tensor& part_idx, const at::Tensor& part_mask) {
  for (const at::Tensor* t : {&full_ptr, &full_idx, &part_ptr, &part_idx, &part_mask}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "sparse_io_attn cpu: schedule tensors must be contiguous int32 CPU tensors");
  }
  const char* order = rows ? "row (CSR)" : "column (CSC)";
  const int64_t outer = rows ? P.nqb : P.nkb, inner = rows ? P.nkb : P.nqb;
  TORCH_CHECK(P.slb >= 0 && P.slh >= 0, "sparse_io_attn cpu: layout strides must be >= 0, got ", P.slb, ", ",
              P.slh);
  const int64_t nl = full_ptr.numel() / (outer + 1);
  TORCH_CHECK(full_ptr.numel() == nl * (outer + 1) && part_ptr.numel() == full_ptr.numel(),
              "sparse_io_attn cpu: ", order, " pointers must be [num_layouts, ", outer + 1, "], got ",
              full_ptr.numel(), " and ", part_ptr.numel(), " entries");
  const int64_t lid_max = P.B * P.Hq > 0 ? (P.B - 1) * P.slb + (P.Hq - 1) * P.slh : -1;
  TORCH_CHECK(lid_max < nl, "sparse_io_attn cpu: layout strides (", P.slb, ", ", P.slh, ") reach layout ",
              lid_max, " but the ", order, " pointers hold ", nl, " layouts");
  TORCH_CHECK(part_mask.numel() == part_idx.numel(), "sparse_io_attn cpu: ", part_idx.numel(),
              " partial ", order, " entries but ", part_mask.numel(), " mask ids");
  auto check_ptr = [&](const at::Tensor& ptr, const at::Tensor& idx, const char* kind) {
    const int32_t* p = ptr.data_ptr<int32_t>();
    const int64_t n = idx.numel();
    for (int64_t l = 0; l < nl; ++l) {
      const int32_t* row = p + l * (outer + 1);
      TORCH_CHECK(row[0] >= 0 && row[outer] <= n, "sparse_io_attn cpu: ", kind, " ", order,
                  " pointers of layout ", l, " span [", row[0], ", ", row[outer], "], expected inside [0, ", n,
                  "]");
      for (int64_t i = 0; i < outer; ++i)
        TORCH_CHECK(row[i] <= row[i + 1], "sparse_io_attn cpu: ", kind, " ", order, " pointers of layout ", l,
                    " decrease at ", i, " (", row[i], " > ", row[i + 1], ")");
    }
    const int32_t* x = idx.data_ptr<int32_t>();
    for (int64_t e = 0; e < n; ++e)
      TORCH_CHECK(x[e] >= 0 && x[e] < inner, "sparse_io_attn cpu: ", kind, " ", order, " entry ", e,
                  " has block index ", x[e], ", expected in [0, ", inner, ")");
  };
  check_ptr(full_ptr, full_idx, "full");
  check_ptr(part_ptr, part_idx, "partial");
  const int32_t* mid = part_mask.data_ptr<int32_t>();
  for (int64_t e = 0; e < part_mask.numel(); ++e)
    TORCH_CHECK(mid[e] >= -1 && mid[e] < P.NM, "sparse_io_attn cpu: partial ", order, " entry ", e,
                " has mask id ", mid[e], ", expected in [-1, ", P.NM, ")");
  return Lists{full_ptr.data_ptr<int32_t>(), full_idx.data_ptr<int32_t>(), part_ptr.data_ptr<int32_t>(),
               part_idx.data_ptr<int32_t>(), part_mask.data_ptr<int32_t>()};
}

}  // namespace sia
