// MLA's absorbed attention over the cached latent in one pass (as flash-decoding does): for each query row m of
// [B, M, D] and the latent [B, S, D],
//   out[m] = sum_s softmax_s(scale q_m . c_s) c_s[:value_dim],
// the M rows head-major over T new tokens, the latent's last T (query m is token t = m % T and sees the rows
// s <= S - T + t). Two passes (the logits as one product, the softmax, then the probabilities times the latent) read
// the latent twice, and torch's skinny products (a few query rows against a long latent) run far below the memory
// bandwidth: this reads each latent row once, kTile rows at a time, and keeps them in cache for both the logits and
// the weighted sum. Each thread takes a part of the rows with its own running maximum, sum and accumulator (the
// online softmax); the parts are merged at the end by their maxima. fp32 throughout (bf16 latents are read
// exactly as fp32); the exponentials are fast_exp's (~1 ulp). With a boolean mask ([B, heads, T, S], broadcast
// where a stride is 0) the mask alone says which rows each query sees, and a tile of rows no query sees is skipped.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "simd.h"

namespace {

constexpr int kTile = 32;          // latent rows whose logits and weighted sum are computed together
constexpr int kBlock = 4;          // query rows per pass over a latent row (their accumulators in registers)
constexpr int64_t kMinPart = 512;  // latent rows per thread's part at least
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// scores[j * kTile + i] = q_j . rows[i] for the kBlock query rows at q (row stride dim), n latent rows
template <typename T>
void block_logits(const T* rows, int n, int dim, const float* q, float* scores) {
#if K3_HAVE_SIMD
  using namespace k3::simd;
  for (int i = 0; i < n; ++i) {
    const T* row = rows + (int64_t)i * dim;
    vf a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
    int d = 0;
    for (; d + kLanes <= dim; d += kLanes) {
      const vf v = load(row + d);
      a0 = fmadd(load(q + d), v, a0);
      a1 = fmadd(load(q + dim + d), v, a1);
      a2 = fmadd(load(q + 2 * dim + d), v, a2);
      a3 = fmadd(load(q + 3 * dim + d), v, a3);
    }
    if (d < dim) {
      const uint16_t m = k3::lane_mask(dim - d);
      const vf v = load(row + d, m);
      a0 = fmadd(load(q + d, m), v, a0);
      a1 = fmadd(load(q + dim + d, m), v, a1);
      a2 = fmadd(load(q + 2 * dim + d, m), v, a2);
      a3 = fmadd(load(q + 3 * dim + d, m), v, a3);
    }
    scores[i] = reduce_add(a0);
    scores[kTile + i] = reduce_add(a1);
    scores[2 * kTile + i] = reduce_add(a2);
    scores[3 * kTile + i] = reduce_add(a3);
  }
#else
  for (int j = 0; j < kBlock; ++j)
    for (int i = 0; i < n; ++i) {
      const T* row = rows + (int64_t)i * dim;
      float s = 0.0f;
      for (int d = 0; d < dim; ++d) s += q[(int64_t)j * dim + d] * k3::to_float(row[d]);
      scores[j * kTile + i] = s;
    }
#endif
}

// acc_j[:value_dim] += sum_i p[j * kTile + i] rows[i][:value_dim] for the kBlock rows of acc (row stride value_dim)
template <typename T>
void block_values(const T* rows, int n, int dim, int value_dim, const float* p, float* acc) {
#if K3_HAVE_SIMD
  using namespace k3::simd;
  for (int d = 0; d < value_dim; d += kLanes) {
    const uint16_t m = k3::lane_mask(value_dim - d);
    vf a0 = load(acc + d, m), a1 = load(acc + value_dim + d, m), a2 = load(acc + 2 * value_dim + d, m),
       a3 = load(acc + 3 * value_dim + d, m);
    for (int i = 0; i < n; ++i) {
      const vf v = m == 0xFFFF ? load(rows + (int64_t)i * dim + d) : load(rows + (int64_t)i * dim + d, m);
      a0 = fmadd(splat(p[i]), v, a0);
      a1 = fmadd(splat(p[kTile + i]), v, a1);
      a2 = fmadd(splat(p[2 * kTile + i]), v, a2);
      a3 = fmadd(splat(p[3 * kTile + i]), v, a3);
    }
    store(acc + d, m, a0);
    store(acc + value_dim + d, m, a1);
    store(acc + 2 * value_dim + d, m, a2);
    store(acc + 3 * value_dim + d, m, a3);
  }
#else
  for (int j = 0; j < kBlock; ++j)
    for (int i = 0; i < n; ++i) {
      const float w = p[j * kTile + i];
      const T* row = rows + (int64_t)i * dim;
      for (int d = 0; d < value_dim; ++d) acc[(int64_t)j * value_dim + d] += w * k3::to_float(row[d]);
    }
#endif
}

// A boolean mask over the latent rows, [B, heads, T, S] by strides (0 for a broadcast dimension; the rows' stride
// 1), or none (end-aligned causality over the new tokens).
struct Mask {
  const uint8_t* data = nullptr;
  int64_t batch = 0, head = 0, token = 0;
};

// Rows [first, first + count) of one batch's latent against its padded query rows: running maxima, sums and
// accumulators ([m_pad], [m_pad], [m_pad, value_dim]) of the online softmax, and whether each query saw a row
// ([m_pad], 0 or 1: a query whose logits are all -inf saw rows, one the mask leaves none did not). `mask`: that
// batch's (or null).
template <typename T>
void attend_part(const T* latent, int64_t first, int64_t count, int64_t seq, const float* q, int64_t m_rows,
                 int64_t m_pad, int dim, int value_dim, int new_tokens, const Mask& mask, float scale, float* mx,
                 float* sum, float* acc, float* saw, float* scores) {
  std::fill(mx, mx + m_pad, kNegInf);
  std::fill(saw, saw + m_pad, 0.0f);
  std::fill(sum, sum + m_pad, 0.0f);
  std::fill(acc, acc + m_pad * value_dim, 0.0f);
  auto mask_row = [&](int64_t j) {  // query row j's mask over the latent rows
    return mask.data + (j / new_tokens) * mask.head + (j % new_tokens) * mask.token;
  };
  for (int64_t t0 = 0; t0 < count; t0 += kTile) {
    const int n = (int)std::min<int64_t>(kTile, count - t0);
    const int64_t s0 = first + t0;
    if (mask.data) {  // a tile no query sees is not read (a static cache's slots past its tokens)
      bool seen = false;
      for (int64_t j = 0; j < m_rows && !seen; ++j) {
        const uint8_t* row = mask_row(j) + s0;
        for (int i = 0; i < n; ++i) seen |= row[i] != 0;
      }
      if (!seen) continue;
    }
    const T* rows = latent + s0 * dim;
    for (int64_t j = 0; j < m_pad; j += kBlock) block_logits(rows, n, dim, q + j * dim, scores + j * kTile);
    for (int64_t j = 0; j < m_rows; ++j) {
      float* sc = scores + j * kTile;
      int visible = n;
      if (mask.data) {
        const uint8_t* row = mask_row(j) + s0;
        bool any = false;
        for (int i = 0; i < n; ++i) {
          sc[i] = row[i] ? sc[i] * scale : kNegInf;
          any |= row[i] != 0;
        }
        if (!any) visible = 0;
      } else {
        // the last row this query sees (end-aligned causality over the new tokens)
        const int64_t last = seq - new_tokens + j % new_tokens;
        visible = (int)std::max<int64_t>(0, std::min<int64_t>(n, last - s0 + 1));
        for (int i = 0; i < visible; ++i) sc[i] *= scale;
      }
      float tile_max = kNegInf;  // (a NaN sticks: it reaches the sum and the output, as in torch)
      for (int i = 0; i < visible; ++i) tile_max = sc[i] > tile_max || std::isnan(sc[i]) ? sc[i] : tile_max;
      if (visible > 0) saw[j] = 1.0f;
      if (visible == 0 || tile_max == kNegInf) {  // (nothing seen in this tile, or weights of 0 only)
        std::fill(sc, sc + kTile, 0.0f);
        continue;
      }
      // (a NaN tile keeps a finite maximum, so that the merge takes this part's NaN sum)
      const float new_max = std::isnan(tile_max) ? (mx[j] == kNegInf ? 0.0f : mx[j]) : std::max(mx[j], tile_max);
      if (new_max > mx[j]) {
        const float alpha = mx[j] == kNegInf ? 0.0f : k3::fast_exp(mx[j] - new_max);
        sum[j] *= alpha;
        float* a = acc + j * value_dim;
        for (int d = 0; d < value_dim; ++d) a[d] *= alpha;
        mx[j] = new_max;
      }
      // (a masked logit is -inf: its exponential, below fast_exp's range, is exactly 0)
      for (int i = 0; i < visible; ++i) sc[i] = k3::fast_exp(sc[i] - new_max);
      float total = 0.0f;
      for (int i = 0; i < visible; ++i) total += sc[i];
      sum[j] += total;
      std::fill(sc + visible, sc + kTile, 0.0f);
    }
    for (int64_t j = m_rows; j < m_pad; ++j) std::fill(scores + j * kTile, scores + (j + 1) * kTile, 0.0f);
    for (int64_t j = 0; j < m_pad; j += kBlock)
      block_values(rows, n, dim, value_dim, scores + j * kTile, acc + j * value_dim);
  }
}

template <typename T>
int latent_attention(const T* latent, int64_t batch_stride, const float* queries, int64_t batch, int64_t seq,
                     int64_t m_rows, int dim, int value_dim, int new_tokens, const Mask& mask, float scale,
                     float* out, int n_threads) {
  const int64_t m_pad = (m_rows + kBlock - 1) / kBlock * kBlock;
  const int64_t by_threads = (n_threads + batch - 1) / batch;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(by_threads, seq / kMinPart));
  const int64_t part_rows = (seq + parts - 1) / parts;
  const int64_t state = m_pad * (3 + value_dim);  // a part's maxima, sums, accumulators and rows-seen flags
  std::vector<float> q_pad, states;
  try {
    q_pad.assign(batch * m_pad * dim, 0.0f);
    states.resize(batch * parts * state);
  } catch (const std::bad_alloc&) {
    return 2;
  }
  for (int64_t b = 0; b < batch; ++b)
    std::memcpy(q_pad.data() + b * m_pad * dim, queries + b * m_rows * dim, sizeof(float) * m_rows * dim);
  int status = 0;
#pragma omp parallel for num_threads(n_threads) schedule(static)
  for (int64_t task = 0; task < batch * parts; ++task) {
    const int64_t b = task / parts, part = task % parts;
    const int64_t first = part * part_rows, count = std::max<int64_t>(0, std::min(part_rows, seq - first));
    float* st = states.data() + task * state;
    std::vector<float> scores;
    try {
      scores.resize(m_pad * kTile);
    } catch (const std::bad_alloc&) {
#pragma omp atomic write
      status = 2;
      continue;
    }
    Mask batch_mask = mask;
    if (mask.data) batch_mask.data = mask.data + b * mask.batch;
    attend_part(latent + b * batch_stride, first, count, seq, q_pad.data() + b * m_pad * dim, m_rows, m_pad, dim,
                value_dim, new_tokens, batch_mask, scale, st, st + m_pad, st + 2 * m_pad,
                st + (2 + value_dim) * m_pad, scores.data());
  }
  if (status) return status;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < m_rows; ++j) {
      float top = kNegInf;
      bool saw = false;
      for (int64_t part = 0; part < parts; ++part) {
        const float* st = states.data() + (b * parts + part) * state;
        top = std::max(top, st[j]);
        saw |= st[(2 + value_dim) * m_pad + j] != 0.0f;
      }
      float* o = out + (b * m_rows + j) * value_dim;
      std::fill(o, o + value_dim, 0.0f);
      if (saw && top == kNegInf) {  // rows seen, every logit -inf: NaN, as torch's softmax gives
        std::fill(o, o + value_dim, NAN);
        continue;
      }
      if (!saw) {
        // A query the mask leaves no row: the mean of every row, as the two passes give (their masked logits are
        // the dtype's lowest, all equal: a uniform softmax), not a NaN.
        const T* rows = latent + b * batch_stride;
        for (int64_t s = 0; s < seq; ++s)
          for (int d = 0; d < value_dim; ++d) o[d] += k3::to_float(rows[s * dim + d]);
        for (int d = 0; d < value_dim; ++d) o[d] /= (float)seq;
        continue;
      }
      float total = 0.0f;
      for (int64_t part = 0; part < parts; ++part) {
        const float* st = states.data() + (b * parts + part) * state;
        if (st[j] == kNegInf) continue;  // (a part this query sees none of)
        const float w = k3::fast_exp(st[j] - top);
        total += w * st[m_pad + j];
        const float* a = st + 2 * m_pad + j * value_dim;
        for (int d = 0; d < value_dim; ++d) o[d] += w * a[d];
      }
      const float inv = 1.0f / total;
      for (int d = 0; d < value_dim; ++d) o[d] *= inv;
    }
  return 0;
}

}  // namespace

extern "C" int k3_latent_attention(const void* latent, int latent_bf16, int64_t batch_stride, const float* queries,
                                   int64_t batch, int64_t seq, int64_t m_rows, int dim, int value_dim,
                                   int new_tokens, const uint8_t* mask, const int64_t* mask_strides, float scale,
                                   float* out, int n_threads) {
  if (batch < 0 || seq < 1 || m_rows < 1 || dim < 1 || value_dim < 1 || value_dim > dim || new_tokens < 1 ||
      new_tokens > seq || m_rows % new_tokens != 0 || batch_stride < seq * dim || n_threads < 1 ||
      (mask && !mask_strides))
    return 1;
  if (batch == 0) return 0;
  Mask m;
  if (mask) m = Mask{mask, mask_strides[0], mask_strides[1], mask_strides[2]};
  if (latent_bf16)
    return latent_attention(static_cast<const uint16_t*>(latent), batch_stride, queries, batch, seq, m_rows, dim,
                            value_dim, new_tokens, m, scale, out, n_threads);
  return latent_attention(static_cast<const float*>(latent), batch_stride, queries, batch, seq, m_rows, dim,
                          value_dim, new_tokens, m, scale, out, n_threads);
}
