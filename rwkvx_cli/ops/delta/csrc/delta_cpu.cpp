// Gated delta rule (gdn / kda) forward and backward on the CPU: one (batch, head)
// per OpenMP task, the N x N state kept in cache, every inner loop a unit-stride
// loop of the SIMD vectors of csrc/simd.h, over blocks of columns whose
// accumulators fit the register file of the ISA being compiled for.
//
// Layout: q, k, v [B, T, H, N]; A = exp(g) [B, T, H, G] with G = 1 (gdn: one gate
// per head) or G = N (kda: one per key row), computed by the caller; beta
// [B, T, H]; states [B, H, N, N] with row i = key channel, column j = value
// channel (the API's layout). Inside, a state row is padded to NV whole vectors;
// padded lanes stay zero (their v, dy, k, q and A are zero).
//
// The forward runs on the key-major state, where each step is axpys over rows
// with no horizontal sums (forward_head). The backward runs on the value-major
// (transposed) state: column j of S evolves on its own, so the recomputation of
// a step (from w = v - Pᵀk, which the forward saves) is one sweep over the value
// rows, and the reverse scan two, with one horizontal sum per row (step,
// backward_head). The forward writes its snapshots [B, H, n_chunks, N, N] (the
// state before the first step of each chunk) value-major, and the backward
// recomputes each chunk from its snapshot. Threads take (batch, head) pairs
// dynamically, so one slowed by a busy core does not hold the others back.
// Nothing divides by the gate or by β, so gates down to exp(-large) and β = 0
// are exact.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../csrc/simd.h"

namespace {

constexpr int PF = 2;  // steps ahead to prefetch the forward's inputs

using simd::hsum;
using simd::load;
using simd::store;
using simd::Vec;

// Per-thread scratch, kept between calls: a fresh multi-page buffer per call costs
// more in page faults than the work it holds. Zero-filled on request.
template <typename F>
F* scratch(int slot, int64_t n) {
  static thread_local std::vector<F> buffers[3];
  std::vector<F>& b = buffers[slot];
  if ((int64_t)b.size() < n) b.resize(n);
  std::fill(b.begin(), b.begin() + n, F(0));
  return b.data();
}

// Where one (batch, head) finds its rows: step t of an input lives at base + t * step.
struct Strides {
  int64_t x, a, b;  // step strides of the [.., N] inputs, of A / dg, of beta
};

// A row of N values as NV vectors, zero-padded past N, and back (direct when N fills them).
template <typename F, int NV>
inline void load_row(const F* src, int N, typename Vec<F>::type* out) {
  constexpr int L = Vec<F>::L, NP = NV * L;
  if (N == NP) {
    for (int c = 0; c < NV; c++) out[c] = load(src + c * L);
    return;
  }
  F buf[NP] = {};
  for (int i = 0; i < N; i++) buf[i] = src[i];
  for (int c = 0; c < NV; c++) out[c] = load(buf + c * L);
}

template <typename F, int NV>
inline void store_row(F* dst, int N, const typename Vec<F>::type* in) {
  constexpr int L = Vec<F>::L, NP = NV * L;
  if (N == NP) {
    for (int c = 0; c < NV; c++) store(dst + c * L, in[c]);
    return;
  }
  F buf[NP];
  for (int c = 0; c < NV; c++) store(buf + c * L, in[c]);
  for (int i = 0; i < N; i++) dst[i] = buf[i];
}

// Step t's key-indexed vectors: k, q and the gate A (one value broadcast for gdn), zero past N.
template <typename F, int NV>
struct KeyVecs {
  typedef typename Vec<F>::type V;
  V k[NV], q[NV], a[NV];
  KeyVecs(const F* kt, const F* qt, const F* At, int N, int G) {
    load_row<F, NV>(kt, N, k);
    load_row<F, NV>(qt, N, q);
    if (G > 1) {
      load_row<F, NV>(At, N, a);
    } else {
      constexpr int NP = NV * Vec<F>::L;
      F ab[NP] = {};
      for (int i = 0; i < N; i++) ab[i] = At[0];
      load_row<F, NV>(ab, NP, a);
    }
  }
};

// The backward's recomputation of one step on the value-major state (row j = value
// channel j, a vector over the keys), with w = v - m saved by the forward:
//   S'_j = A ⊙ S_j + (β w_j) k
// in blocks of QB column vectors, whose k and A stay in registers.
template <typename F, int NV>
inline void step(const F* __restrict prev, F* __restrict next, const KeyVecs<F, NV>& kv, const F* __restrict w,
                 F beta, int N) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L, NP = NV * L, QB = simd::block(NV, 2, 4);
  for (int c0 = 0; c0 < NV; c0 += QB) {
    V kk[QB], av[QB];
    for (int c = 0; c < QB; c++) kk[c] = kv.k[c0 + c], av[c] = kv.a[c0 + c];
    for (int j = 0; j < N; j++) {
      const F* __restrict p = prev + (int64_t)j * NP + c0 * L;
      F* __restrict out = next + (int64_t)j * NP + c0 * L;
      const F uj = beta * w[j];
      for (int c = 0; c < QB; c++) store(out + c * L, av[c] * load(p + c * L) + uj * kk[c]);
    }
  }
}

// [N, N] <-> the padded working layout [N][NP]: dst[r][c] = src[c][r] when transposing.
template <typename F>
void pad_rows(const F* src, F* dst, int N, int NP, bool transpose) {
  for (int r = 0; r < N; r++)
    for (int c = 0; c < N; c++)
      dst[(int64_t)r * NP + c] = transpose ? src[(int64_t)c * N + r] : src[(int64_t)r * N + c];
}

template <typename F>
void unpad_rows(const F* src, F* dst, int N, int NP, bool transpose) {
  for (int r = 0; r < N; r++)
    for (int c = 0; c < N; c++)
      dst[(int64_t)r * N + c] = transpose ? src[(int64_t)c * NP + r] : src[(int64_t)r * NP + c];
}

// The forward runs on the key-major state (row i = key channel, a vector over the
// values), where every product is an axpy over rows and needs no horizontal sum:
//   m = Σ_i (A_i k_i) S_i ;  u = β (v - m) ;  S_i = A_i S_i + k_i u ;  y = c Σ_i q_i S_i
// Value channels (columns) evolve independently, so a step is one sweep over the rows
// per block of QB column vectors, with the block's u, y and the next step's m (formed
// from the updated rows) in registers. Snapshots are written transposed (value-major),
// the layout the backward reads, and w = v - m is saved for every step (the backward's
// recomputation then needs no products with k, and dβ = w·du).
template <typename F, int NV>
void forward_head(const F* q, const F* k, const F* v, const F* A, const F* beta, const F* s0, F* y, F* sT,
                  F* snaps, F* w, int T, int N, int G, F scale, int chunk, Strides st) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L, NP = NV * L, QB = simd::block(NV, 3, 6);
  const int gs = G == 1 ? 0 : 1;  // A_i = A[i * gs]
  F* S = scratch<F>(0, (int64_t)N * NP);
  F* cn = scratch<F>(1, N);  // the next step's A_i k_i
  pad_rows(s0, S, N, NP, false);
  V m[NV], wv[NV], yv[NV];
  for (int c = 0; c < NV; c++) m[c] = V{};
  for (int i = 0; i < N; i++) {
    const F ci = A[i * gs] * k[i];
    for (int c = 0; c < NV; c++) m[c] += ci * load(&S[(int64_t)i * NP + c * L]);
  }
  for (int t = 0; t < T; t++) {
    if (t % chunk == 0) unpad_rows(S, snaps + (int64_t)(t / chunk) * N * N, N, NP, true);
    if (t + PF < T) {
      for (const F* x : {q, k, v}) simd::prefetch(x + (t + PF) * st.x, N);
      simd::prefetch(A + (t + PF) * st.a, G);
    }
    const F *qt = q + t * st.x, *kt = k + t * st.x, *At = A + t * st.a;
    const F bt = beta[t * st.b];
    for (int i = 0; i < N; i++) cn[i] = t + 1 < T ? A[(t + 1) * st.a + i * gs] * k[(t + 1) * st.x + i] : F(0);
    load_row<F, NV>(v + t * st.x, N, wv);
    for (int c = 0; c < NV; c++) wv[c] -= m[c];
    store_row<F, NV>(w + t * st.x, N, wv);
    for (int c0 = 0; c0 < NV; c0 += QB) {
      V u[QB], acc[QB], mn[QB];
      for (int c = 0; c < QB; c++) u[c] = bt * wv[c0 + c], acc[c] = mn[c] = V{};
      for (int i = 0; i < N; i++) {
        F* __restrict row = &S[(int64_t)i * NP + c0 * L];
        const F ai = At[i * gs], ki = kt[i], qi = qt[i], ci = cn[i];
        for (int c = 0; c < QB; c++) {
          const V x = ai * load(row + c * L) + ki * u[c];
          store(row + c * L, x);
          acc[c] += qi * x;
          mn[c] += ci * x;
        }
      }
      for (int c = 0; c < QB; c++) yv[c0 + c] = scale * acc[c], m[c0 + c] = mn[c];
    }
    store_row<F, NV>(y + t * st.x, N, yv);
  }
  unpad_rows(S, sT, N, NP, false);
}

// The reverse scan on the value rows j of dSᵀ (dS_t on entry), per step:
//   x = dS_j + c dy_j q ;  du_j = k·x ;  dv_j = β du_j ;  dβ += w_j du_j ;  dm_j = -β du_j
//   dq += c dy_j S_t,j ;  dk += u_j x + dm_j (A ⊙ S_{t-1},j)
//   x += dm_j k (now dP_j) ;  dA += S_{t-1},j ⊙ x ;  dS_j = A ⊙ x
// du_j is read before dm_j k is added: the order that makes dk and dS right. With
// S_t,j = A ⊙ S_{t-1},j + u_j k, the sums over j factor as
//   dq = c (A ⊙ Σ_j dy_j S_{t-1},j + (Σ_j dy_j u_j) k) ;  dk = Σ_j u_j x_j + A ⊙ Σ_j dm_j S_{t-1},j
// Two sweeps over the rows: the first forms x (written back) and the row sums du_j,
// RG rows at a time (their lanes reduced L rows at a time); the second runs over
// blocks of QB column vectors, whose four column accumulators (dq, dk's two parts,
// dA) stay in registers.
template <typename F, int NV>
void backward_head(const F* q, const F* k, const F* A, const F* beta, const F* snaps, const F* w, const F* dy,
                   const F* dsT, F* dq, F* dk, F* dv, F* dg, F* dbeta, F* ds0, int T, int N, int G, F scale,
                   int chunk, Strides st) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L, NP = NV * L;
  constexpr int RG = simd::block(16, 1, 6);  // rows per group of the first sweep
  constexpr int QB = simd::block(NV, 4, 8);  // column vectors per block of the second
  const int64_t NNP = (int64_t)N * NP;
  const int n_chunks = (T + chunk - 1) / chunk;
  F *dS = scratch<F>(0, NNP), *states = scratch<F>(1, (int64_t)chunk * NNP);
  F* rows = scratch<F>(2, 3 * (int64_t)(N + RG));  // per value row: c dy_j, u_j, dm_j
  F *cdy = rows, *uu = rows + N + RG, *dm = rows + 2 * (N + RG);
  std::vector<V> pu(N + RG);  // per value row: the lanes of du_j
  pad_rows(dsT, dS, N, NP, true);
  auto prefetch_step = [&](int t) {
    for (const F* x : {q, k, w, dy}) simd::prefetch(x + t * st.x, N);
    for (const F* x : {dq, dk, dv}) simd::prefetch(x + t * st.x, N, true);
    simd::prefetch(A + t * st.a, G);
    simd::prefetch(dg + t * st.a, G, true);
  };
  for (int t = (n_chunks - 1) * chunk; t < T; t++) prefetch_step(t);
  for (int ch = n_chunks - 1; ch >= 0; ch--) {
    const int t0 = ch * chunk, len = std::min(chunk, T - t0);
    pad_rows(snaps + (int64_t)ch * N * N, states, N, NP, false);
    for (int s = 0; s + 1 < len; s++) {  // recompute S_{t-1} of every step of the chunk
      const int t = t0 + s;
      const KeyVecs<F, NV> kv(k + t * st.x, q + t * st.x, A + t * st.a, N, G);
      step<F, NV>(&states[(int64_t)s * NNP], &states[(int64_t)(s + 1) * NNP], kv, w + t * st.x, beta[t * st.b], N);
    }
    for (int s = len - 1; s >= 0; s--) {
      const int t = t0 + s;
      if (ch > 0) prefetch_step(t - chunk);  // the previous chunk's step s
      const KeyVecs<F, NV> kv(k + t * st.x, q + t * st.x, A + t * st.a, N, G);
      const F bt = beta[t * st.b];
      const F *prev = &states[(int64_t)s * NNP], *wt = w + t * st.x, *dyt = dy + t * st.x;
      F* dvt = dv + t * st.x;
      F db = 0, dyu = 0;
      for (int j0 = 0; j0 < N; j0 += RG) {
        const int nr = std::min(RG, N - j0);
        V pu_g[RG];
        for (int g = 0; g < RG; g++) pu_g[g] = V{}, cdy[j0 + g] = g < nr ? scale * dyt[j0 + g] : F(0);
        for (int c = 0; c < NV; c++) {
          const V qc = kv.q[c], kc = kv.k[c];
          for (int g = 0; g < RG; g++) {
            if (g >= nr) break;
            F* __restrict row = &dS[(int64_t)(j0 + g) * NP + c * L];
            const V x = load(row) + cdy[j0 + g] * qc;
            store(row, x);
            pu_g[g] += x * kc;
          }
        }
        for (int g = 0; g < RG; g++) pu[j0 + g] = pu_g[g];
      }
      int j = 0;
      for (; j + L <= N; j += L) store(dm + j, simd::hsums<F>(&pu[j]));  // du, for now
      for (; j < N; j++) dm[j] = hsum<F>(pu[j]);
      for (j = 0; j < N; j++) {
        const F du = dm[j];
        uu[j] = bt * wt[j], dm[j] = -bt * du;
        dvt[j] = bt * du;
        db += wt[j] * du;
        dyu += cdy[j] * uu[j];
      }
      dbeta[t * st.b] = db;
      V dkv[NV], dqv[NV], dgv[NV];
      for (int c0 = 0; c0 < NV; c0 += QB) {
        V acc_x[QB], acc_m[QB], acc_q[QB], acc_a[QB];
        for (int c = 0; c < QB; c++) acc_x[c] = acc_m[c] = acc_q[c] = acc_a[c] = V{};
        for (int j = 0; j < N; j++) {
          const F* __restrict p = prev + (int64_t)j * NP + c0 * L;
          F* __restrict row = &dS[(int64_t)j * NP + c0 * L];
          const F cj = cdy[j], uj = uu[j], mj = dm[j];
          for (int c = 0; c < QB; c++) {
            const V sp = load(p + c * L), x = load(row + c * L);
            acc_q[c] += cj * sp;
            acc_x[c] += uj * x;
            acc_m[c] += mj * sp;
            const V dp = x + mj * kv.k[c0 + c];
            acc_a[c] += sp * dp;
            store(row + c * L, kv.a[c0 + c] * dp);
          }
        }
        for (int c = 0; c < QB; c++) {
          const V av = kv.a[c0 + c];
          dkv[c0 + c] = acc_x[c] + av * acc_m[c];
          dqv[c0 + c] = av * acc_q[c] + dyu * kv.k[c0 + c];
          dgv[c0 + c] = av * acc_a[c];  // dg = A ⊙ dA
        }
      }
      store_row<F, NV>(dk + t * st.x, N, dkv);
      store_row<F, NV>(dq + t * st.x, N, dqv);
      if (G > 1) {
        store_row<F, NV>(dg + t * st.a, N, dgv);
      } else {  // gdn: one gate for all rows (the padded lanes are zero)
        V sum = V{};
        for (int c = 0; c < NV; c++) sum += dgv[c];
        dg[t * st.a] = hsum<F>(sum);
      }
    }
  }
  unpad_rows(dS, ds0, N, NP, true);
}

template <typename F, int NV>
void forward(const F* q, const F* k, const F* v, const F* A, const F* beta, const F* s0, F* y, F* sT, F* snaps,
             F* w, int B, int T, int H, int N, int G, F scale, int chunk, int threads) {
  const int n_chunks = (T + chunk - 1) / chunk;
  const int64_t NN = (int64_t)N * N;
  const Strides st{(int64_t)H * N, (int64_t)H * G, H};
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int bh = 0; bh < B * H; bh++) {
    const int bi = bh / H, h = bh % H;
    const int64_t row0 = (int64_t)bi * T * H + h;  // (b, t = 0, h) in units of one [N] row
    const int64_t x0 = row0 * N;
    forward_head<F, NV>(q + x0, k + x0, v + x0, A + row0 * G, beta + row0, s0 + bh * NN, y + x0, sT + bh * NN,
                        snaps + bh * n_chunks * NN, w + x0, T, N, G, scale, chunk, st);
  }
}

template <typename F, int NV>
void backward(const F* q, const F* k, const F* A, const F* beta, const F* snaps, const F* w, const F* dy,
              const F* dsT, F* dq, F* dk, F* dv, F* dg, F* dbeta, F* ds0, int B, int T, int H, int N, int G, F scale,
              int chunk, int threads) {
  const int n_chunks = (T + chunk - 1) / chunk;
  const int64_t NN = (int64_t)N * N;
  const Strides st{(int64_t)H * N, (int64_t)H * G, H};
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int bh = 0; bh < B * H; bh++) {
    const int bi = bh / H, h = bh % H;
    const int64_t row0 = (int64_t)bi * T * H + h;
    const int64_t x0 = row0 * N, g0 = row0 * G;
    backward_head<F, NV>(q + x0, k + x0, A + g0, beta + row0, snaps + bh * n_chunks * NN, w + x0, dy + x0,
                         dsT + bh * NN, dq + x0, dk + x0, dv + x0, dg + g0, dbeta + row0, ds0 + bh * NN, T, N, G,
                         scale, chunk, st);
  }
}

// Vectors per padded state row: the smallest power of two that covers N, or 0 when N is too large.
template <typename F>
int vectors_for(int N) {
  const int need = (N + Vec<F>::L - 1) / Vec<F>::L;
  for (int nv = 1; nv <= 32; nv *= 2)
    if (need <= nv) return nv;
  return 0;
}

}  // namespace

extern "C" {

// Both return 0, or -1 when N exceeds 32 vectors (512 fp32 / 256 fp64 channels).
#define RWKVX_EXPORT(F, SUFFIX)                                                                                    \
  int delta_forward_##SUFFIX(const F* q, const F* k, const F* v, const F* A, const F* beta, const F* s0, F* y,    \
                             F* sT, F* snaps, F* w, int B, int T, int H, int N, int G, double scale, int chunk,   \
                             int threads) {                                                                        \
    decltype(&forward<F, 1>) fn;                                                                                   \
    switch (vectors_for<F>(N)) {                                                                                   \
      case 1: fn = forward<F, 1>; break;                                                                           \
      case 2: fn = forward<F, 2>; break;                                                                           \
      case 4: fn = forward<F, 4>; break;                                                                           \
      case 8: fn = forward<F, 8>; break;                                                                           \
      case 16: fn = forward<F, 16>; break;                                                                         \
      case 32: fn = forward<F, 32>; break;                                                                         \
      default: return -1;                                                                                          \
    }                                                                                                              \
    fn(q, k, v, A, beta, s0, y, sT, snaps, w, B, T, H, N, G, F(scale), chunk, threads);                            \
    return 0;                                                                                                      \
  }                                                                                                                \
  int delta_backward_##SUFFIX(const F* q, const F* k, const F* A, const F* beta, const F* snaps, const F* w,      \
                              const F* dy, const F* dsT, F* dq, F* dk, F* dv, F* dg, F* dbeta, F* ds0, int B,      \
                              int T, int H, int N, int G, double scale, int chunk, int threads) {                  \
    decltype(&backward<F, 1>) fn;                                                                                  \
    switch (vectors_for<F>(N)) {                                                                                   \
      case 1: fn = backward<F, 1>; break;                                                                          \
      case 2: fn = backward<F, 2>; break;                                                                          \
      case 4: fn = backward<F, 4>; break;                                                                          \
      case 8: fn = backward<F, 8>; break;                                                                          \
      case 16: fn = backward<F, 16>; break;                                                                        \
      case 32: fn = backward<F, 32>; break;                                                                        \
      default: return -1;                                                                                          \
    }                                                                                                              \
    fn(q, k, A, beta, snaps, w, dy, dsT, dq, dk, dv, dg, dbeta, ds0, B, T, H, N, G, F(scale), chunk, threads);     \
    return 0;                                                                                                      \
  }

RWKVX_EXPORT_PRECISIONS
}
