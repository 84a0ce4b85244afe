// Batch-invariant attention of many sessions' rows in one call (specdec/attention_kernel.py).
//
// Every (row, query head) is computed on its own, in a fixed order: its scores over the keys it sees,
// in key order; a float32 softmax; the values summed in key order. No row's arithmetic depends on
// how many rows, sessions or threads share the call, so a position gets the same bits alone, in a
// chain, as a tree node (its ancestors' keys, the same numbers in the same order) or beside other
// sessions. Dot products run in fixed lanes (kLanes partial sums, then a fixed tree); with AVX-512
// the lanes are one register, the value sums stay in registers and exp runs 16 lanes at a time, every
// lane alike.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

// 16 elements from src as float32. A bfloat16 widens exactly (its bits are a float32's upper half),
// in a register: the kernel reads a bfloat16 cache's keys and values where they lie, with the very
// values a widened float32 copy would hold, so the sums below do not change by a bit.
#if defined(__AVX512F__)
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }
inline __m512 load16(const c10::BFloat16* src) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// Fixed-lane dot product of a float row and a row of K (float32, or bfloat16 read in place): kLanes
// partial sums, then a fixed tree (lanes l and l + 8, then l + 4, l + 2, l + 1), the order
// _mm512_reduce_add_ps adds in.
template <typename K>
inline float dot(const float* a, const K* b, int64_t dim) {
#if defined(__AVX512F__)
  if (dim % kLanes == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += kLanes) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), load16(b + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float lanes[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[d + l] * static_cast<float>(b[d + l]);
  }
  for (int64_t l = 0; d + l < dim; ++l) lanes[l] += a[d + l] * static_cast<float>(b[d + l]);
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

#if defined(__AVX512F__)
// The sums of 16 registers' lanes, lane j of the result holding _mm512_reduce_add_ps(acc[j]) to the
// bit: the same pairs added in the same tree (lanes l and l + 8, then l + 4, then l + 2, then l + 1),
// only for 16 registers at once, so that each level is one add for many keys instead of a chain of
// shuffles per key. Adds commute bit for bit; only the pairing matters, and it is the reduce's.
inline __m512 reduce16(const __m512* acc) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) {  // keys 2i, 2i + 1: lanes l + (l + 8), eight a key
    const __m512 a = acc[2 * i], b = acc[2 * i + 1];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)));
  }
  for (int i = 0; i < 4; ++i) {  // keys 4i .. 4i + 3, a 128-bit lane each: l + (l + 4)
    const __m512 a = halves[2 * i], b = halves[2 * i + 1];
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)),
                                _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
  }
  for (int i = 0; i < 2; ++i) {  // lane c: keys 8i + c, 8i + 4 + c, two sums each: l + (l + 2)
    const __m512 a = quarters[2 * i], b = quarters[2 * i + 1];
    eighths[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)),
                               _mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)));
  }
  // Lane c, element m: key 4m + c's total (l + (l + 1)); the permutation puts key j at element j.
  const __m512 totals = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, totals);
}

// out[j] = dot(a, b + j stride, dim) for j = 0 .. 15, bit for bit, for dim a multiple of kLanes: the
// same multiply-adds per key in the same order, then one shared reduction tree (reduce16).
template <typename K>
inline void dot16(const float* a, const K* b, int64_t stride, int64_t dim, float* out) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += kLanes) {
    const __m512 x = _mm512_loadu_ps(a + d);
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(x, load16(b + j * stride + d), acc[j]);
  }
  _mm512_storeu_ps(out, reduce16(acc));
}
#endif

// x[j] = exp(x[j] - top) for j < count, reading and writing x up to the next multiple of kLanes (the
// caller's buffer has the room). With AVX-512 every element goes through the same 16-lane code, a
// tail included, so a key's weight never depends on where it falls in a row: Cephes' expf (range
// reduction by ln 2 in two parts, a degree-5 polynomial, exact scaling by 2^n), about 1 ulp.
inline void exp_shifted(float* x, int64_t count, float top) {
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(top), lowest = _mm512_set1_ps(-88.f), log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f), one = _mm512_set1_ps(1.f);
  for (int64_t j = 0; j < count; j += kLanes) {
    const __m512 v = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), shift), lowest);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, ln2_lo, _mm512_fnmadd_ps(n, ln2_hi, v));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), one);
    _mm512_storeu_ps(x + j, _mm512_scalef_ps(y, n));
  }
#else
  for (int64_t j = 0; j < count; ++j) x[j] = std::exp(x[j] - top);
#endif
}

// out[h dim + d] = sum over visible keys t, in key order, of weights[h row + t] * values[t stride + d]
// for H heads h at once (float32 values, or bfloat16 read in place): each element a chain of
// multiply-adds in key order, the chains of H heads' 16-lane blocks in registers side by side, each
// key's values loaded once for all H.
template <int H, int B, typename V>
inline void weighted_sums_avx(const float* weights, int64_t row, const V* values, int64_t stride, int64_t first,
                              int64_t last, const bool* visible, float* out, int64_t dim) {
#if defined(__AVX512F__)
  __m512 acc[H][B];
  for (int h = 0; h < H; ++h)
    for (int b = 0; b < B; ++b) acc[h][b] = _mm512_setzero_ps();
  for (int64_t t = first; t <= last; ++t) {
    if (visible != nullptr && !visible[t]) continue;
    const V* v = values + t * stride;
    __m512 x[B];
    for (int b = 0; b < B; ++b) x[b] = load16(v + b * kLanes);
    for (int h = 0; h < H; ++h) {
      const __m512 w = _mm512_set1_ps(weights[h * row + t]);
      for (int b = 0; b < B; ++b) acc[h][b] = _mm512_fmadd_ps(w, x[b], acc[h][b]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + h * dim + b * kLanes, acc[h][b]);
#endif
}

// weighted_sums_avx for `heads` heads, at most kHeadsAtOnce (64-wide heads; half as many 128-wide) at a
// time, so every accumulator stays in a register; other widths (or no AVX-512) one element at a time,
// in the same order.
constexpr int kHeadsAtOnce = 4;
template <typename V>
inline void weighted_sums(const float* weights, int64_t row, const V* values, int64_t stride, int64_t first,
                          int64_t last, const bool* visible, int64_t heads, int64_t dim, float* out) {
#if defined(__AVX512F__)
  if (dim == 64 || dim == 128) {
    const int64_t step = dim == 64 ? kHeadsAtOnce : kHeadsAtOnce / 2;
    for (int64_t h = 0; h < heads; h += step) {
      const float* w = weights + h * row;
      float* o = out + h * dim;
      const int64_t n = std::min(step, heads - h);
      if (dim == 64) {
        if (n == 4) weighted_sums_avx<4, 4>(w, row, values, stride, first, last, visible, o, dim);
        if (n == 3) weighted_sums_avx<3, 4>(w, row, values, stride, first, last, visible, o, dim);
        if (n == 2) weighted_sums_avx<2, 4>(w, row, values, stride, first, last, visible, o, dim);
        if (n == 1) weighted_sums_avx<1, 4>(w, row, values, stride, first, last, visible, o, dim);
      } else {
        if (n == 2) weighted_sums_avx<2, 8>(w, row, values, stride, first, last, visible, o, dim);
        if (n == 1) weighted_sums_avx<1, 8>(w, row, values, stride, first, last, visible, o, dim);
      }
    }
    return;
  }
#endif
  for (int64_t h = 0; h < heads; ++h) {
    float* o = out + h * dim;
    std::fill(o, o + dim, 0.f);
    for (int64_t t = first; t <= last; ++t) {
      if (visible != nullptr && !visible[t]) continue;
      const float w = weights[h * row + t];
      const V* v = values + t * stride;
      for (int64_t d = 0; d < dim; ++d) o[d] = std::fma(w, static_cast<float>(v[d]), o[d]);
    }
  }
}

template <typename T>
inline void widen(const T* src, float* dst, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
}

struct Session {
  const void* keys;    // [Hkv, T, hd] at strides (key_head, key_row, 1)
  const void* values;  // the same layout
  int64_t key_head, key_row, value_head, value_row;
  int64_t length;      // T: keys the session holds, its new rows' included
  int64_t lo, hi;      // its rows in q and out
  const bool* mask;    // [hi - lo, T] row-major, or null: causal, the rows being the last keys
};

// Reads its keys and values where they lie (bfloat16 or float32), or from a float32 copy (half, double).
template <typename T>
constexpr bool kInPlace = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>;

// score[t] *= scale for the visible keys t in [first, last]; returns the largest (max is exact, so
// its order changes nothing).
inline float scale_and_max(float* score, int64_t first, int64_t last, const bool* visible, float scale) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t t = first;
#if defined(__AVX512F__)
  if (visible == nullptr) {
    const __m512 factor = _mm512_set1_ps(scale);
    __m512 tops = _mm512_set1_ps(top);
    for (; t + kLanes <= last + 1; t += kLanes) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(score + t), factor);
      _mm512_storeu_ps(score + t, x);
      tops = _mm512_max_ps(tops, x);
    }
    top = _mm512_reduce_max_ps(tops);
  }
#endif
  for (; t <= last; ++t) {
    if (visible != nullptr && !visible[t]) continue;
    score[t] *= scale;
    top = std::max(top, score[t]);
  }
  return top;
}

// Each of the H heads' sum over its visible keys of weights[h row + t], in key order: H chains of
// adds, side by side.
template <int H>
inline void key_totals(const float* weights, int64_t row, int64_t first, int64_t last, const bool* visible,
                       float* totals) {
  float sum[H] = {};
  for (int64_t t = first; t <= last; ++t) {
    if (visible != nullptr && !visible[t]) continue;
    for (int h = 0; h < H; ++h) sum[h] += weights[h * row + t];
  }
  for (int h = 0; h < H; ++h) totals[h] = sum[h];
}

// Row r of a session under one key head, its per_group query heads in query (float32), each head on its
// own: scores over the keys it sees in key order, a float32 softmax over the visible ones, values
// summed in key order, into acc. Keys and values lie at rows of key_stride / value_stride elements.
// The heads share the loops (their scores side by side in `scores`) only so that their independent
// chains overlap in the core; no head's arithmetic changes.
template <typename K>
void attend_row(const float* query, const K* keys, int64_t key_stride, const K* values, int64_t value_stride,
                int64_t first, int64_t last, const bool* visible, int64_t per_group, int64_t dim, float scale,
                std::vector<float>& scores, float* acc) {
  const int64_t row = last + 1 + kLanes;  // a head's scores, with room for exp_shifted's last lanes
  scores.resize(per_group * (row + 1));
  float* totals = scores.data() + per_group * row;
  int64_t t = first;
#if defined(__AVX512F__)
  // Scores 16 keys at a time (those a mask hides too: computed, never read). A bfloat16 block is
  // widened once into `block` for all the group's heads: the same float32 values each head's dot16
  // would widen for itself, so no score changes by a bit.
  if (dim % kLanes == 0) {
    alignas(64) float block[16 * 128];
    const bool widen_once = !std::is_same_v<K, float> && per_group > 1 && dim <= 128;
    for (; t + 16 <= last + 1; t += 16) {
      if (widen_once) {
        for (int j = 0; j < 16; ++j) {
          const K* key = keys + (t + j) * key_stride;
          for (int64_t d = 0; d < dim; d += kLanes) _mm512_store_ps(block + j * dim + d, load16(key + d));
        }
        for (int64_t p = 0; p < per_group; ++p) dot16(query + p * dim, block, dim, dim, scores.data() + p * row + t);
      } else {
        for (int64_t p = 0; p < per_group; ++p)
          dot16(query + p * dim, keys + t * key_stride, key_stride, dim, scores.data() + p * row + t);
      }
    }
  }
#endif
  for (int64_t p = 0; p < per_group; ++p) {
    const float* qp = query + p * dim;
    float* score = scores.data() + p * row;
    for (int64_t u = t; u <= last; ++u) {
      if (visible == nullptr || visible[u]) score[u] = dot(qp, keys + u * key_stride, dim);
    }
    const float top = scale_and_max(score, first, last, visible, scale);
    if (last >= first) exp_shifted(score + first, last - first + 1, top);
  }
  for (int64_t p = 0; p < per_group; p += 4) {
    const int64_t n = std::min<int64_t>(4, per_group - p);
    const float* w = scores.data() + p * row;
    if (n == 4) key_totals<4>(w, row, first, last, visible, totals + p);
    if (n == 3) key_totals<3>(w, row, first, last, visible, totals + p);
    if (n == 2) key_totals<2>(w, row, first, last, visible, totals + p);
    if (n == 1) key_totals<1>(w, row, first, last, visible, totals + p);
  }
  for (int64_t p = 0; p < per_group; ++p) {
    float* score = scores.data() + p * row;
    const float total = totals[p];
    if (visible == nullptr) {
      for (int64_t t = first; t <= last; ++t) score[t] /= total;
    } else {
      for (int64_t t = first; t <= last; ++t) {
        if (visible[t]) score[t] /= total;
      }
    }
  }
  weighted_sums(scores.data(), row, values, value_stride, first, last, visible, per_group, dim, acc);
}

// A work item is one row of one session under one key head: items of one size keep the two halves
// of at::parallel_for's static split even (four rows an item, sharing one widening of their keys, ran
// slower on two threads).
template <typename T>
void attend(const at::Tensor& q, const std::vector<Session>& sessions, const std::vector<int64_t>& first_item,
            int64_t groups, double scale_, at::Tensor& out) {
  const int64_t heads = q.size(1), dim = q.size(2), per_group = heads / groups;
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const T* q_data = q.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const float scale = static_cast<float>(scale_);
  const int64_t items = first_item.back();
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(per_group * dim), acc(per_group * dim), keys, values, scores;
    int64_t s = 0;
    for (int64_t item = begin; item < end; ++item) {
      while (first_item[s + 1] <= item) ++s;
      const Session& session = sessions[s];
      const int64_t local = item - first_item[s];
      const int64_t n = session.hi - session.lo, g = local % groups, r = local / groups;
      // The row's visible keys lie in [first, last]; a mask may hide some between.
      const bool* visible = session.mask == nullptr ? nullptr : session.mask + r * session.length;
      int64_t first = 0, last = session.length - n + r;
      if (visible != nullptr) {
        while (first < session.length && !visible[first]) ++first;
        last = session.length - 1;
        while (last >= 0 && !visible[last]) --last;
      }
      const int64_t span = last + 1;
      for (int64_t p = 0; p < per_group; ++p) {
        widen(q_data + (session.lo + r) * q_row + (g * per_group + p) * q_head, &query[p * dim], dim);
      }
      const T* key_src = static_cast<const T*>(session.keys) + g * session.key_head;
      const T* value_src = static_cast<const T*>(session.values) + g * session.value_head;
      if constexpr (kInPlace<T>) {
        attend_row(query.data(), key_src, session.key_row, value_src, session.value_row, first, last, visible,
                   per_group, dim, scale, scores, acc.data());
      } else {
        keys.resize(span * dim);
        values.resize(span * dim);
        for (int64_t t = 0; t < span; ++t) {
          widen(key_src + t * session.key_row, &keys[t * dim], dim);
          widen(value_src + t * session.value_row, &values[t * dim], dim);
        }
        attend_row(query.data(), keys.data(), dim, values.data(), dim, first, last, visible, per_group, dim, scale,
                   scores, acc.data());
      }
      T* dst = out_data + (session.lo + r) * heads * dim + g * per_group * dim;
      for (int64_t j = 0; j < per_group * dim; ++j) dst[j] = static_cast<T>(acc[j]);
    }
  });
}

}  // namespace

// Writes session i's new keys and values, rows bounds[i] .. bounds[i + 1] of new_keys / new_values
// [1, Hkv, N, hd], into its buffers at the last n_i of its lengths[i] positions.
template <typename T>
void write_new(const at::Tensor& new_keys, const at::Tensor& new_values, const std::vector<Session>& sessions) {
  const int64_t groups = new_keys.size(1), dim = new_keys.size(3);
  for (const Session& session : sessions) {
    const int64_t n = session.hi - session.lo, past = session.length - n;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t j = 0; j < n; ++j) {
        const T* k = new_keys.data_ptr<T>() + g * new_keys.stride(1) + (session.lo + j) * new_keys.stride(2);
        const T* v = new_values.data_ptr<T>() + g * new_values.stride(1) + (session.lo + j) * new_values.stride(2);
        T* key = const_cast<T*>(static_cast<const T*>(session.keys)) + g * session.key_head + (past + j) * session.key_row;
        T* value =
            const_cast<T*>(static_cast<const T*>(session.values)) + g * session.value_head + (past + j) * session.value_row;
        std::copy(k, k + dim, key);
        std::copy(v, v + dim, value);
      }
    }
  }
}

// q [N, Hq, hd] (last dim contiguous); keys[i], values[i] [1, Hkv, C_i, hd] (last dim contiguous), of
// which session i sees the first lengths[i]; bounds [S + 1]: session i's rows are bounds[i] ..
// bounds[i + 1]; masks[i] bool [n_i, lengths[i]] or None (causal, its rows the last of its keys).
// With new_keys / new_values [1, Hkv, N, hd], each session's rows' keys and values are first written
// into its buffers (the last n_i of its lengths[i]). Writes out [N, Hq hd] (contiguous).
void ragged_attention(const at::Tensor& q, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      const std::vector<int64_t>& bounds, const std::vector<int64_t>& lengths,
                      const std::vector<std::optional<at::Tensor>>& masks, double scale, at::Tensor& out,
                      const std::optional<at::Tensor>& new_keys, const std::optional<at::Tensor>& new_values) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [N, Hq, hd] with contiguous rows of hd");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == q.scalar_type() && out.size(0) >= q.size(0),
              "out must be contiguous, of q's dtype, with a row per query row");
  const int64_t count = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == count && static_cast<int64_t>(masks.size()) == count &&
                  static_cast<int64_t>(lengths.size()) == count && static_cast<int64_t>(bounds.size()) == count + 1,
              "one key, value, length and mask per session, and bounds around them");
  TORCH_CHECK(count == 0 || bounds[count] <= q.size(0), "bounds past q's rows");
  TORCH_CHECK(new_keys.has_value() == new_values.has_value(), "new keys and new values come together");
  const int64_t groups = count ? keys[0].size(1) : 1;
  std::vector<Session> sessions;
  std::vector<int64_t> first_item{0};
  sessions.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    const at::Tensor& k = keys[i];
    const at::Tensor& v = values[i];
    TORCH_CHECK(k.dim() == 4 && k.size(0) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && k.sizes() == v.sizes(),
                "keys and values must be [1, Hkv, T, hd] with contiguous rows of hd");
    TORCH_CHECK(k.size(1) == groups && k.size(3) == q.size(2) && q.size(1) % groups == 0,
                "every session's key heads must divide the query heads, at q's head width");
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "keys of q's dtype");
    const int64_t n = bounds[i + 1] - bounds[i];
    TORCH_CHECK(n >= 0 && lengths[i] >= n && lengths[i] <= k.size(2), "a session needs its rows among its keys");
    const bool* mask = nullptr;
    if (masks[i].has_value()) {
      const at::Tensor& m = *masks[i];
      TORCH_CHECK(m.scalar_type() == at::kBool && m.is_contiguous() && m.dim() == 2 && m.size(0) == n &&
                      m.size(1) == lengths[i],
                  "a mask must be contiguous bool [rows, keys]");
      mask = m.data_ptr<bool>();
    }
    sessions.push_back(Session{k.data_ptr(), v.data_ptr(), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
                               lengths[i], bounds[i], bounds[i + 1], mask});
    first_item.push_back(first_item.back() + n * groups);
  }
  if (new_keys.has_value()) {
    const at::Tensor& nk = *new_keys;
    const at::Tensor& nv = *new_values;
    TORCH_CHECK(nk.dim() == 4 && nk.size(0) == 1 && nk.size(1) == groups && nk.size(3) == q.size(2) &&
                    nk.stride(3) == 1 && nv.sizes() == nk.sizes() && nv.stride(3) == 1 &&
                    nk.scalar_type() == q.scalar_type() && nv.scalar_type() == q.scalar_type() &&
                    (count == 0 || nk.size(2) >= bounds[count]),
                "new keys and values must be [1, Hkv, N, hd] of q's dtype, with contiguous rows of hd");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "write_new", [&] {
      write_new<scalar_t>(nk, nv, sessions);
    });
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "ragged_attention", [&] {
    attend<scalar_t>(q, sessions, first_item, groups, scale, out);
  });
}

// What a compiled pass's attention op reads, set once a pass (``set_pass``) instead of being decoded
// from Python objects at each of its layers: every layer's sessions' key and value buffers (room for
// the pass's rows already claimed), masks and scale, and the sessions' rows and lengths.
struct PassLayer {
  std::vector<at::Tensor> keys, values;
  std::vector<std::optional<at::Tensor>> masks;
  double scale;
};

struct PassContext {
  std::vector<int64_t> bounds, lengths;
  std::vector<PassLayer> layers;
};

// By runner (a compiled pass's index). Thread-local: a pass's graph runs its ops on the thread that
// called it, and a second thread's pass (a compile beside serving) keeps a context of its own.
thread_local std::unordered_map<int64_t, PassContext> passes;

void set_pass(int64_t runner, const std::vector<std::vector<at::Tensor>>& keys,
              const std::vector<std::vector<at::Tensor>>& values, const std::vector<int64_t>& bounds,
              const std::vector<int64_t>& lengths, const std::vector<std::vector<std::optional<at::Tensor>>>& masks,
              const std::vector<double>& scales) {
  const size_t layers = keys.size();
  TORCH_CHECK(values.size() == layers && masks.size() == layers && scales.size() == layers,
              "set_pass: keys, values, masks and scales for every layer");
  PassContext context{bounds, lengths, {}};
  context.layers.reserve(layers);
  for (size_t i = 0; i < layers; ++i) context.layers.push_back(PassLayer{keys[i], values[i], masks[i], scales[i]});
  passes[runner] = std::move(context);
}

void clear_pass(int64_t runner) { passes.erase(runner); }

// Layer `layer` of runner `runner`'s pass: its rows' queries q [1, Hq, P, hd] attend over their
// sessions' caches after their keys and values k, v [1, Hkv, P, hd] are written there; rows past the
// sessions' (a compiled pass's padding) come back as zeros. Returns [P, Hq hd].
at::Tensor layer_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t runner,
                           int64_t layer) {
  const auto found = passes.find(runner);
  TORCH_CHECK(found != passes.end(), "layer_attention: runner ", runner, " has no pass in progress on this thread");
  const PassContext& context = found->second;
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(context.layers.size()), "layer_attention: no layer ", layer);
  const PassLayer& at_layer = context.layers[layer];
  const int64_t padded = q.size(2), rows = context.bounds.back();
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && rows <= padded, "layer_attention: q must be [1, Hq, P, hd]");
  const std::vector<int64_t> shape{padded, q.size(1) * q.size(3)};
  at::Tensor out = rows == padded ? at::empty(shape, q.options()) : at::zeros(shape, q.options());
  ragged_attention(q[0].narrow(1, 0, rows).transpose(0, 1), at_layer.keys, at_layer.values, context.bounds,
                   context.lengths, at_layer.masks, at_layer.scale, out, k, v);
  return out;
}

TORCH_LIBRARY(specdec_attention, m) {
  m.def("layer_attention(Tensor q, Tensor k, Tensor v, int runner, int layer) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_attention, CPU, m) { m.impl("layer_attention", &layer_attention); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ragged_attention", &ragged_attention, "batch-invariant attention of many sessions' rows");
  m.def("set_pass", &set_pass, "the caches, rows and masks a compiled pass's layer_attention ops read");
  m.def("clear_pass", &clear_pass, "forgets a compiled pass's set_pass");
}
