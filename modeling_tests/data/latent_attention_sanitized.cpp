// Standalone check of csrc/attention_cpu.cpp under AddressSanitizer and UBSan (test_cpu_kernels.py builds and runs
// it): random shapes, fp32 and bf16 latents in exactly sized buffers with a batch stride, masks, 1-3 threads, each
// output against a float64 reference of the definition (a query the mask leaves no row: the mean of the rows).
#include <cstdio>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>
#include "kernels.h"
int main() {
  std::mt19937 rng(0);
  std::normal_distribution<float> nd;
  int bad = 0;
  for (int it = 0; it < 1000; ++it) {
    int batch = 1 + rng() % 3, T = 1 + rng() % 3, heads = 1 + rng() % 5, dim = 1 + rng() % 70;
    int vdim = 1 + rng() % dim; int64_t seq = T + rng() % (it % 10 == 0 ? 3000 : 90);
    int64_t M = heads * T, cap = seq + rng() % 5;
    bool bf = rng() % 2, use_mask = rng() % 2;
    int threads = 1 + rng() % 3;
    // exact-size allocations so ASan sees any overrun
    std::vector<float> latf(batch * cap * dim); std::vector<uint16_t> latb(batch * cap * dim);
    for (auto& x : latf) x = nd(rng);
    for (size_t i = 0; i < latf.size(); ++i) { uint32_t u; std::memcpy(&u, &latf[i], 4); latb[i] = u >> 16; u = (uint32_t)latb[i] << 16; std::memcpy(&latf[i], &u, 4); }
    std::vector<float> q(batch * M * dim); for (auto& x : q) x = 0.3f * nd(rng);
    std::vector<uint8_t> mask(batch * heads * T * seq);
    for (auto& m : mask) m = rng() % 3 != 0;
    int64_t strides[3] = {heads * T * seq, T * seq, seq};
    std::vector<float> out(batch * M * vdim);
    int st = k3_latent_attention(bf ? (const void*)latb.data() : (const void*)latf.data(), bf, cap * dim, q.data(), batch, seq, M, dim, vdim, T,
                                 use_mask ? mask.data() : nullptr, strides, 0.2f, out.data(), threads);
    if (st) { printf("status %d\n", st); return 1; }
    for (int b = 0; b < batch; ++b) for (int64_t m = 0; m < M; ++m) {
      int h = m / T, t = m % T; double mx = -1e300; std::vector<double> s(seq); std::vector<char> vis(seq);
      bool any = false;
      for (int64_t r = 0; r < seq; ++r) {
        vis[r] = use_mask ? mask[b * strides[0] + h * strides[1] + t * strides[2] + r] : (r <= seq - T + t);
        double d = 0; for (int k = 0; k < dim; ++k) d += (double)q[(b * M + m) * dim + k] * latf[(b * cap + r) * dim + k];
        s[r] = 0.2 * d; if (vis[r]) { any = true; mx = std::max(mx, s[r]); }
      }
      std::vector<double> o(vdim, 0.0); double tot = 0;
      for (int64_t r = 0; r < seq; ++r) { double w = any ? (vis[r] ? std::exp(s[r] - mx) : 0.0) : 1.0; tot += w; for (int k = 0; k < vdim; ++k) o[k] += w * latf[(b * cap + r) * dim + k]; }
      for (int k = 0; k < vdim; ++k) { double want = o[k] / tot, got = out[(b * M + m) * vdim + k];
        if (!(std::fabs(want - got) <= 1e-4 * (1 + std::fabs(want)))) { if (bad++ < 5) printf("it %d b %d m %ld k %d want %g got %g (seq %ld dim %d vdim %d T %d mask %d bf %d thr %d)\n", it, b, (long)m, k, want, got, (long)seq, dim, vdim, T, use_mask, bf, threads); } }
    }
  }
  printf("done, bad %d\n", bad);
  return bad != 0;
}
