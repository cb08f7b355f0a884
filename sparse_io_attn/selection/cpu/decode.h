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

struct DecodePlan {
  std::vector<DecodeUnit> units;
  std::vector<int64_t> pre, task0, part0;
  int64_t tasks = 0, partial_floats = 0, max_keys = 0;
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
    u.splits = u.items == 0 ? 1 : dec::num_splits(u.keys, u.items, U);
    dp.task0.push_back(dp.tasks);
    dp.part0.push_back(dp.partial_floats);
    dp.tasks += u.splits;
    dp.partial_floats += u.splits * P.R * (P.D + 2);
  }
  return dp;
}

template <typename T>
struct DecodeIn {
  dec::Operand<T> q, k, v;
  T* out;
  float *lse, *st_m, *st_l;
};

// Key-major items [lo, hi) of unit u: chunks of consecutive keys of one block.
template <typename T>
static void decode_blocks(const Problem& P, const DecodePlan& dp, const DecodeIn<T>& in, const DecodeUnit& u,
                          const int32_t* row, int64_t lo, int64_t hi, dec::Work& w) {
  const int64_t D = P.D, R = P.R, b = P.unit_b(u.pu), kv = P.unit_kv(u.pu);
  const int64_t* pre = dp.pre.data() + u.pre;
  int64_t e = std::upper_bound(pre, pre + u.count + 1, lo) - pre - 1;
  for (int64_t it = lo; it < hi; ++it) {
    while (pre[e + 1] <= it) ++e;
    const int64_t j0 = (it - pre[e]) * dec::CHUNK;
    const int64_t k0 = row[e] * P.bs + j0, nc = std::min(dec::CHUNK, P.allowed(u.t, row[e]) - j0);
    int64_t ldk, ldv;
    const float* kr = dec::rows_f32(in.k, b, kv, k0, nc, D, w.kv.p, ldk);
    dec::transpose_keys(kr, ldk, nc, D, w.kt.p);
    gemm(R, nc, D, D, dec::CHUNK, dec::LDS, false, w.q.p, w.kt.p, w.s.p);  // S = Q K^T  [R, nc]
    for (int64_t i = 0; i < R; ++i)
      dec::softmax_row(w.s.p + i * dec::LDS, nc, P.c2, w.m[i], w.l[i], w.acc.p + i * D, D, dec::AllBits{});
    const float* vr = dec::rows_f32(in.v, b, kv, k0, nc, D, w.kv.p, ldv);
    gemm(R, D, nc, dec::LDS, ldv, D, true, w.s.p, vr, w.acc.p);  // acc += P V  [R, D]
  }
}

// Query-major items [lo, hi) of unit u: CHUNK keys of the row's key list at a time.
template <typename T, int NC>
static void decode_keys(Kern<NC>, const Problem& P, const DecodeIn<T>& in, const DecodeUnit& u, const int32_t* row,
                        int64_t lo, int64_t hi, dec::Work& w) {
  using Kn = Kern<NC>;
  const int64_t D = P.D, R = P.R, b = P.unit_b(u.pu), kv = P.unit_kv(u.pu);
  const int32_t* keys = row;  // single tokens: the row lists the keys
  if (P.bs > 1) {             // else the keys of the row's blocks, in order
    int32_t* out = w.keys.data();
    int64_t n = 0;
    for (int64_t j = 0; j < u.count; ++j) {
      const int64_t n0 = row[j] * P.bs, na = P.allowed(u.t, row[j]);
      for (int64_t z = 0; z < na; ++z) out[n++] = static_cast<int32_t>(n0 + z);
    }
    keys = out;
  }
  static const int32_t iota[dec::CHUNK] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                           16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
                                           32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
                                           48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};
  static_assert(dec::CHUNK == 64, "iota covers one chunk");
  int32_t pad[DOTS];
  const bool direct_k = in.k.direct(D), direct_v = in.v.direct(D);
  for (int64_t it = lo; it < hi; ++it) {
    const int64_t j0 = it * dec::CHUNK, nc = std::min(dec::CHUNK, u.keys - j0);
    const int32_t* ki = keys + j0;
    const float* kb;
    int64_t ldk;
    const int32_t* kidx;
    if (direct_k) {
      kb = reinterpret_cast<const float*>(in.k.row(b, kv, 0));
      ldk = in.k.sn;
      kidx = ki;
    } else {  // gather the chunk's rows into the fp32 tile
      for (int64_t j = 0; j < nc; ++j) dec::to_f32(in.k.row(b, kv, ki[j]), in.k.sd, D, w.kv.p + j * D);
      kb = w.kv.p;
      ldk = D;
      kidx = iota;
    }
    for (int64_t i = 0; i < R; ++i) {
      float* s = w.s.p + i * dec::LDS;
      for (int64_t z = 0; z < nc; z += DOTS) Kn::dots(w.q.p + i * D, kb, ldk, group16(kidx, z, nc, pad), D, s + z);
      dec::softmax_row(s, nc, P.c2, w.m[i], w.l[i], w.acc.p + i * D, D, dec::AllBits{});
    }
    const float* vb;
    int64_t ldv;
    const int32_t* vidx;
    if (direct_v) {
      vb = reinterpret_cast<const float*>(in.v.row(b, kv, 0));
      ldv = in.v.sn;
      vidx = ki;
    } else {
      for (int64_t j = 0; j < nc; ++j) dec::to_f32(in.v.row(b, kv, ki[j]), in.v.sd, D, w.kv.p + j * D);
      vb = w.kv.p;
      ldv = D;
      vidx = iota;
    }
    for (int64_t i = 0; i < R; ++i) Kn::axpy(w.acc.p + i * D, w.s.p + i * dec::LDS, nc, vb, ldv, vidx, D);
  }
}

// Task (unit, split): its items, its partial; the unit's last task merges the unit's splits in order.
template <typename T, int NC>
static void decode_task(Kern<NC> kern, const Problem& P, const DecodePlan& dp, const DecodeIn<T>& in,
                        float* partials, std::atomic<int64_t>* done, int64_t task, dec::Work& w) {
  const std::pair<int64_t, int64_t> us = dec::task_of(dp.task0, task);
  const int64_t ui = us.first, s = us.second;
  const DecodeUnit& u = dp.units[ui];
  const int64_t D = P.D, R = P.R, b = P.unit_b(u.pu), h0 = P.unit_h0(u.pu);
  const int64_t stride = R * (D + 2);
  for (int64_t i = 0; i < R; ++i) dec::to_f32(in.q.row(b, h0 + i, u.t), in.q.sd, D, w.q.p + i * D);
  w.reset(R, D);
  const int32_t* row = P.rows + (P.unit_l(u.pu) * P.Nq + u.t) * P.K;
  const std::pair<int64_t, int64_t> range = dec::split_items(u.items, u.splits, s);
  if (P.family == KEY_MAJOR) decode_blocks(P, dp, in, u, row, range.first, range.second, w);
  else decode_keys(kern, P, in, u, row, range.first, range.second, w);
  float* slot = partials + dp.part0[ui];
  dec::write_partial(slot + s * stride, w, R, D);
  if (done[ui].fetch_add(1, std::memory_order_acq_rel) + 1 != u.splits) return;
  for (int64_t i = 0; i < R; ++i) {
    const int64_t r = (b * P.Hq + h0 + i) * P.Nq + u.t;
    dec::merge_row(slot, u.splits, stride, R, D, i, w.kv.p, in.out + r * D, in.lse + r, in.st_m + r, in.st_l + r);
  }
}

// The decode forward op: selection_fwd's arguments without the key lists, and its results.
std::tuple<at::Tensor, at::Tensor, at::Tensor> selection_decode_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
    const at::Tensor& row_counts, int64_t block_size, int64_t stride_lb, int64_t heads_per_selection,
    std::optional<int64_t> causal_offset, double sm_scale, int64_t family) {
  check_qkv(q, k, v);
  dec::Tally tally;
  const Problem P = make_problem(q, k, rows, row_counts, std::nullopt, std::nullopt, std::nullopt, block_size,
                                 stride_lb, heads_per_selection, causal_offset, sm_scale, family, false);
  auto out = at::empty({P.B, P.Hq, P.Nq, P.D}, q.options());
  auto f32 = q.options().dtype(at::kFloat);
  auto lse = at::empty({P.B, P.Hq, P.Nq}, f32);
  auto stats = at::empty({2, P.B, P.Hq, P.Nq}, f32);
  if (P.B * P.Hq * P.Nq == 0) return {out, lse, stats};
  TORCH_CHECK(P.D > 0, "sparse_io_attn cpu: head_dim must be positive");
  const DecodePlan dp = decode_plan(P);
  Buf partials(dp.partial_floats);
  tally.add(partials);
  std::vector<std::atomic<int64_t>> done(dp.units.size());
  for (auto& d : done) d.store(0);
  const int64_t nkeys = P.family == QUERY_MAJOR && P.bs > 1 ? dp.max_keys : 0;
  float* st_m = stats.data_ptr<float>();
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const DecodeIn<scalar_t> in{dec::Operand<scalar_t>(q), dec::Operand<scalar_t>(k), dec::Operand<scalar_t>(v),
                                out.data_ptr<scalar_t>(), lse.data_ptr<float>(), st_m, st_m + P.B * P.Hq * P.Nq};
    dispatch_dim(P.D, [&](auto kern) {
      run_tasks(dp.tasks, [&] { return std::make_unique<dec::Work>(P.R, P.D, nkeys, tally); },
                [&](int64_t t, dec::Work& w) { decode_task<scalar_t>(kern, P, dp, in, partials.p, done.data(), t, w); });
    });
  });
  return {out, lse, stats};
}

}  // namespace sel
}  // namespace sia
