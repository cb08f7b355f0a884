// Decode forward of selection attention (Nq <= dec::MAX_QUERIES): split-K over each token's selected
// blocks, K/V read in place. Part of kernel.cpp's translation unit; the engine (units, splits, the
// fixed-order merge) is _cpu/split_k.h.
//
// A unit is (b, kv head, selection inside it, token t): the R query heads of the kv head that share
// the selection, at token t, one small matrix of rows that shares every K/V tile. Its keys are the
// row's normalised blocks (ascending), each clipped to the keys t may use (ragged end, causality).
// The scores are formed as the backward of the call's family recomputes them, so P is recomputed
// exactly (large logits included):
// * key-major (blocks of 16 keys and more): an item is a chunk of at most CHUNK consecutive keys of
//   one block; K^T of the chunk in a tile, S = Q K^T and acc += P V by brgemm (as key_major.h);
// * query-major (small blocks, single tokens): the row's keys listed in order (for single tokens the
//   plan's row itself), an item is CHUNK of them; dots.h's 16 products at a time (group16 pads the
//   last group) and its row updates (as query_major.h), on the rows in place (fp32 with a unit head-dim stride) or gathered into a
//   fp32 tile.
// Nothing is read outside the selected blocks, and nothing in the call is proportional to Nk: no key
// lists (make_problem is asked for none), no packed or converted copy of K/V.
#pragma once

#include "query_major.h"
#include "split_k.h"

namespace sia {
namespace sel {

struct DecodeUnit {
  int64_t pu, t;        // Problem unit (b, kv head, selection), token
  int64_t pre;          // key-major: offset of the items-before-entry prefix [count + 1] in DecodePlan::pre
  int64_t count, keys;  // selected blocks, their allowed keys
  int64_t items, splits;
};

struct DecodePlan : dec::Tasks {
  std::vector<DecodeUnit> units;
  std::vector<int64_t> pre;
  int64_t max_keys = 0;
};

static DecodePlan decode_plan(const Problem& P) {
  DecodePlan dp;
  const bool km = P.family == KEY_MAJOR;
  for (int64_t pu = 0; pu < P.units(); ++pu)
    for (int64_t t = 0; t < P.Nq; ++t) {
      const int64_t l = P.unit_l(pu);
      const int32_t* row = P.rows + (l * P.Nq + t) * P.K;
      DecodeUnit u{pu, t, static_cast<int64_t>(dp.pre.size()), P.counts[l * P.Nq + t], 0, 0, 1};
      int64_t items = 0;
      if (km) dp.pre.push_back(0);
      for (int64_t j = 0; j < u.count; ++j) {
        const int64_t n = P.allowed(t, row[j]);
        u.keys += n;
        if (km) {
          items += cdiv(n, dec::CHUNK);
          dp.pre.push_back(items);
        }
      }
      u.items = km ? items : cdiv(u.keys, dec::CHUNK);
      dp.max_keys = std::max(dp.max_keys, u.keys);
      dp.units.push_back(u);
    }
  const int64_t U = static_cast<int64_t>(dp.units.size());
  for (DecodeUnit& u : dp.units) {
    u.splits = dec::num_splits(u.keys, u.items, U);
    dp.add_unit(u.splits, P.R, P.Dv);
  }
  return dp;
}

// Key-major items [lo, hi) of unit u: chunks of consecutive keys of one block.
template <typename T>
static void decode_blocks(const Problem& P, const DecodePlan& dp, const dec::In<T>& in, const DecodeUnit& u,
                          const int32_t* row, int64_t lo, int64_t hi, dec::Work& w) {
  const int64_t D = P.D, Dv = P.Dv, R = P.R, b = P.unit_b(u.pu), kv = P.unit_kv(u.pu);
  const int64_t* pre = dp.pre.data() + u.pre;
  int64_t e = std::upper_bound(pre, pre + u.count + 1, lo) - pre - 1;
  for (int64_t it = lo; it < hi; ++it) {
    while (pre[e + 1] <= it) ++e;
    const int64_t j0 = (it - pre[e]) * dec::CHUNK;
    const int64_t k0 = P.key0(row[e]) + j0, nc = std::min(dec::CHUNK, P.allowed(u.t, row[e]) - j0);
    int64_t ldk, ldv;
    const float* kr = dec::rows_f32(in.k, b, kv, k0, nc, D, w.kv.p, ldk);
    dec::transpose_keys(kr, ldk, nc, D, w.kt.p);
    gemm(R, nc, D, D, dec::CHUNK, dec::LDS, false, w.q.p, w.kt.p, w.s.p);  // S = Q K^T  [R, nc]
    for (int64_t i = 0; i < R; ++i)
      softmax_step(w.s.p + i * dec::LDS, nc, P.c2, w.m[i], w.l[i], w.acc.p + i * Dv, Dv, AllBits{});
    const float* vr = dec::rows_f32(in.v, b, kv, k0, nc, Dv, w.kv.p, ldv);
    gemm(R, Dv, nc, dec::LDS, ldv, Dv, true, w.s.p, vr, w.acc.p);  // acc += P V  [R, Dv]
  }
}

// Rows ki[0..nc) of (b, kv) of a decode operand as dots.h addresses rows (base + idx[j] * ld): the
// operand in place with idx = ki when it is fp32 with a unit head-dim stride, else the rows converted
// into buf (ld D) with idx = 0, 1, ..., nc - 1.
struct Gathered {
  const float* base;
  int64_t ld;
  const int32_t* idx;
};

template <typename T>
static inline Gathered gathered(const dec::Operand<T>& x, int64_t b, int64_t kv, const int32_t* ki, int64_t nc,
                                int64_t D, float* buf) {
  static const int32_t iota[dec::CHUNK] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                           16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
                                           32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
                                           48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};
  static_assert(dec::CHUNK == 64, "iota covers one chunk");
  if (x.direct(D)) return Gathered{reinterpret_cast<const float*>(x.row(b, kv, 0)), x.sn, ki};
  for (int64_t j = 0; j < nc; ++j) dec::to_f32(x.row(b, kv, ki[j]), x.sd, D, buf + j * D);
  return Gathered{buf, D, iota};
}

// Query-major items [lo, hi) of unit u: CHUNK keys of the row's key list at a time.
template <typename T, int NC>
static void decode_keys(Kern<NC>, const Problem& P, const dec::In<T>& in, const DecodeUnit& u, const int32_t* row,
                        int64_t lo, int64_t hi, dec::Work& w) {
  using Kn = Kern<NC>;
  const int64_t D = P.D, Dv = P.Dv, R = P.R, b = P.unit_b(u.pu), kv = P.unit_kv(u.pu);
  const int32_t* keys = row;  // single tokens: the row lists the keys
  if (P.expand_keys()) {      // else the keys of the row's blocks, in order
    int32_t* out = w.keys.data();
    int64_t n = 0;
    for (int64_t j = 0; j < u.count; ++j) {
      const int64_t n0 = P.key0(row[j]), na = P.allowed(u.t, row[j]);
      for (int64_t z = 0; z < na; ++z) out[n++] = static_cast<int32_t>(n0 + z);
    }
    keys = out;
  }
  int32_t pad[DOTS];
  for (int64_t it = lo; it < hi; ++it) {
    const int64_t j0 = it * dec::CHUNK, nc = std::min(dec::CHUNK, u.keys - j0);
    const int32_t* ki = keys + j0;
    const Gathered kr = gathered(in.k, b, kv, ki, nc, D, w.kv.p);
    for (int64_t i = 0; i < R; ++i) {
      float* s = w.s.p + i * dec::LDS;
      for (int64_t z = 0; z < nc; z += DOTS)
        Kn::dots(w.q.p + i * D, kr.base, kr.ld, group16(kr.idx, z, nc, pad), D, s + z);
      softmax_step(s, nc, P.c2, w.m[i], w.l[i], w.acc.p + i * Dv, Dv, AllBits{});
    }
    const Gathered vr = gathered(in.v, b, kv, ki, nc, Dv, w.kv.p);
    for (int64_t i = 0; i < R; ++i) Kn::axpy(w.acc.p + i * Dv, w.s.p + i * dec::LDS, nc, vr.base, vr.ld, vr.idx, Dv);
  }
}

// Task (unit, split): its items, its partial; the unit's last task merges the unit's splits in order.
template <typename T, int NC>
static void decode_task(Kern<NC> kern, const Problem& P, const DecodePlan& dp, const dec::In<T>& in,
                        dec::Partials& pp, int64_t task, dec::Work& w) {
  const auto [ui, s] = dp.of(task);
  const DecodeUnit& u = dp.units[ui];
  const dec::UnitRows rows{P.unit_b(u.pu), P.unit_h0(u.pu), u.t, 1, P.R};
  dec::start_split(in, rows, P.D, P.Dv, w);
  const int32_t* row = P.rows + (P.unit_l(u.pu) * P.Nq + u.t) * P.K;
  const std::pair<int64_t, int64_t> range = dec::split_items(u.items, u.splits, s);
  if (P.family == KEY_MAJOR) decode_blocks(P, dp, in, u, row, range.first, range.second, w);
  else decode_keys(kern, P, in, u, row, range.first, range.second, w);
  dec::finish_split(in, rows, P.Hq, P.Nq, P.Dv, dp, pp, ui, s, u.splits, w);
}

// The decode forward op: selection_fwd's arguments without the key lists, and its results.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> selection_decode_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
    const at::Tensor& row_counts, int64_t block_size, int64_t stride_lb, int64_t heads_per_selection,
    std::optional<int64_t> causal_offset, double sm_scale, int64_t family, const std::optional<at::Tensor>& sinks,
    bool residual, const std::optional<at::Tensor>& table) {
  const Dims d = check_qkv(q, k, v);
  dec::Tally tally;
  const Problem P = make_problem(d, rows, row_counts, std::nullopt, std::nullopt, std::nullopt, table, block_size,
                                 stride_lb, heads_per_selection, causal_offset, sm_scale, family, false);
  const float* sinks2 = sinks_of(sinks, P.Hq);
  Results res = forward_results(q, v, residual);
  if (P.B * P.Hq * P.Nq == 0) return res.tuple();
  TORCH_CHECK(P.D > 0, "sparse_io_attn cpu: head_dim must be positive");
  const DecodePlan dp = decode_plan(P);
  dec::Partials pp(dp, tally);
  const int64_t nkeys = P.family == QUERY_MAJOR && P.expand_keys() ? dp.max_keys : 0;
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const dec::In<scalar_t> in(q, k, v, row_store<scalar_t>(res, sinks2));
    dispatch_dim(P.D, P.Dv, [&](auto kern) {
      run_tasks(dp.tasks, [&] { return std::make_unique<dec::Work>(P.R, P.D, P.Dv, nkeys, tally); },
                [&](int64_t t, dec::Work& w) { decode_task<scalar_t>(kern, P, dp, in, pp, t, w); });
    });
  });
  return res.tuple();
}

}  // namespace sel
}  // namespace sia
