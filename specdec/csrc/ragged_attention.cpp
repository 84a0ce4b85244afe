// Batch-invariant attention of many sessions' rows in one call (specdec/attention_kernel.py).
//
// Every (row, key head) is one work item computed on its own, in a fixed order: its query heads'
// scores over the keys it sees, in key order; a float32 softmax; the values summed in key order. No
// item's arithmetic depends on how many rows, sessions or threads share the call, so a position gets
// the same bits alone, in a chain, as a tree node (its ancestors' keys, the same numbers in the same
// order) or beside other sessions. Dot products run in fixed lanes (kLanes partial sums, then a fixed
// tree), which the compiler vectorises without reordering anything.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

// Fixed-lane dot product of two float rows: kLanes partial sums, then a fixed tree.
inline float dot(const float* a, const float* b, int64_t dim) {
  float lanes[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[d + l] * b[d + l];
  }
  for (int64_t l = 0; d + l < dim; ++l) lanes[l] += a[d + l] * b[d + l];
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
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
    std::vector<float> query(per_group * dim), acc(per_group * dim), row_buf(dim), scores, weights;
    std::vector<int64_t> seen;
    int64_t s = 0;
    for (int64_t item = begin; item < end; ++item) {
      while (first_item[s + 1] <= item) ++s;
      const Session& session = sessions[s];
      const int64_t local = item - first_item[s];
      const int64_t r = local / groups, g = local % groups, n = session.hi - session.lo;
      const int64_t row = session.lo + r;
      // The keys this row sees, in order.
      seen.clear();
      if (session.mask != nullptr) {
        const bool* visible = session.mask + r * session.length;
        for (int64_t t = 0; t < session.length; ++t) {
          if (visible[t]) seen.push_back(t);
        }
      } else {
        const int64_t last = session.length - n + r;
        for (int64_t t = 0; t <= last; ++t) seen.push_back(t);
      }
      const int64_t count = static_cast<int64_t>(seen.size());
      for (int64_t p = 0; p < per_group; ++p) {
        widen(q_data + row * q_row + (g * per_group + p) * q_head, &query[p * dim], dim);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      if (count > 0) {
        scores.resize(per_group * count);
        const T* keys = static_cast<const T*>(session.keys) + g * session.key_head;
        for (int64_t j = 0; j < count; ++j) {
          widen(keys + seen[j] * session.key_row, row_buf.data(), dim);
          for (int64_t p = 0; p < per_group; ++p) scores[p * count + j] = dot(&query[p * dim], row_buf.data(), dim) * scale;
        }
        weights.resize(per_group * count);
        for (int64_t p = 0; p < per_group; ++p) {
          float* score = &scores[p * count];
          float top = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < count; ++j) top = std::max(top, score[j]);
          float total = 0.f;
          for (int64_t j = 0; j < count; ++j) {
            score[j] = std::exp(score[j] - top);
            total += score[j];
          }
          for (int64_t j = 0; j < count; ++j) weights[p * count + j] = score[j] / total;
        }
        const T* values = static_cast<const T*>(session.values) + g * session.value_head;
        for (int64_t j = 0; j < count; ++j) {
          widen(values + seen[j] * session.value_row, row_buf.data(), dim);
          for (int64_t p = 0; p < per_group; ++p) {
            const float w = weights[p * count + j];
            float* a = &acc[p * dim];
            for (int64_t d = 0; d < dim; ++d) a[d] += w * row_buf[d];
          }
        }
      }
      T* dst = out_data + row * heads * dim + g * per_group * dim;
      for (int64_t i = 0; i < per_group * dim; ++i) dst[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

// q [N, Hq, hd] (last dim contiguous); keys[i], values[i] [1, Hkv, T_i, hd] (last dim contiguous);
// bounds [S + 1]: session i's rows are bounds[i] .. bounds[i + 1]; masks[i] bool [n_i, T_i] or None
// (causal, its rows the last of its keys). Writes out [N, Hq hd] (contiguous).
void ragged_attention(const at::Tensor& q, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      const std::vector<int64_t>& bounds, const std::vector<std::optional<at::Tensor>>& masks,
                      double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [N, Hq, hd] with contiguous rows of hd");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == q.scalar_type(), "out must be contiguous, of q's dtype");
  const int64_t count = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == count && static_cast<int64_t>(masks.size()) == count &&
                  static_cast<int64_t>(bounds.size()) == count + 1,
              "one key, value and mask per session, and bounds around them");
  const int64_t groups = count ? keys[0].size(1) : 1;
  std::vector<Session> sessions;
  std::vector<int64_t> first_item{0};
  sessions.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    const at::Tensor& k = keys[i];
    const at::Tensor& v = values[i];
    TORCH_CHECK(k.dim() == 4 && k.size(0) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && k.sizes() == v.sizes(),
                "keys and values must be [1, Hkv, T, hd] with contiguous rows of hd");
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "keys of q's dtype");
    const bool* mask = nullptr;
    const int64_t n = bounds[i + 1] - bounds[i];
    if (masks[i].has_value()) {
      const at::Tensor& m = *masks[i];
      TORCH_CHECK(m.scalar_type() == at::kBool && m.is_contiguous() && m.dim() == 2 && m.size(0) == n &&
                      m.size(1) == k.size(2),
                  "a mask must be contiguous bool [rows, keys]");
      mask = m.data_ptr<bool>();
    } else {
      TORCH_CHECK(k.size(2) >= n, "a causal session needs its rows among its keys");
    }
    sessions.push_back(Session{k.data_ptr(), v.data_ptr(), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
                               k.size(2), bounds[i], bounds[i + 1], mask});
    first_item.push_back(first_item.back() + n * groups);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "ragged_attention", [&] {
    attend<scalar_t>(q, sessions, first_item, groups, scale, out);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ragged_attention", &ragged_attention, "batch-invariant attention of many sessions' rows");
}
