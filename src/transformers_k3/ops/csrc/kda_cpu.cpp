// Chunked KDA forward on CPU (fp32, no autograd): the same WY/UT-transform algorithm as
// transformers_k3.ops.kda._chunked, fused per (sequence, head).
//
// The PyTorch path is memory-bound on CPU: its intra-chunk part is ~30 element-wise passes over
// [chunks * heads, C, D] tensors, each a separate kernel launch. Here one task owns one (sequence,
// head) pair and walks its chunks in order; a chunk's rows are gathered once into cache-resident
// buffers, every element-wise step runs on them in place, the matrix products go to the BLAS sgemm
// that torch itself links (MKL), and the output rows are written straight into [tokens, H, V].
// Tasks run on OpenMP threads (the runtime torch loaded); MKL runs sequentially inside them.
//
// No torch headers (torch_ops.cpp binds it as an operator through kernels.h), so it compiles in under a second.
// Layouts (all row-major, fp32, contiguous):
//   q, k, g: [tokens, H, K]    v, out: [tokens, H, V]    beta: [tokens, H]
//   state:   [n_seq, H, K, V], read as the initial state and overwritten with the final state (on failure,
//            nonzero return, it is left as it was).
// Sequence n covers tokens starts[n] .. starts[n] + lengths[n] - 1.
//
// Numerics (see _chunked / _intra_chunk in kda.py for the derivation):
//   G_r: cumulative log-decay from the chunk start to row r (inclusive).
//   A_qk[r, s] = q_r . (e^{G_r - G_s} k_s), s <= r;  A_kk[r, s] = beta_r k_r . (e^{G_r - G_s} k_s), s < r.
//   (u | w) = (I + A_kk)^{-1} (beta v | beta k e^{G});  n = u - w S;  o = (q e^{G}) S + A_qk n;
//   S' = e^{G_last} S + (k e^{G_last - G})^T n.
// The pairwise decays are formed as e^{G_r - G_m} e^{G_m - G_s} around the chunk's middle row m when
// every |G_r - G_m| <= kSpanLimit (so neither factor over- or underflows fp32: e^80 < 2^127), else
// exactly, one exponential per (r, s, channel). Denormals are flushed to zero while a task runs (x86):
// long decay chains produce values ~1e-40 that are otherwise far slower and ~1e-33 of the results.

#include <vector>

#include "common.h"
#include "kernels.h"

namespace {

using k3::fast_exp;
using k3::gemm;

constexpr float kSpanLimit = 80.0f;

struct Dims {
  int heads, key_dim, value_dim, chunk;
};

// Per-thread scratch, sized for one chunk (d.chunk: the longest chunk of the call).
struct Scratch {
  std::vector<float> q, k, g, beta, rows, cols, scores, inv, rhs, sol, outer;
  explicit Scratch(const Dims& d) {
    const int c = d.chunk, kd = d.key_dim, vd = d.value_dim;
    q.resize((size_t)c * kd);
    k.resize((size_t)c * kd);
    g.resize((size_t)c * kd);
    beta.resize(c);
    rows.resize((size_t)2 * c * kd);    // [q e^{G - G_m}; k e^{G - G_m}], later q e^G and k e^{G_last - G}
    cols.resize((size_t)c * kd);        // k e^{G_m - G}
    scores.resize((size_t)2 * c * c);   // [A_qk; A_kk]
    inv.resize((size_t)c * c);          // (I + A)^{-1}
    rhs.resize((size_t)c * (vd + kd));  // [beta v | beta k e^G]
    sol.resize((size_t)c * (vd + kd));  // [u | w], then [n | -]
    outer.resize(kd);                   // e^{G_last}
  }
};

// Asks for `bytes` from `p` on to be brought into cache (L2) ahead of use.
inline void prefetch(const float* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(c + at, 0, 2);
}

// One chunk of `len` rows starting at token `t0`, head `h`, updating `state` [K, V] in place. `next_len`:
// rows of the sequence's next chunk, which are prefetched while this one computes. A head's rows are
// H * D floats apart (a new page for every row at K3's sizes), which defeats the hardware prefetcher:
// without this, loading the rows took ~60 % of the kernel's own time.
void chunk_step(const float* q, const float* k, const float* v, const float* g, const float* beta, float* out,
                float* state, int64_t t0, int len, int next_len, int h, const Dims& d, float scale, Scratch& s) {
  const int kd = d.key_dim, vd = d.value_dim, H = d.heads, w = vd + kd;
  const int64_t qk_row = (int64_t)H * kd, v_row = (int64_t)H * vd;
  for (int r = 0; r < next_len; ++r) {
    const int64_t at = (t0 + len + r) * qk_row + (int64_t)h * kd;
    prefetch(q + at, (int64_t)kd * 4);
    prefetch(k + at, (int64_t)kd * 4);
    prefetch(g + at, (int64_t)kd * 4);
    prefetch(v + (t0 + len + r) * v_row + (int64_t)h * vd, (int64_t)vd * 4);
  }
  float* G = s.g.data();
  float* Q = s.q.data();
  float* K = s.k.data();

  // Gather the chunk's rows; G is the running sum of the log-decays.
  for (int r = 0; r < len; ++r) {
    const int64_t at = (t0 + r) * qk_row + (int64_t)h * kd;
    const float* qr = q + at;
    const float* kr = k + at;
    const float* gr = g + at;
    float* Qr = Q + (size_t)r * kd;
    float* Kr = K + (size_t)r * kd;
    float* Gr = G + (size_t)r * kd;
    const float* Gp = r ? Gr - kd : nullptr;
#pragma omp simd
    for (int i = 0; i < kd; ++i) {
      Qr[i] = qr[i] * scale;
      Kr[i] = kr[i];
      Gr[i] = (r ? Gp[i] : 0.0f) + gr[i];
    }
    s.beta[r] = beta[(t0 + r) * H + h];
  }

  // Pairwise-decayed scores: scores[0:len] = A_qk (incl. diagonal), scores[len:2 len] = k . k (s < r).
  const int mid = (len - 1) / 2;
  const float* Gm = G + (size_t)mid * kd;
  float span = 0.0f;
  for (int r = 0; r < len; ++r) {
    const float* Gr = G + (size_t)r * kd;
#pragma omp simd reduction(max : span)
    for (int i = 0; i < kd; ++i) {
      const float gap = std::fabs(Gr[i] - Gm[i]);
      span = gap > span ? gap : span;
    }
  }
  float* scores = s.scores.data();
  if (span <= kSpanLimit) {  // also false for NaN
    float* rows = s.rows.data();
    float* cols = s.cols.data();
    for (int r = 0; r < len; ++r) {
      const float* Gr = G + (size_t)r * kd;
      const float* Qr = Q + (size_t)r * kd;
      const float* Kr = K + (size_t)r * kd;
      float* qrow = rows + (size_t)r * kd;
      float* krow = rows + (size_t)(len + r) * kd;
      float* crow = cols + (size_t)r * kd;
#pragma omp simd
      for (int i = 0; i < kd; ++i) {
        const float up = fast_exp(Gr[i] - Gm[i]);
        const float down = fast_exp(Gm[i] - Gr[i]);
        qrow[i] = Qr[i] * up;
        krow[i] = Kr[i] * up;
        crow[i] = Kr[i] * down;
      }
    }
    gemm(false, true, 2 * len, len, kd, 1.0f, rows, kd, cols, kd, 0.0f, scores, len);
  } else {
    for (int r = 0; r < len; ++r) {
      const float* Gr = G + (size_t)r * kd;
      const float* Qr = Q + (size_t)r * kd;
      const float* Kr = K + (size_t)r * kd;
      for (int c = 0; c <= r; ++c) {
        const float* Gc = G + (size_t)c * kd;
        const float* Kc = K + (size_t)c * kd;
        float aq = 0.0f, ak = 0.0f;
#pragma omp simd reduction(+ : aq, ak)
        for (int i = 0; i < kd; ++i) {
          const float e = fast_exp(Gr[i] - Gc[i]) * Kc[i];
          aq += Qr[i] * e;
          ak += Kr[i] * e;
        }
        scores[(size_t)r * len + c] = aq;
        scores[(size_t)(len + r) * len + c] = ak;
      }
    }
  }

  // (I + A)^{-1} for A[r, c] = beta_r (k_r . e^{G_r - G_c} k_c), c < r: unit lower triangular,
  // row r = e_r - sum_{c < r} A[r, c] row c.
  float* inv = s.inv.data();
  const float* akk = scores + (size_t)len * len;
  for (int r = 0; r < len; ++r) {
    float* ir = inv + (size_t)r * len;
    for (int c = 0; c < len; ++c) ir[c] = c == r ? 1.0f : 0.0f;
    const float br = s.beta[r];
    for (int c = 0; c < r; ++c) {
      const float a = br * akk[(size_t)r * len + c];
      if (a == 0.0f) continue;
      const float* ic = inv + (size_t)c * len;
#pragma omp simd
      for (int j = 0; j <= c; ++j) ir[j] -= a * ic[j];
    }
  }

  // Right-hand sides [beta v | beta k e^G]; also q e^G and k e^{G_last - G} for the state products.
  float* rhs = s.rhs.data();
  float* qg = s.rows.data();
  float* kdec = s.rows.data() + (size_t)len * kd;
  const float* Gl = G + (size_t)(len - 1) * kd;
  for (int r = 0; r < len; ++r) {
    const float b = s.beta[r];
    const float* vr = v + (t0 + r) * v_row + (int64_t)h * vd;
    float* rr = rhs + (size_t)r * w;
#pragma omp simd
    for (int j = 0; j < vd; ++j) rr[j] = b * vr[j];
    const float* Gr = G + (size_t)r * kd;
    const float* Qr = Q + (size_t)r * kd;
    const float* Kr = K + (size_t)r * kd;
    float* qgr = qg + (size_t)r * kd;
    float* kdr = kdec + (size_t)r * kd;
#pragma omp simd
    for (int i = 0; i < kd; ++i) {
      const float grow = fast_exp(Gr[i]);
      rr[vd + i] = b * Kr[i] * grow;
      qgr[i] = Qr[i] * grow;
      kdr[i] = Kr[i] * fast_exp(Gl[i] - Gr[i]);
    }
  }
  float* sol = s.sol.data();
  gemm(false, false, len, w, len, 1.0f, inv, len, rhs, w, 0.0f, sol, w);  // [u | w]

  // n = u - w S (into the u columns); o = (q e^G) S + A_qk n; S = e^{G_last} S + kdec^T n.
  gemm(false, false, len, vd, kd, -1.0f, sol + vd, w, state, vd, 1.0f, sol, w);
  float* o = out + t0 * v_row + (int64_t)h * vd;
  gemm(false, false, len, vd, kd, 1.0f, qg, kd, state, vd, 0.0f, o, (int)v_row);
  // A_qk is the lower triangle (with diagonal) of scores[0:len]; the upper part is not zeroed in the
  // factored form, so mask it before use.
  for (int r = 0; r < len; ++r)
    for (int c = r + 1; c < len; ++c) scores[(size_t)r * len + c] = 0.0f;
  gemm(false, false, len, vd, len, 1.0f, scores, len, sol, w, 1.0f, o, (int)v_row);
#pragma omp simd
  for (int i = 0; i < kd; ++i) s.outer[i] = fast_exp(Gl[i]);
  for (int i = 0; i < kd; ++i) {
    float* srow = state + (size_t)i * vd;
    const float f = s.outer[i];
#pragma omp simd
    for (int j = 0; j < vd; ++j) srow[j] *= f;
  }
  gemm(true, false, kd, vd, len, 1.0f, kdec, kd, sol, w, 1.0f, state, vd);
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 on invalid arguments, 2 if scratch memory could not be allocated.
int k3_kda_chunk_forward(const float* q, const float* k, const float* v, const float* g, const float* beta,
                         float* out, float* state, const int64_t* starts, const int64_t* lengths, int64_t n_seq,
                         int heads, int key_dim, int value_dim, int chunk, float scale, int n_threads) {
  if (heads <= 0 || key_dim <= 0 || value_dim <= 0 || chunk <= 0 || n_seq < 0 || n_threads <= 0) return 1;
  // Scratch for the longest chunk this call runs, not the chunk size: a decode step's one row would otherwise
  // allocate and zero a whole chunk's scratch on every call.
  int64_t longest = 1;
  for (int64_t n = 0; n < n_seq; ++n) longest = lengths[n] > longest ? lengths[n] : longest;
  const Dims d{heads, key_dim, value_dim, (int)(longest < chunk ? longest : chunk)};
  const int64_t tasks = n_seq * heads;
  int status = 0;
  // Always a parallel region, also for a single task: BLAS libraries run sequentially inside one (the
  // products here are far too small to split), but would spread each over all threads outside it.
#pragma omp parallel num_threads(n_threads)
  {
    const k3::FlushDenormals flush;
    const std::unique_ptr<Scratch> scratch = k3::new_scratch<Scratch>(status, d);
    // The states may be the caller's (updated in place): no thread starts until every thread has its
    // scratch, so a failed call has written nothing.
#pragma omp barrier
    int failed;
#pragma omp atomic read
    failed = status;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      if (failed) continue;
      const int64_t n = task / heads;
      const int h = (int)(task % heads);
      float* st = state + task * (int64_t)key_dim * value_dim;
      for (int64_t c0 = 0; c0 < lengths[n]; c0 += chunk) {
        const int len = (int)(lengths[n] - c0 < chunk ? lengths[n] - c0 : chunk);
        const int64_t rest = lengths[n] - c0 - len;
        const int next_len = (int)(rest < chunk ? rest : chunk);
        chunk_step(q, k, v, g, beta, out, st, starts[n] + c0, len, next_len, h, d, scale, *scratch);
      }
    }
  }
  return status;
}

}  // extern "C"
