// rwkv7_prep forward and backward on the CPU: RWKV-7's elementwise work between the time mix's
// matmuls and wkv7, one pass over each tensor. OpenMP over ranges of the B·T rows; each row's H
// heads of N channels in SIMD vectors (any N: a partial last vector is loaded zero-filled and
// stored lane by lane).
//
// Layout: the sequence tensors [rows, C] contiguous (rows = B·T, C = H·N), the parameters [C].
// Per head, with σ the logistic function and x = k ⊙ k_k (see ../__init__.py):
//   w = -e^{-1/2} σ(w0 + w_lora)    ag = σ(a0 + a_lora)    k' = k ⊙ (1 + (ag - 1) ⊙ k_a)
//   v' = v + (v_first - v) ⊙ σ(v0 + v_lora)                 (first layer: v' = v, not written)
//   kk = x / max(|x|, 1e-12)    a = -kk    b = kk ⊙ ag    s = Σ r ⊙ k' ⊙ r_k    bonus = s v'
// Each head takes two sweeps of its channels: the first computes what the head's sums need and
// the sums, the second what depends on them. The second reads back only what the first left in
// L1, so every tensor crosses memory once.
//
// Backward (one row and head; dX is the cotangent, any of them may be absent = zero):
//   dkk = -da + db ag                  dag = db kk                        ds = Σ dbonus ⊙ v'
//   dx = dkk / n - x (x · dkk) / n³    with n = |x| (dx = dkk / 1e-12 where n <= 1e-12: the clamp)
//   dk'' = dk' + ds r ⊙ r_k            dr = ds k' ⊙ r_k                   dr_k += ds r ⊙ k'
//   dk = dx ⊙ k_k + dk'' ⊙ (1 + (ag - 1) ⊙ k_a)     dk_k += dx ⊙ k      dk_a += dk'' ⊙ k ⊙ (ag - 1)
//   dag += dk'' ⊙ k ⊙ k_a              da_lora = da0 terms = dag ag (1 - ag)
//   dw_lora = dw0 terms = -e^{-1/2} dw σ (1 - σ)
//   dv'' = dv' + dbonus s              dv = dv'' (1 - sv)     dv_first = dv'' sv
//   dv_lora = dv0 terms = dv'' ⊙ (v_first - v) sv (1 - sv),   sv = σ(v0 + v_lora)
// In the first layer dv = dbonus s: v' is v itself, so its own cotangent reaches v outside.
// The first sweep computes the four sums (|x|², x · dkk, s, ds) and leaves ag and sv in the
// da_lora and dv_lora rows, which the second sweep reads back and overwrites. The parameter
// gradients (sums over the rows) go to per-thread fp32 partials, added into per-thread fp64
// totals every kBlock rows and summed over the threads in order: deterministic for a given
// thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../csrc/simd.h"

namespace {

using simd::Vec;

template <typename F>
using V = typename Vec<F>::type;

constexpr double kDecayScale = 0.60653065971263342360;  // e^{-1/2}
constexpr double kNormEps = 1e-12;                         // F.normalize's
constexpr int kBlock = 64;                                 // rows per fp32 partial sum

// The first n lanes (n > 0); the rest of a partial vector is zero. The partial vector has a path
// of its own: one shared with the full load would keep every loaded vector on the stack.
template <typename F>
inline V<F> ld(const F* p, int n) {
  V<F> x;
  if (n >= Vec<F>::L) {
    std::memcpy(&x, p, sizeof(x));
    return x;
  }
  x = V<F>{};
  for (int l = 0; l < n; l++) x[l] = p[l];
  return x;
}

// A cotangent: where autograd gave none (p null), zeros. `dense` (every cotangent given, the
// model's case) is compiled apart, without the tests.
template <bool dense, typename F>
inline V<F> ld0(const F* p, int64_t o, int n) {
  if constexpr (dense) return ld(p + o, n);
  return p ? ld(p + o, n) : V<F>{};
}

template <typename F>
inline void st(F* p, V<F> x, int n) {
  if (n >= Vec<F>::L) {
    std::memcpy(p, &x, sizeof(x));
    return;
  }
  for (int l = 0; l < n; l++) p[l] = x[l];
}

template <typename F>
inline void add(F* p, V<F> x, int n) {
  st(p, ld(p, n) + x, n);
}

// f(i, n) over a head's N channels, L at a time: the whole vectors with n = L, so that their code
// (f is inlined at both calls) has no partial-vector paths, then the partial one if any.
#define RWKVX_INLINE __attribute__((always_inline))
template <int L, typename Fn>
RWKVX_INLINE inline void sweep(int N, Fn&& f) {
  int i = 0;
  for (; i + L <= N; i += L) f(i, L);
  if (i < N) f(i, N - i);
}

// σ(z) with the exponent kept <= 0: 1 / (1 + e^{-z}) for z >= 0, e^z / (1 + e^z) below.
template <typename Vt>
inline Vt sigmoid(Vt z) {
  const Vt e = simd::exp_nonpos(z < 0 ? z : -z);
  return (z < 0 ? e : Vt{} + 1) / (1 + e);
}

// The first layer's code (residual false) is compiled apart: the value residual's branches and
// registers would otherwise weigh on every step of both.
template <typename F, bool residual>
void forward(const F* r, const F* k, const F* v, const F* wl, const F* al, const F* vf, const F* vl, const F* w0,
             const F* a0, const F* v0, const F* kk, const F* ka, const F* rk, F* w, F* ko, F* vo, F* a, F* b,
             F* bonus, int64_t rows, int H, int N, int threads) {
  typedef V<F> Vt;
  constexpr int L = Vec<F>::L;
  const int C = H * N;
  const F dec = F(kDecayScale);
  const F* vp = residual ? vo : v;  // v', read back in the second sweep
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t row = 0; row < rows; row++) {
    for (int h = 0; h < H; h++) {
      const int64_t base = row * C + h * N;
      Vt sxx = {}, srk = {};
      sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
        const int c = h * N + i;
        const int64_t o = base + i;
        const Vt ag = sigmoid(ld(a0 + c, n) + ld(al + o, n));
        const Vt kt = ld(k + o, n);
        st(w + o, -dec * sigmoid(ld(w0 + c, n) + ld(wl + o, n)), n);
        const Vt kn = kt * (1 + (ag - 1) * ld(ka + c, n));
        st(ko + o, kn, n);
        const Vt x = kt * ld(kk + c, n);
        sxx += x * x;
        srk += ld(r + o, n) * kn * ld(rk + c, n);
        st(a + o, x, n), st(b + o, ag, n);  // x and ag, for the second sweep
        if constexpr (residual) {
          const Vt vt = ld(v + o, n);
          st(vo + o, vt + (ld(vf + o, n) - vt) * sigmoid(ld(v0 + c, n) + ld(vl + o, n)), n);
        }
      });
      const F inv = F(1) / std::max(std::sqrt(simd::hsum<F>(sxx)), F(kNormEps)), s = simd::hsum<F>(srk);
      sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
        const int64_t o = base + i;
        const Vt kkv = ld(a + o, n) * inv;
        st(a + o, -kkv, n), st(b + o, kkv * ld(b + o, n), n);
        st(bonus + o, s * ld(vp + o, n), n);
      });
    }
  }
}

// The parameter gradients' sums over rows, in each thread's range of rows: body(row, partials)
// adds a row's terms to partials [P][C]; grads[p] (nullptr: not wanted) gets the total.
template <typename F, typename Body>
void sum_rows(int64_t rows, int P, int C, int threads, F* const* grads, Body body) {
  std::vector<double> totals((size_t)threads * P * C, 0.0);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = rows * t / nt, hi = rows * (t + 1) / nt;
    std::vector<F> part((size_t)P * C, F(0));
    double* mine = totals.data() + (size_t)t * P * C;
    for (int64_t r0 = lo; r0 < hi; r0 += kBlock) {
      for (int64_t row = r0; row < std::min(hi, r0 + kBlock); row++) body(row, part.data());
      for (size_t j = 0; j < part.size(); j++) mine[j] += part[j], part[j] = F(0);
    }
  }
  for (int p = 0; p < P; p++) {
    if (!grads[p]) continue;
    for (int c = 0; c < C; c++) {
      double s = 0;
      for (int t = 0; t < threads; t++) s += totals[((size_t)t * P + p) * C + c];
      grads[p][c] = F(s);
    }
  }
}

template <typename F, bool residual, bool dense>
void backward(const F* r, const F* k, const F* v, const F* wl, const F* al, const F* vf, const F* vl, const F* w0,
              const F* a0, const F* v0, const F* kk, const F* ka, const F* rk, const F* dw, const F* dko,
              const F* dvo, const F* da, const F* db, const F* dbo, F* dr, F* dk, F* dv, F* dwl, F* dal, F* dvf,
              F* dvl, F* dw0, F* da0, F* dv0, F* dkk, F* dka, F* drk, int64_t rows, int H, int N, int threads) {
  typedef V<F> Vt;
  constexpr int L = Vec<F>::L;
  const int C = H * N;
  const F dec = F(kDecayScale);
  enum { W0, A0, V0, KK, KA, RK, P };  // the partials' rows
  F* const grads[P] = {dw0, da0, residual ? dv0 : nullptr, dkk, dka, drk};
  sum_rows<F>(rows, P, C, threads, grads, [&](int64_t row, F* part) {
    for (int h = 0; h < H; h++) {
      const int64_t base = row * C + h * N;
      Vt sxx = {}, sxd = {}, srk = {}, sdb = {};
      sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
        const int c = h * N + i;
        const int64_t o = base + i;
        const Vt ag = sigmoid(ld(a0 + c, n) + ld(al + o, n));
        const Vt kt = ld(k + o, n), x = kt * ld(kk + c, n);
        sxx += x * x;
        sxd += x * (ld0<dense>(db, o, n) * ag - ld0<dense>(da, o, n));
        srk += ld(r + o, n) * kt * (1 + (ag - 1) * ld(ka + c, n)) * ld(rk + c, n);
        st(dal + o, ag, n);  // ag and sv, for the second sweep
        Vt vp = ld(v + o, n);
        if constexpr (residual) {
          const Vt sv = sigmoid(ld(v0 + c, n) + ld(vl + o, n));
          vp += (ld(vf + o, n) - vp) * sv;
          st(dvl + o, sv, n);
        }
        if (dense || dbo) sdb += ld(dbo + o, n) * vp;
      });
      const F nrm = std::sqrt(simd::hsum<F>(sxx)), inv = F(1) / std::max(nrm, F(kNormEps));
      const F q = nrm > F(kNormEps) ? inv * inv * inv * simd::hsum<F>(sxd) : F(0);
      const F s = simd::hsum<F>(srk), ds = simd::hsum<F>(sdb);
      sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
        const int c = h * N + i;
        const int64_t o = base + i;
        const Vt ag = ld(dal + o, n), kt = ld(k + o, n), rt = ld(r + o, n);
        const Vt kkc = ld(kk + c, n), kac = ld(ka + c, n), rkc = ld(rk + c, n);
        const Vt sw = sigmoid(ld(w0 + c, n) + ld(wl + o, n));
        const Vt dzw = -dec * ld0<dense>(dw, o, n) * sw * (1 - sw);
        st(dwl + o, dzw, n), add(part + W0 * C + c, dzw, n);
        const Vt x = kt * kkc, dkkv = ld0<dense>(db, o, n) * ag - ld0<dense>(da, o, n);
        const Vt dx = inv * dkkv - q * x;
        add(part + KK * C + c, dx * kt, n);
        const Vt f = 1 + (ag - 1) * kac, kn = kt * f;
        const Vt dkn = ld0<dense>(dko, o, n) + ds * rt * rkc;
        st(dr + o, ds * kn * rkc, n), add(part + RK * C + c, ds * rt * kn, n);
        st(dk + o, dx * kkc + dkn * f, n), add(part + KA * C + c, dkn * kt * (ag - 1), n);
        const Vt dag = ld0<dense>(db, o, n) * x * inv + dkn * kt * kac, dza = dag * ag * (1 - ag);
        st(dal + o, dza, n), add(part + A0 * C + c, dza, n);
        const Vt dvp = (residual ? ld0<dense>(dvo, o, n) : Vt{}) + ld0<dense>(dbo, o, n) * s;
        if constexpr (residual) {
          const Vt sv = ld(dvl + o, n), vt = ld(v + o, n), dzv = dvp * (ld(vf + o, n) - vt) * sv * (1 - sv);
          st(dv + o, dvp * (1 - sv), n), st(dvf + o, dvp * sv, n);
          st(dvl + o, dzv, n), add(part + V0 * C + c, dzv, n);
        } else {
          st(dv + o, dvp, n);
        }
      });
    }
  });
}

}  // namespace

extern "C" {

// present: bit i set when cotangent i of (dw, dk', dv', da, db, dbonus) is given; an absent one is
// zero (its pointer is never read). residual = 0 (the first layer): v_first, v_lora, v0, v', the
// cotangent of v' and their gradients are not read or written.
#define RWKVX_EXPORT(F, SUFFIX)                                                                                    \
  void rwkv7_prep_forward_##SUFFIX(const F* r, const F* k, const F* v, const F* wl, const F* al, const F* vf,     \
                                   const F* vl, const F* w0, const F* a0, const F* v0, const F* kk, const F* ka,   \
                                   const F* rk, F* w, F* ko, F* vo, F* a, F* b, F* bonus, int rows, int H, int N,  \
                                   int residual, int threads) {                                                    \
    (residual ? forward<F, true> : forward<F, false>)(r, k, v, wl, al, vf, vl, w0, a0, v0, kk, ka, rk, w, ko, vo, a, \
                                                      b, bonus, rows, H, N, threads);                              \
  }                                                                                                                \
  void rwkv7_prep_backward_##SUFFIX(                                                                               \
      const F* r, const F* k, const F* v, const F* wl, const F* al, const F* vf, const F* vl, const F* w0,         \
      const F* a0, const F* v0, const F* kk, const F* ka, const F* rk, const F* dw, const F* dko, const F* dvo,    \
      const F* da, const F* db, const F* dbo, F* dr, F* dk, F* dv, F* dwl, F* dal, F* dvf, F* dvl, F* dw0, F* da0, \
      F* dv0, F* dkk, F* dka, F* drk, int rows, int H, int N, int residual, int present, int threads) {            \
    const F* d[6] = {dw, dko, dvo, da, db, dbo};                                                                   \
    for (int i = 0; i < 6; i++)                                                                                    \
      if (!(present >> i & 1)) d[i] = nullptr;                                                                     \
    const bool dense = (present | (residual ? 0 : 4)) == 63;                                                       \
    auto fn = residual ? (dense ? backward<F, true, true> : backward<F, true, false>)                              \
                       : (dense ? backward<F, false, true> : backward<F, false, false>);                           \
    fn(r, k, v, wl, al, vf, vl, w0, a0, v0, kk, ka, rk, d[0], d[1], d[2], d[3], d[4], d[5], dr, dk, dv, dwl, dal,   \
       dvf, dvl, dw0, da0, dv0, dkk, dka, drk, rows, H, N, threads);                                                \
  }

#ifdef RWKVX_FP32
RWKVX_EXPORT(float, f32)
#endif
#ifdef RWKVX_FP64
RWKVX_EXPORT(double, f64)
#endif
}
