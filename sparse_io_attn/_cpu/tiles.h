// Work buffers (cache), fp32 row views, task runner, brgemm tile product, dtype dispatch, packing.
// Part of kernel.cpp's single translation unit (see kernel.cpp for the overview).
#pragma once

#include "simd.h"

namespace sia {

// ------------------------------------------------------------------------------ buffers
// Work buffers of 1 MiB and more come from a small process-wide cache: the same sizes recur every
// training step, and fresh large allocations are mmap-ed and page-faulted on every call (several
// percent of a sparse backward). At most CACHE_BYTES are kept; empty_cache() releases them.
constexpr size_t CACHE_MIN_BYTES = size_t(1) << 20;
constexpr size_t CACHE_BYTES = size_t(512) << 20;

class BufferCache {
 public:
  float* get(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i)  // smallest cached block that fits, without wasting half
        if (free_[i].first >= bytes && free_[i].first <= 2 * bytes &&
            (best == free_.size() || free_[i].first < free_[best].first))
          best = i;
      if (best < free_.size()) {
        float* p = free_[best].second;
        cached_ -= free_[best].first;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        return p;
      }
    }
    return static_cast<float*>(std::aligned_alloc(64, bytes));
  }
  void put(float* p, size_t bytes) {
    std::vector<float*> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.emplace_back(bytes, p);
      cached_ += bytes;
      while (cached_ > CACHE_BYTES) {  // oldest first
        cached_ -= free_.front().first;
        drop.push_back(free_.front().second);
        free_.erase(free_.begin());
      }
    }
    for (float* q : drop) std::free(q);
  }
  void clear() {
    std::vector<std::pair<size_t, float*>> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      drop.swap(free_);
      cached_ = 0;
    }
    for (auto& e : drop) std::free(e.second);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<size_t, float*>> free_;
  size_t cached_ = 0;
};

inline BufferCache& buffer_cache() {
  static BufferCache* cache = new BufferCache();  // never destroyed: no exit-order issues
  return *cache;
}

struct Buf {
  float* p = nullptr;
  size_t bytes = 0;
  explicit Buf(int64_t n) : bytes(static_cast<size_t>(round_up(std::max<int64_t>(n, 1) * sizeof(float), 64))) {
    p = bytes >= CACHE_MIN_BYTES ? buffer_cache().get(bytes) : static_cast<float*>(std::aligned_alloc(64, bytes));
    TORCH_CHECK(p != nullptr, "sparse_io_attn cpu: out of memory (", bytes, " bytes)");
  }
  ~Buf() {
    if (bytes >= CACHE_MIN_BYTES) buffer_cache().put(p, bytes);
    else std::free(p);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

inline void empty_cache() { buffer_cache().clear(); }

// A [B, H, rows, D] fp32 operand: rows of D contiguous floats at p + b*sb + h*sh + row*ld.
struct Rows {
  const float* p = nullptr;
  int64_t sb = 0, sh = 0, ld = 0;
  const float* at(int64_t b, int64_t h, int64_t row) const { return p + b * sb + h * sh + row * ld; }
};

// Run `f(task, worker_state)` for task in [0, n) on at::parallel_for's threads.
template <typename MakeState, typename F>
void run_tasks(int64_t n, MakeState&& make_state, F&& f) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) f(t, *state);
    at::native::cpublas::brgemm_release();
  });
}

// C[M, N] (+)= A[M, K] B[K, N], row-major with leading dimensions
static inline void gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add,
                        const float* A, const float* B, float* C) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C);
}

// Run f(scalar_t{}) for the supported input dtypes (float32, bfloat16, float16).
template <typename F>
static void dispatch(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "sparse_io_attn cpu: unsupported dtype ", t, " (float32, bfloat16, float16)");
  }
}

// ------------------------------------------------------------------------------ packing
template <typename T>
static const T* typed(const at::Tensor& x) { return reinterpret_cast<const T*>(x.data_ptr()); }

// x [B, H, N, D] -> fp32 rows (a view when x is fp32 with a contiguous head dim, else a packed copy
// [B, H, NP, D] whose rows N..NP are zero)
static Rows as_rows(const at::Tensor& x, int64_t NP, std::unique_ptr<Buf>& store) {
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), D = x.size(3);
  if (x.scalar_type() == at::kFloat && (x.stride(3) == 1 || D == 1) && x.stride(2) >= D) {
    return Rows{x.data_ptr<float>(), x.stride(0), x.stride(1), x.stride(2)};
  }
  store = std::make_unique<Buf>(B * H * NP * D);
  float* dst = store->p;
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2), s3 = x.stride(3);
  const int64_t chunk = 64, nchunks = cdiv(NP, chunk);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = typed<scalar_t>(x);
    at::parallel_for(0, B * H * nchunks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t bh = t / nchunks, n_lo = (t % nchunks) * chunk, n_hi = std::min(NP, n_lo + chunk);
        const int64_t b = bh / H, h = bh % H;
        for (int64_t n = n_lo; n < n_hi; ++n) {
          float* d = dst + (bh * NP + n) * D;
          if (n >= N) {
            std::memset(d, 0, D * sizeof(float));
            continue;
          }
          const scalar_t* s = src + b * s0 + h * s1 + n * s2;
          for (int64_t k = 0; k < D; ++k) d[k] = static_cast<float>(s[k * s3]);
        }
      }
    });
  });
  return Rows{dst, H * NP * D, NP * D, D};
}

// q, k, v (and a backward's dout) as fp32 rows (as_rows: q and dout padded to NqP rows, k and v to
// NkP), owning the packed copies.
struct OperandRows {
  std::unique_ptr<Buf> store[4];
  Rows Q, K, V, dO;
  OperandRows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t NqP, int64_t NkP)
      : Q(as_rows(q, NqP, store[0])), K(as_rows(k, NkP, store[1])), V(as_rows(v, NkP, store[2])) {}
  OperandRows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout, int64_t NqP,
              int64_t NkP)
      : OperandRows(q, k, v, NqP, NkP) {
    dO = as_rows(dout, NqP, store[3]);
  }
};

// x [B, H, N, D] -> fp32 [B, H, nblk, D, blk]: per block of `blk` rows its transpose (zero padded).
// Block c holds rows [c blk, min((c + 1) blk, N)), or with a block table rows [starts[c], ends[c])
// (at most blk of them, inside [0, N]: the caller checked the table).
static void pack_transposed(const at::Tensor& x, int64_t blk, int64_t nblk, float* dst,
                            const int32_t* starts = nullptr, const int32_t* ends = nullptr) {
  const int64_t B = x.size(0), H = x.size(1), N = x.size(2), D = x.size(3);
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2), s3 = x.stride(3);
  const bool direct = x.scalar_type() == at::kFloat && (s3 == 1 || D == 1) && s2 >= D;
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* src = typed<scalar_t>(x);
    at::parallel_for(0, B * H * nblk, 1, [&](int64_t lo, int64_t hi) {
      std::unique_ptr<Buf> rows;  // fp32 rows of a block when x is not fp32 with a contiguous head dim
      if (!direct) rows = std::make_unique<Buf>(blk * D);
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t bh = t / nblk, c = t % nblk, b = bh / H, h = bh % H;
        float* d = dst + t * D * blk;
        const int64_t n0 = starts != nullptr ? starts[c] : c * blk;
        const int64_t nv = starts != nullptr ? ends[c] - n0 : std::max<int64_t>(0, std::min(blk, N - n0));
        const scalar_t* s = src + b * s0 + h * s1 + n0 * s2;
        const float* fr;
        int64_t ld;
        if (direct) {
          fr = reinterpret_cast<const float*>(s);
          ld = s2;
        } else {
          for (int64_t j = 0; j < nv; ++j)
            for (int64_t k = 0; k < D; ++k) rows->p[j * D + k] = static_cast<float>(s[j * s2 + k * s3]);
          fr = rows->p;
          ld = D;
        }
        if (nv > 0) at::vec::transpose_mxn<float>(fr, ld, d, blk, static_cast<int>(nv), static_cast<int>(D));
        if (nv < blk)
          for (int64_t k = 0; k < D; ++k) std::memset(d + k * blk + nv, 0, (blk - nv) * sizeof(float));
      }
    });
  });
}

// A task's fp32 dK (nk elements), dV (nv) sums into the results in their dtype: dk = sm_scale dK, dv = dV.
template <typename T>
static inline void store_dkv(const float* dK, int64_t nk, const float* dV, int64_t nv, float sm_scale, T* dk, T* dv) {
  for (int64_t i = 0; i < nk; ++i) dk[i] = static_cast<T>(dK[i] * sm_scale);
  for (int64_t i = 0; i < nv; ++i) dv[i] = static_cast<T>(dV[i]);
}

}  // namespace sia
