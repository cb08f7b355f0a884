// The selection plan's two normalisations in C++ (sparse_io_attn/selection/plan.py holds the torch
// versions, the reference; results are identical element for element):
//
// * selection_rows(indices [L, Nq, K], counts [L, Nq]?, num_kv_blocks, block_size, causal_offset?)
//   -> (rows int32 [L, Nq, K], row_counts int32 [L, Nq]): each row's valid entries (0 <= c < nkb, slot
//   j < counts, not wholly in the causal future c * block_size <= t + delta), each block once,
//   ascending, at the front, -1 after. Per row: the valid entries set bits of a bitmap, the words
//   they touched are scanned in ascending order and cleared; rows whose allowed blocks span many
//   more bitmap words than the row has slots (few picks among very many blocks) are sorted instead
//   (same result).
// * selection_keys(rows [L, Nq, K], num_kv_blocks) -> (col_ptr int32 [L, nkb + 1] absolute offsets,
//   col_query int32 [L*Nq*K], col_slot int32 [L*Nq*K]): the key-major view of normalised rows, a
//   counting sort by (l, c) that keeps the (t, j) order inside each list; the unused capacity after
//   the last list holds the unused slots (t, j) in flat order, as the torch version's stable sort
//   leaves them. Tasks are blocks of ROW_BLOCK tokens of one selection, read twice: a histogram of
//   their key blocks, then (after one prefix sum over (l, c, row block)) the scatter, KEY_RANGE
//   key blocks at a time so that the lists being written stay in cache.
// Large outputs are backed by transparent huge pages when the system grants them on request.
// Part of kernel.cpp's translation unit.
#pragma once

#include "tiles.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace sia {
namespace sel {

constexpr int64_t ROW_BLOCK = 1024;  // query tokens per counting-sort task
constexpr int64_t KEY_RANGE = 512;   // key blocks whose lists a counting-sort task writes at a time

// at::empty, with large buffers backed by transparent huge pages where the system allows them on
// request (first touch of a fresh 100 MB output costs more in 4 KiB page faults than the work)
static at::Tensor empty_huge(at::IntArrayRef sizes, const at::TensorOptions& opt) {
  auto t = at::empty(sizes, opt);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  constexpr uintptr_t HUGE_PAGE = uintptr_t(2) << 20;
  if (bytes >= 4 * HUGE_PAGE) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t a = (p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), e = (p + bytes) & ~(HUGE_PAGE - 1);
    if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);  // advice only: errors ignored
  }
#endif
  return t;
}

template <typename F>
static void dispatch_index(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kInt: f(int32_t{}); break;
    case at::kLong: f(int64_t{}); break;
    default: TORCH_CHECK(false, "sparse_io_attn cpu: indices must be int32 or int64, got ", t);
  }
}

std::tuple<at::Tensor, at::Tensor> selection_rows(const at::Tensor& indices, const std::optional<at::Tensor>& counts,
                                                  int64_t num_kv_blocks, int64_t block_size,
                                                  std::optional<int64_t> causal_offset) {
  TORCH_CHECK(indices.device().is_cpu() && indices.dim() == 3,
              "sparse_io_attn cpu: selection_rows expects CPU indices [L, Nq, K], got ", indices.sizes());
  TORCH_CHECK(num_kv_blocks >= 0 && block_size >= 1, "sparse_io_attn cpu: selection_rows needs num_kv_blocks >= 0 ",
              "and block_size >= 1, got ", num_kv_blocks, " and ", block_size);
  TORCH_CHECK(num_kv_blocks <= std::numeric_limits<int32_t>::max(),
              "sparse_io_attn cpu: num_kv_blocks must fit int32, got ", num_kv_blocks);
  const int64_t L = indices.size(0), Nq = indices.size(1), K = indices.size(2);
  const auto idx = indices.contiguous();
  at::Tensor cnt;
  if (counts.has_value()) {
    TORCH_CHECK(counts->device().is_cpu() && counts->dim() == 2 && counts->size(0) == L && counts->size(1) == Nq,
                "sparse_io_attn cpu: selection_rows expects counts [L, Nq] = [", L, ", ", Nq, "] on the CPU, got ",
                counts->sizes());
    TORCH_CHECK(counts->scalar_type() == at::kInt || counts->scalar_type() == at::kLong,
                "sparse_io_attn cpu: counts must be int32 or int64");
    cnt = counts->to(at::kLong).contiguous();
  }
  auto rows = empty_huge({L, Nq, K}, indices.options().dtype(at::kInt));
  auto row_counts = at::empty({L, Nq}, indices.options().dtype(at::kInt));
  if (L * Nq == 0) return {rows, row_counts};
  const int64_t* cp = cnt.defined() ? cnt.data_ptr<int64_t>() : nullptr;
  int32_t* out = rows.data_ptr<int32_t>();
  int32_t* oc = row_counts.data_ptr<int32_t>();
  const bool causal = causal_offset.has_value();
  const int64_t delta = causal_offset.value_or(0), nkb = num_kv_blocks;
  dispatch_index(idx.scalar_type(), [&](auto tag) {
    using index_t = decltype(tag);
    const index_t* src = idx.data_ptr<index_t>();
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(K, 1));
    at::parallel_for(0, L * Nq, grain, [&](int64_t lo, int64_t hi) {
      // the bitmap serves rows whose allowed blocks span at most 4 K + 16 words (others are sorted):
      // its size depends on K, never on the number of key blocks
      std::vector<uint64_t> bits(static_cast<size_t>(std::min(cdiv(std::max<int64_t>(nkb, 1), 64), 4 * K + 16)), 0);
      std::vector<int32_t> vals(static_cast<size_t>(K));
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t t = r % Nq;
        int64_t n = K;
        if (cp != nullptr) n = std::max<int64_t>(0, std::min<int64_t>(K, cp[r]));
        int64_t lim = nkb;  // valid blocks [0, lim)
        if (causal) {
          const int64_t last = t + delta;  // last allowed key
          lim = last < 0 ? 0 : std::min<int64_t>(nkb, last / block_size + 1);
        }
        const index_t* row = src + r * K;
        int32_t* o = out + r * K;
        int64_t m = 0;
        if (cdiv(lim, 64) <= 4 * K + 16) {  // few words: set bits, scan the touched words in order
          int64_t w0 = lim, w1 = -1;
          for (int64_t j = 0; j < n; ++j) {
            const int64_t c = static_cast<int64_t>(row[j]);
            if (static_cast<uint64_t>(c) >= static_cast<uint64_t>(lim)) continue;  // negative or past lim
            bits[c >> 6] |= uint64_t(1) << (c & 63);
            w0 = std::min(w0, c >> 6);
            w1 = std::max(w1, c >> 6);
          }
          for (int64_t w = w0; w <= w1; ++w) {
            uint64_t x = bits[w];
            bits[w] = 0;
            while (x) {
              o[m++] = static_cast<int32_t>(w * 64 + __builtin_ctzll(x));
              x &= x - 1;
            }
          }
        } else {  // blocks spread over many words: sort and drop repeats
          int64_t nv = 0;
          for (int64_t j = 0; j < n; ++j) {
            const int64_t c = static_cast<int64_t>(row[j]);
            if (static_cast<uint64_t>(c) < static_cast<uint64_t>(lim)) vals[nv++] = static_cast<int32_t>(c);
          }
          std::sort(vals.begin(), vals.begin() + nv);
          for (int64_t j = 0; j < nv; ++j)
            if (m == 0 || vals[j] != o[m - 1]) o[m++] = vals[j];
        }
        for (int64_t j = m; j < K; ++j) o[j] = -1;
        oc[r] = static_cast<int32_t>(m);
      }
    });
  });
  return {rows, row_counts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> selection_keys(const at::Tensor& rows_in, int64_t num_kv_blocks) {
  TORCH_CHECK(rows_in.device().is_cpu() && rows_in.dim() == 3 && rows_in.scalar_type() == at::kInt,
              "sparse_io_attn cpu: selection_keys expects CPU int32 rows [L, Nq, K], got ", rows_in.scalar_type(), " ",
              rows_in.sizes());
  TORCH_CHECK(num_kv_blocks >= 0, "sparse_io_attn cpu: num_kv_blocks must be >= 0");
  const auto rows = rows_in.contiguous();
  const int64_t L = rows.size(0), Nq = rows.size(1), K = rows.size(2), nkb = num_kv_blocks;
  const int64_t n = L * Nq * K;
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), "sparse_io_attn cpu: selection: at most ",
              std::numeric_limits<int32_t>::max(), " stored blocks fit int32 indices, got ", n, "; use larger blocks");
  auto opt = rows.options();
  auto col_ptr = at::empty({L, nkb + 1}, opt);
  auto col_query = empty_huge({n}, opt);
  auto col_slot = empty_huge({n}, opt);
  int32_t* ptr = col_ptr.data_ptr<int32_t>();
  if (L == 0) return {col_ptr, col_query, col_slot};
  const int32_t* rp = rows.data_ptr<int32_t>();
  int32_t* cq = col_query.data_ptr<int32_t>();
  int32_t* cs = col_slot.data_ptr<int32_t>();
  // Row blocks: TB tokens of one selection. Pass 1 checks each row (blocks strictly ascending in
  // [0, nkb), then -1 only), records its length and counts the block's entries per key block:
  // hist[x * nkb + c]; after one prefix sum over (l, c, row block) it holds where block x's entries
  // of c go. Pass 2 writes them, one range of KEY_RANGE key blocks at a time (a cursor per row), so
  // that the lists being written stay in cache.
  const int64_t TB = ROW_BLOCK, nbl = cdiv(Nq, TB), NX = L * nbl;
  std::vector<int32_t> cnt(static_cast<size_t>(L * Nq));
  std::vector<int64_t> hist(static_cast<size_t>(NX * nkb), 0);
  std::atomic<int64_t> bad{-1};
  const int64_t grain = std::max<int64_t>(1, cdiv(int64_t(1) << 16, TB * std::max<int64_t>(K, 1)));
  at::parallel_for(0, NX, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t x = lo; x < hi; ++x) {
      const int64_t l = x / nbl, t0 = (x % nbl) * TB, t1 = std::min(Nq, t0 + TB);
      int64_t* h = hist.data() + x * nkb;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = l * Nq + t;
        const int32_t* row = rp + r * K;
        int64_t m = 0;
        int32_t prev = -1;
        for (; m < K && row[m] >= 0; ++m) {
          if (row[m] <= prev || row[m] >= nkb) break;
          prev = row[m];
          ++h[prev];
        }
        bool ok = m == K || row[m] == -1;
        for (int64_t j = m + 1; j < K && ok; ++j) ok = row[j] == -1;
        cnt[r] = static_cast<int32_t>(m);
        if (!ok) {
          int64_t expect = -1;
          bad.compare_exchange_strong(expect, r);
        }
      }
    }
  });
  TORCH_CHECK(bad.load() < 0, "sparse_io_attn cpu: selection_keys expects normalised rows (valid blocks in [0, ",
              nkb, ") strictly ascending at the front, -1 after); row ", bad.load(), " is not");
  int64_t total = 0;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t c = 0; c < nkb; ++c) {
      ptr[l * (nkb + 1) + c] = static_cast<int32_t>(total);
      for (int64_t xb = 0; xb < nbl; ++xb) {
        int64_t& h = hist[(l * nbl + xb) * nkb + c];
        const int64_t s = h;
        h = total;
        total += s;
      }
    }
    ptr[l * (nkb + 1) + nkb] = static_cast<int32_t>(total);
  }
  at::parallel_for(0, NX, grain, [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> pos(static_cast<size_t>(TB));
    for (int64_t x = lo; x < hi; ++x) {
      const int64_t l = x / nbl, t0 = (x % nbl) * TB, t1 = std::min(Nq, t0 + TB);
      int64_t* head = hist.data() + x * nkb;
      std::fill(pos.begin(), pos.end(), 0);
      for (int64_t c_hi = KEY_RANGE; c_hi < nkb + KEY_RANGE; c_hi += KEY_RANGE) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t r = l * Nq + t, m = cnt[r];
          const int32_t* row = rp + r * K;
          int64_t j = pos[t - t0];
          for (; j < m && row[j] < c_hi; ++j) {
            const int64_t e = head[row[j]]++;
            cq[e] = static_cast<int32_t>(t);
            cs[e] = static_cast<int32_t>(j);
          }
          pos[t - t0] = static_cast<int32_t>(j);
        }
      }
    }
  });
  // unused capacity: the slots j >= count of every row, in flat order
  const int64_t CH = 4096, nch = cdiv(L * Nq, CH);
  std::vector<int64_t> start(static_cast<size_t>(nch + 1), 0);
  for (int64_t x = 0; x < nch; ++x) {
    int64_t s = 0;
    for (int64_t r = x * CH; r < std::min(L * Nq, (x + 1) * CH); ++r) s += K - cnt[r];
    start[x + 1] = start[x] + s;
  }
  at::parallel_for(0, nch, std::max<int64_t>(1, cdiv(int64_t(1) << 16, CH * std::max<int64_t>(K, 1))),
                   [&](int64_t lo, int64_t hi) {
    for (int64_t x = lo; x < hi; ++x) {
      int64_t e = total + start[x];
      for (int64_t r = x * CH; r < std::min(L * Nq, (x + 1) * CH); ++r)
        for (int64_t j = cnt[r]; j < K; ++j) {
          cq[e] = static_cast<int32_t>(r % Nq);
          cs[e] = static_cast<int32_t>(j);
          ++e;
        }
    }
  });
  return {col_ptr, col_query, col_slot};
}

// Shapes only (torch.compile traces the ops through these).
std::tuple<at::Tensor, at::Tensor> selection_rows_meta(const at::Tensor& indices, const std::optional<at::Tensor>&,
                                                       int64_t, int64_t, std::optional<int64_t>) {
  auto opt = indices.options().dtype(at::kInt);
  return {at::empty({indices.size(0), indices.size(1), indices.size(2)}, opt),
          at::empty({indices.size(0), indices.size(1)}, opt)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> selection_keys_meta(const at::Tensor& rows, int64_t num_kv_blocks) {
  auto opt = rows.options().dtype(at::kInt);
  const int64_t n = rows.size(0) * rows.size(1) * rows.size(2);
  return {at::empty({rows.size(0), num_kv_blocks + 1}, opt), at::empty({n}, opt), at::empty({n}, opt)};
}

}  // namespace sel
}  // namespace sia
