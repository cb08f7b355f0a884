// Backend "cpu" of selection_attention: per-query-token selections, forward and deterministic
// backward, and the plan's normalisations (selection_rows, selection_keys).
//
// One translation unit (this file and the headers plan_ops.h, problem.h, dots.h, query_major.h,
// key_major.h, decode.h, with the shared simd.h, tiles.h, entry.h, softmax.h and split_k.h of
// sparse_io_attn/_cpu/), built into the library's one extension by sparse_io_attn/_cpu/build.py and
// registered in the namespace `sparse_io_attn_cpu`.
//
// Math: the block-sparse kernel's (block_sparse/cpu/kernel.cpp): scores in base 2, t = fl(c s) with
// c = sm_scale * log2(e), saturated to the finite fp32 range; stats = (row maximum m of those t, log2
// of the row sum); backward recomputes P = exp2((t - m) - log2 l) with the forward's operations
// (-ffp-contract=off), dS = P (dP - delta), delta = rowsum(dO * O).
//
// The plan (selection/plan.py) gives each selection's normalised rows (blocks ascending, unique,
// causally alive) and the key-major lists (per key block, the tokens that chose it, ascending, with
// their slot). A "unit" is (b, kv head, selection): the query heads of one kv head that share a
// selection (G <= Hkv: the whole GQA group; G = Hq: one head), R rows per token.
//
// Two kernel families (the raw ops' `family`: 0 = by block size, 1 = key-major, 2 = query-major):
// * key-major (block_size >= 16, key_major.h): a task per (b, kv head, key block, fixed-size chunk
//   of its gathered query rows); dense brgemm tiles of up to 64 gathered rows against the block.
//   Forward writes each pair's partial (m, l, O) at its slot (b, h, t, j) and a merge pass combines
//   a row's slots in slot order (ascending block). Backward accumulates dK, dV of the block in the
//   task (chunks of one block summed in chunk order), writes each pair's dQ partial at its slot,
//   and a reduction sums a row's slots in order. Partials are written with streaming stores.
// * query-major (small blocks, query_major.h): forward and dQ per (unit, tile of 64 tokens): each
//   token's selected keys (int32 key numbers: for single tokens the plan's row itself) are scored 16
//   at a time (dots.h: 16 dot products with one fixed reduction tree, so every pass computes
//   bitwise the same scores), the unit's heads as the rows, online softmax in the forward; the tile
//   walks its tokens' lists one range of 1024 keys at a time so a range's K/V rows are reused from
//   cache. dK/dV per (b, kv head, run of 64 keys) over the key lists (the tokens that chose each
//   block), one query head at a time, swept in tiles of 1024 tokens so a tile's q/dO rows are
//   reused by the run's keys: every key's gradient is summed by one task (heads in order, then
//   tokens in list order), no accumulator is shared. Single-token attention
//   (DeepSeek's sparse attention) has no dense tile to exploit: these passes are bound by gathering
//   rows (256 bytes per key per head) and by the FMA rate, not by tile products.
//
// Packed sequences (cu_seqlens, selection/varlen.py): the raw ops' optional `table` gives each block's
// first key and end and each query row's causal offset (problem.h: key0, keys, last_key); without
// it block c is keys [c bs, min((c + 1) bs, Nk)) and the offset is causal_offset. V may have its own
// head dim Dv (outputs, dO and dV have it). The forward folds optional per-head sinks into each row
// and returns the output's rounding residual when asked (softmax.h's RowStore); the backward takes the
// caller's row deltas when given (entry.h's deltas_into).
//
// Deterministic: every output element is produced by exactly one task (or one ordered reduction)
// summing in an order fixed by the plan and the shapes; no atomics on data; which thread runs a
// task does not change what it computes: bitwise identical across runs and thread counts.
// Inputs of any dtype and strides: fp32 with a contiguous head dim is read in place, anything else
// packed once to fp32; results are rounded once to the input dtype.
//
// The raw ops check every input (shapes, dtypes, the plan's rows and key lists: ranges, order,
// consistency) before any work and raise RuntimeError: nothing reads or writes outside its tensors.

#include "decode.h"
#include "key_major.h"
#include "plan_ops.h"

namespace sia {
namespace sel {

static void run_forward(const Problem& P, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        Results& res, const float* sinks2) {
  const Inputs in(q, k, v, P.Nq, P.Nk);
  const int64_t nchunk = cdiv(P.Nq, QM_TOKENS);
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const RowStore<scalar_t> store = row_store<scalar_t>(res, sinks2);
    if (P.family == QUERY_MAJOR) {
      dispatch_dim(P.D, P.Dv, [&](auto kern) {
        run_tasks(qm_tasks(P), [&] { return std::make_unique<QState>(P); },
                  [&](int64_t t, QState& w) { qm_fwd_task<scalar_t>(kern, P, in, store, t, w); });
      });
      return;
    }
    Buf kt(P.B * P.Hkv * P.nkb * P.D * P.bs);
    pack_transposed(k, P.bs, P.nkb, kt.p, P.blk_start, P.blk_end);
    const Chunks C = make_chunks(P, FWD_CHUNK);
    const int64_t nslots = P.B * P.Hq * P.Nq * P.K;
    Buf po(nslots * P.Dv), pm(nslots), pl(nslots);
    const Partials pp{po.p, pm.p, pl.p};
    run_tasks(C.tasks(), [&] { return std::make_unique<KState>(P, false); },
              [&](int64_t t, KState& w) { km_fwd_task(P, in, kt.p, C, pp, t, w); });
    run_tasks(P.B * P.Hq * nchunk, [&] { return std::make_unique<Buf>(P.Dv); },
              [&](int64_t t, Buf& w) { km_merge_task<scalar_t>(P, pp, store, t, w); });
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> selection_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
    const at::Tensor& row_counts, const std::optional<at::Tensor>& col_ptr, const std::optional<at::Tensor>& col_query,
    const std::optional<at::Tensor>& col_slot, int64_t block_size, int64_t stride_lb, int64_t heads_per_selection,
    std::optional<int64_t> causal_offset, double sm_scale, int64_t family, const std::optional<at::Tensor>& sinks,
    bool residual, const std::optional<at::Tensor>& table) {
  const Dims d = check_qkv(q, k, v);
  const bool key_major = family == KEY_MAJOR ||
                         (family == AUTO && rows.dim() == 3 &&
                          key_major_by_default(block_size, d.B, d.Hq, d.Nq, rows.size(2), d.D));
  const Problem P = make_problem(d, rows, row_counts, col_ptr, col_query, col_slot, table, block_size, stride_lb,
                                 heads_per_selection, causal_offset, sm_scale, family, key_major);
  const float* sinks2 = sinks_of(sinks, P.Hq);
  Results res = forward_results(q, v, residual);
  if (P.B * P.Hq * P.Nq == 0) return res.tuple();
  TORCH_CHECK(P.D > 0, "sparse_io_attn cpu: head_dim must be positive");
  run_forward(P, q, k, v, res, sinks2);
  return res.tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> selection_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& stats, const at::Tensor& rows, const at::Tensor& row_counts, const at::Tensor& col_ptr,
    const at::Tensor& col_query, const at::Tensor& col_slot, int64_t block_size, int64_t stride_lb,
    int64_t heads_per_selection, std::optional<int64_t> causal_offset, double sm_scale, int64_t family,
    const std::optional<at::Tensor>& delta, const std::optional<at::Tensor>& table) {
  const Dims dims = check_qkv(q, k, v);
  check_grad_inputs(q, v, dout, out, stats);
  const Problem P = make_problem(dims, rows, row_counts, col_ptr, col_query, col_slot, table, block_size, stride_lb,
                                 heads_per_selection, causal_offset, sm_scale, family, true);
  const int64_t B = P.B, Hq = P.Hq, Hkv = P.Hkv, Nq = P.Nq, Nk = P.Nk, D = P.D;
  at::Tensor dq, dk, dv;
  std::tie(dq, dk, dv) = grad_results(q, k, v);
  if (B * Hkv * Nk * D == 0) {
    dq.zero_();
    return {dq, dk, dv};
  }
  if (B * Hq * Nq == 0 || P.blk_start != nullptr) {  // a block table need not cover every key: zero first
    dk.zero_();
    dv.zero_();
    if (B * Hq * Nq == 0) return {dq, dk, dv};
  }
  Inputs in(q, k, v, dout, Nq, Nk);
  // row statistics, [row, 4]: m, log2 l from the forward, delta = rowsum(dO * O), 0
  const auto st = stats.contiguous();
  const float* sm = st.data_ptr<float>();
  const float* sl = sm + B * Hq * Nq;
  Buf sbuf(B * Hq * Nq * 4);
  in.st = sbuf.p;
  deltas_into(delta, out, dout, sbuf.p + 2, Nq * 4, 4);
  for (int64_t r = 0; r < B * Hq * Nq; ++r) {
    float* s = sbuf.p + r * 4;
    s[0] = sm[r];
    s[1] = sl[r];
    s[3] = 0.f;
  }
  const int64_t nchunk = cdiv(Nq, QM_TOKENS);
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* dq_p = dq.data_ptr<scalar_t>();
    scalar_t* dk_p = dk.data_ptr<scalar_t>();
    scalar_t* dv_p = dv.data_ptr<scalar_t>();
    if (P.family == QUERY_MAJOR) {
      dispatch_dim(D, P.Dv, [&](auto kern) {
        run_tasks(qm_tasks(P), [&] { return std::make_unique<QState>(P); },
                  [&](int64_t t, QState& w) { qm_dq_task<scalar_t>(kern, P, in, dq_p, t, w); });
        run_tasks(B * Hkv * cdiv(P.nkb, qm_blocks_per_task(P)), [&] { return std::make_unique<KVState>(P); },
                  [&](int64_t t, KVState& w) { qm_dkv_task<scalar_t>(kern, P, in, dk_p, dv_p, t, w); });
      });
      return;
    }
    Buf kt(B * Hkv * P.nkb * D * P.bs), vt(B * Hkv * P.nkb * P.Dv * P.bs);
    pack_transposed(k, P.bs, P.nkb, kt.p, P.blk_start, P.blk_end);
    pack_transposed(v, P.bs, P.nkb, vt.p, P.blk_start, P.blk_end);
    const Chunks C = make_chunks(P, BWD_CHUNK);
    const int64_t nblocks = B * Hkv * P.nkb;
    const bool split = C.tasks() > nblocks;
    Buf dqp(B * Hq * Nq * P.K * D), dkvp(split ? C.tasks() * P.bs * (D + P.Dv) : 1);
    const KBwd kb{kt.p, vt.p, dqp.p, dkvp.p};
    run_tasks(C.tasks(), [&] { return std::make_unique<KState>(P, true); },
              [&](int64_t t, KState& w) { km_bwd_task<scalar_t>(P, in, kb, C, dk_p, dv_p, t, w); });
    if (split)
      run_tasks(nblocks, [&] { return std::make_unique<Buf>(P.bs * std::max(D, P.Dv)); },
                [&](int64_t x, Buf& w) { km_dkv_reduce<scalar_t>(P, kb, C, x, dk_p, dv_p, w); });
    run_tasks(B * Hq * nchunk, [&] { return std::make_unique<Buf>(D); },
              [&](int64_t t, Buf& w) { km_dq_reduce<scalar_t>(P, kb, dq_p, t, w); });
  });
  return {dq, dk, dv};
}

}  // namespace sel
}  // namespace sia


TORCH_LIBRARY_FRAGMENT(sparse_io_attn_cpu, m) {
  m.def("selection_fwd(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor row_counts, Tensor? col_ptr, "
        "Tensor? col_query, Tensor? col_slot, int block_size, int stride_lb, int heads_per_selection, "
        "int? causal_offset, float sm_scale, int family, Tensor? sinks=None, bool residual=False, "
        "Tensor? table=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("selection_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, Tensor rows, "
        "Tensor row_counts, Tensor col_ptr, Tensor col_query, Tensor col_slot, int block_size, int stride_lb, "
        "int heads_per_selection, int? causal_offset, float sm_scale, int family, Tensor? delta=None, "
        "Tensor? table=None) -> (Tensor, Tensor, Tensor)");
  m.def("selection_decode_fwd(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor row_counts, int block_size, "
        "int stride_lb, int heads_per_selection, int? causal_offset, float sm_scale, int family, "
        "Tensor? sinks=None, bool residual=False, Tensor? table=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("selection_rows(Tensor indices, Tensor? counts, int num_kv_blocks, int block_size, int? causal_offset) "
        "-> (Tensor, Tensor)");
  m.def("selection_keys(Tensor rows, int num_kv_blocks) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sparse_io_attn_cpu, CPU, m) {
  m.impl("selection_fwd", &sia::sel::selection_fwd);
  m.impl("selection_bwd", &sia::sel::selection_bwd);
  m.impl("selection_decode_fwd", &sia::sel::selection_decode_fwd);
  m.impl("selection_rows", &sia::sel::selection_rows);
  m.impl("selection_keys", &sia::sel::selection_keys);
}

TORCH_LIBRARY_IMPL(sparse_io_attn_cpu, Meta, m) {
  m.impl("selection_rows", &sia::sel::selection_rows_meta);
  m.impl("selection_keys", &sia::sel::selection_keys_meta);
}
