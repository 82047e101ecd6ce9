// Fused CPU kernels for hyper-connections (phaseloop.kernels builds this on first use).
//
// The stream maths of a hyper-connection is a tiny matrix product per token
// (an [r, c] coefficient matrix times [c, D] rows) and a Sinkhorn projection of an
// [n, n] matrix per token. Written with torch ops each costs several passes over
// [tokens, n, D] (or ~200 kernel launches for 20 Sinkhorn iterations); here each is one
// pass with every token's rows in L1 -- the CPU counterpart of the fused kernels of
// mHC (Xie et al., arXiv 2512.24880, section 4.3), which also recompute the Sinkhorn
// iterations in the backward instead of storing them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// grain: tokens per parallel task, about 64K multiply-adds each
int64_t grain(int64_t work_per_token) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, work_per_token)); }

// out[t] = A[t] @ Z[t], Z[t] = [Y[t] (m rows); F[t] (one row, when given)].
// A [N, r, c] with c = m (+1 with F), Y [N, m, D], F [N, D]; out [N, r, D].
template <typename T>
void rows_fwd(const T* A, const T* Y, const T* F, T* O, int64_t N, int64_t r, int64_t m,
              int64_t D) {
  const int64_t c = m + (F ? 1 : 0);
  at::parallel_for(0, N, grain(r * c * D), [&](int64_t s, int64_t e) {
    for (int64_t t = s; t < e; ++t) {
      const T* a = A + t * r * c;
      const T* y = Y + t * m * D;
      const T* f = F ? F + t * D : nullptr;
      T* o = O + t * r * D;
      for (int64_t i = 0; i < r; ++i) {
        T* oi = o + i * D;
        const T* ai = a + i * c;
        const T a0 = ai[0];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) oi[d] = a0 * y[d];
        for (int64_t j = 1; j < c; ++j) {
          const T aj = ai[j];
          const T* zj = j < m ? y + j * D : f;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) oi[d] += aj * zj[d];
        }
      }
    }
  });
}

// Backward of rows_fwd: dA[t, i, j] = <G[t, i], Z[t, j]>, dZ[t, j] = sum_i A[t, i, j] G[t, i].
// Per (token, j) one pass over D in chunks of V lanes: R dot-product accumulators and the
// dZ row stay in registers. R is a template constant (1..8); larger R takes the loop form.
// The first `acc_rows` rows of dZ (the Y rows when accumulating) are added to, not overwritten.
constexpr int64_t V = 8;

template <typename T, int64_t R>
void rows_bwd_token(const T* a, const T* g, const T* const* z, T* const* dz, T* da, int64_t c,
                    int64_t D, int64_t acc_rows) {
  for (int64_t j = 0; j < c; ++j) {
    const T* __restrict__ zj = z[j];
    T* __restrict__ dzj = dz[j];
    const bool add = j < acc_rows;  // (never 0 * an uninitialised value)
    T aj[R];
    for (int64_t i = 0; i < R; ++i) aj[i] = a[i * c + j];
    T acc[R][V] = {};
    int64_t d0 = 0;
    for (; d0 + V <= D; d0 += V) {
      T out[V] = {};
      for (int64_t i = 0; i < R; ++i) {
#pragma omp simd
        for (int64_t v = 0; v < V; ++v) {
          const T gv = g[i * D + d0 + v];
          out[v] += aj[i] * gv;
          acc[i][v] += gv * zj[d0 + v];
        }
      }
#pragma omp simd
      for (int64_t v = 0; v < V; ++v) dzj[d0 + v] = (add ? dzj[d0 + v] : T(0)) + out[v];
    }
    for (; d0 < D; ++d0) {
      T o = 0;
      for (int64_t i = 0; i < R; ++i) {
        o += aj[i] * g[i * D + d0];
        acc[i][0] += g[i * D + d0] * zj[d0];
      }
      dzj[d0] = (add ? dzj[d0] : T(0)) + o;
    }
    for (int64_t i = 0; i < R; ++i) {
      T sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += acc[i][v];
      da[i * c + j] = sum;
    }
  }
}

template <typename T>
void rows_bwd_token_any(const T* a, const T* g, const T* const* z, T* const* dz, T* da,
                        int64_t r, int64_t c, int64_t D, int64_t acc_rows) {
  for (int64_t j = 0; j < c; ++j) {
    if (j >= acc_rows)
      for (int64_t d = 0; d < D; ++d) dz[j][d] = 0;
    for (int64_t i = 0; i < r; ++i) {
      const T aij = a[i * c + j];
      T acc = 0;
      for (int64_t d = 0; d < D; ++d) {
        acc += g[i * D + d] * z[j][d];
        dz[j][d] += aij * g[i * D + d];
      }
      da[i * c + j] = acc;
    }
  }
}

template <typename T>
void rows_bwd(const T* A, const T* Y, const T* F, const T* G, T* dA, T* dY, T* dF, int64_t N,
              int64_t r, int64_t m, int64_t D, bool accumulate) {
  const int64_t acc_rows = accumulate ? m : 0;
  const int64_t c = m + (F ? 1 : 0);
  at::parallel_for(0, N, grain(2 * r * c * D), [&](int64_t s, int64_t e) {
    std::vector<const T*> z(c);
    std::vector<T*> dz(c);
    for (int64_t t = s; t < e; ++t) {
      for (int64_t j = 0; j < c; ++j) {
        z[j] = j < m ? Y + (t * m + j) * D : F + t * D;
        dz[j] = j < m ? dY + (t * m + j) * D : dF + t * D;
      }
      const T* a = A + t * r * c;
      const T* g = G + t * r * D;
      T* da = dA + t * r * c;
      switch (r) {
#define PL_CASE(R) \
  case R:          \
    rows_bwd_token<T, R>(a, g, z.data(), dz.data(), da, c, D, acc_rows); \
    break;
        PL_CASE(1) PL_CASE(2) PL_CASE(3) PL_CASE(4) PL_CASE(5) PL_CASE(6) PL_CASE(7) PL_CASE(8)
#undef PL_CASE
        default:
          rows_bwd_token_any<T>(a, g, z.data(), dz.data(), da, r, c, D, acc_rows);
      }
    }
  });
}

// Sinkhorn-Knopp, vectorised over blocks of TB tokens (layout [state][entry][token]):
// P_0 = exp(L - max L), then `iters` times normalise rows, then columns. With `keep`
// every state and reciprocal sum is kept for the backward, else two states ping-pong.
constexpr int64_t TB = 8;

template <typename T, int64_t NC>
void sinkhorn_block(const T* L, int64_t nt, int64_t n_rt, int64_t iters, T* st, T* inv, bool keep) {
  const int64_t n = NC > 0 ? NC : n_rt, nn = n * n;
  T mx[TB];
  for (int64_t b = 0; b < TB; ++b) mx[b] = b < nt ? L[b * nn] : T(0);
  for (int64_t k = 0; k < nn; ++k)
    for (int64_t b = 0; b < TB; ++b) {
      const T v = b < nt ? L[b * nn + k] : T(0);
      st[k * TB + b] = v;
      mx[b] = std::max(mx[b], v);
    }
  for (int64_t k = 0; k < nn; ++k)
    for (int64_t b = 0; b < TB; ++b) st[k * TB + b] = std::exp(st[k * TB + b] - mx[b]);
  for (int64_t it = 0; it < iters; ++it) {
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t h = 2 * it + half;
      const T* __restrict__ P = st + (keep ? h : h % 2) * nn * TB;
      T* __restrict__ Q = st + (keep ? h + 1 : (h + 1) % 2) * nn * TB;
      T* __restrict__ w = inv + (keep ? h : 0) * n * TB;
      const int64_t sa = half == 0 ? n : 1, sk = half == 0 ? 1 : n;  // entry (a, k): a*sa + k*sk
      for (int64_t a = 0; a < n; ++a) {
        T s[TB];
#pragma omp simd
        for (int64_t b = 0; b < TB; ++b) s[b] = P[(a * sa) * TB + b];
        for (int64_t k = 1; k < n; ++k)
#pragma omp simd
          for (int64_t b = 0; b < TB; ++b) s[b] += P[(a * sa + k * sk) * TB + b];
#pragma omp simd
        for (int64_t b = 0; b < TB; ++b) {
          s[b] = T(1) / s[b];
          w[a * TB + b] = s[b];
        }
        for (int64_t k = 0; k < n; ++k) {
          const int64_t el = (a * sa + k * sk) * TB;
#pragma omp simd
          for (int64_t b = 0; b < TB; ++b) Q[el + b] = P[el + b] * s[b];
        }
      }
    }
  }
}
template <typename T, int64_t NC>
void sinkhorn_fwd(const T* L, T* P, int64_t N, int64_t n_rt, int64_t iters) {
  const int64_t n = NC > 0 ? NC : n_rt, nn = n * n;
  const int64_t blocks = (N + TB - 1) / TB;
  at::parallel_for(0, blocks, grain(4 * iters * nn * TB), [&](int64_t s, int64_t e) {
    std::vector<T> st(2 * nn * TB), inv(n * TB);
    for (int64_t blk = s; blk < e; ++blk) {
      const int64_t t0 = blk * TB, nt = std::min(TB, N - t0);
      sinkhorn_block<T, NC>(L + t0 * nn, nt, n, iters, st.data(), inv.data(), false);
      for (int64_t b = 0; b < nt; ++b)
        for (int64_t k = 0; k < nn; ++k) P[(t0 + b) * nn + k] = st[k * TB + b];
    }
  });
}

// Backward through the unrolled iterations, recomputing the forward per block: for
// P' = P / s with s the row (column) sums, dP = (g - sum(g * P' over the row (column))) / s;
// finally dL = g * P_0 (the max shift has no net effect).
template <typename T, int64_t NC>
void sinkhorn_bwd(const T* L, const T* G, T* dL, int64_t N, int64_t n_rt, int64_t iters) {
  const int64_t n = NC > 0 ? NC : n_rt, nn = n * n;
  const int64_t blocks = (N + TB - 1) / TB;
  at::parallel_for(0, blocks, grain(8 * iters * nn * TB), [&](int64_t s, int64_t e) {
    std::vector<T> st((2 * iters + 1) * nn * TB), inv(2 * iters * n * TB), g(nn * TB);
    for (int64_t blk = s; blk < e; ++blk) {
      const int64_t t0 = blk * TB, nt = std::min(TB, N - t0);
      sinkhorn_block<T, NC>(L + t0 * nn, nt, n, iters, st.data(), inv.data(), true);
      for (int64_t k = 0; k < nn; ++k)
        for (int64_t b = 0; b < TB; ++b) g[k * TB + b] = b < nt ? G[(t0 + b) * nn + k] : T(0);
      for (int64_t h = 2 * iters - 1; h >= 0; --h) {
        const T* __restrict__ Q = st.data() + (h + 1) * nn * TB;
        const T* __restrict__ w = inv.data() + h * n * TB;
        T* __restrict__ gg = g.data();
        const int64_t sa = h % 2 == 0 ? n : 1, sk = h % 2 == 0 ? 1 : n;  // entry (a, k) at a*sa + k*sk
        for (int64_t a = 0; a < n; ++a) {
          T dot[TB];
#pragma omp simd
          for (int64_t b = 0; b < TB; ++b) dot[b] = gg[(a * sa) * TB + b] * Q[(a * sa) * TB + b];
          for (int64_t k = 1; k < n; ++k) {
            const int64_t el = (a * sa + k * sk) * TB;
#pragma omp simd
            for (int64_t b = 0; b < TB; ++b) dot[b] += gg[el + b] * Q[el + b];
          }
          for (int64_t k = 0; k < n; ++k) {
            const int64_t el = (a * sa + k * sk) * TB;
#pragma omp simd
            for (int64_t b = 0; b < TB; ++b) gg[el + b] = (gg[el + b] - dot[b]) * w[a * TB + b];
          }
        }
      }
      for (int64_t b = 0; b < nt; ++b)
        for (int64_t k = 0; k < nn; ++k) dL[(t0 + b) * nn + k] = g[k * TB + b] * st[k * TB + b];
    }
  });
}

void check(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, name,
              " must be float32 or float64");
}

}  // namespace

// A [N, r, c], Y [N, m, D], F [N, D] or None (c = m + 1 or m) -> [N, r, D]
torch::Tensor rows_forward(torch::Tensor A, torch::Tensor Y, c10::optional<torch::Tensor> F) {
  check(A, "A");
  check(Y, "Y");
  const int64_t N = Y.size(0), m = Y.size(1), D = Y.size(2), r = A.size(1);
  TORCH_CHECK(A.size(0) == N && A.size(2) == m + (F ? 1 : 0), "rows_forward: shape mismatch");
  if (F) {
    check(*F, "F");
    TORCH_CHECK(F->size(0) == N && F->size(1) == D, "rows_forward: F shape mismatch");
  }
  auto O = torch::empty({N, r, D}, Y.options());
  AT_DISPATCH_FLOATING_TYPES(Y.scalar_type(), "rows_forward", [&] {
    rows_fwd<scalar_t>(A.data_ptr<scalar_t>(), Y.data_ptr<scalar_t>(),
                       F ? F->data_ptr<scalar_t>() : nullptr, O.data_ptr<scalar_t>(), N, r, m, D);
  });
  return O;
}

// dY_acc: when given, Y's gradient is added into it (in place) and it is returned as dY.
std::vector<torch::Tensor> rows_backward(torch::Tensor A, torch::Tensor Y,
                                         c10::optional<torch::Tensor> F, torch::Tensor G,
                                         c10::optional<torch::Tensor> dY_acc) {
  check(A, "A");
  check(Y, "Y");
  check(G, "G");
  const int64_t N = Y.size(0), m = Y.size(1), D = Y.size(2), r = A.size(1);
  auto dA = torch::empty_like(A);
  if (dY_acc) {
    check(*dY_acc, "dY_acc");
    TORCH_CHECK(dY_acc->sizes() == Y.sizes() && dY_acc->scalar_type() == Y.scalar_type(),
                "rows_backward: dY_acc must match Y");
  }
  auto dY = dY_acc ? *dY_acc : torch::empty_like(Y);
  torch::Tensor dF = F ? torch::empty_like(*F) : torch::Tensor();
  AT_DISPATCH_FLOATING_TYPES(Y.scalar_type(), "rows_backward", [&] {
    rows_bwd<scalar_t>(A.data_ptr<scalar_t>(), Y.data_ptr<scalar_t>(),
                       F ? F->data_ptr<scalar_t>() : nullptr, G.data_ptr<scalar_t>(),
                       dA.data_ptr<scalar_t>(), dY.data_ptr<scalar_t>(),
                       F ? dF.data_ptr<scalar_t>() : nullptr, N, r, m, D, dY_acc.has_value());
  });
  return {dA, dY, dF};
}

// L [N, n, n] -> P [N, n, n]
torch::Tensor sinkhorn_forward(torch::Tensor L, int64_t iters) {
  check(L, "L");
  const int64_t N = L.size(0), n = L.size(1);
  auto P = torch::empty_like(L);
  AT_DISPATCH_FLOATING_TYPES(L.scalar_type(), "sinkhorn_forward", [&] {
    if (n == 4)
      sinkhorn_fwd<scalar_t, 4>(L.data_ptr<scalar_t>(), P.data_ptr<scalar_t>(), N, n, iters);
    else
      sinkhorn_fwd<scalar_t, 0>(L.data_ptr<scalar_t>(), P.data_ptr<scalar_t>(), N, n, iters);
  });
  return P;
}

torch::Tensor sinkhorn_backward(torch::Tensor L, torch::Tensor G, int64_t iters) {
  check(L, "L");
  check(G, "G");
  const int64_t N = L.size(0), n = L.size(1);
  auto dL = torch::empty_like(L);
  AT_DISPATCH_FLOATING_TYPES(L.scalar_type(), "sinkhorn_backward", [&] {
    if (n == 4)
      sinkhorn_bwd<scalar_t, 4>(L.data_ptr<scalar_t>(), G.data_ptr<scalar_t>(),
                                dL.data_ptr<scalar_t>(), N, n, iters);
    else
      sinkhorn_bwd<scalar_t, 0>(L.data_ptr<scalar_t>(), G.data_ptr<scalar_t>(),
                                dL.data_ptr<scalar_t>(), N, n, iters);
  });
  return dL;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("rows_forward", &rows_forward, "A @ [Y; F] per token");
  mod.def("rows_backward", &rows_backward, "backward of rows_forward");
  mod.def("sinkhorn_forward", &sinkhorn_forward, "Sinkhorn-Knopp per token");
  mod.def("sinkhorn_backward", &sinkhorn_backward, "backward of sinkhorn_forward (recomputed)");
}
