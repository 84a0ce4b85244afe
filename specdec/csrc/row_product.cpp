// Row-invariant bf16 weight products for a few rows at a time (specdec/product_kernel.py).
//
// out[r, n] = sum over input pairs p of (x[r, 2p] w[n, 2p] + x[r, 2p + 1] w[n, 2p + 1]), accumulated in
// float32 in pair order by one AVX-512 BF16 dot-product instruction per pair, plus the bias, rounded
// to bf16. Every (row, output) runs that same chain of instructions whatever the call's row count or
// tiling, so a row's bits never depend on the rows beside it. The chain has no horizontal sum: a
// register holds 16 outputs' accumulators, fed one broadcast pair of the row's inputs at a time.
//
// A decode pass is a few rows against every weight once, so it is bound by reading the weights:
// they are packed once into blocks of kBlock outputs whose input pairs lie contiguously, so each
// thread streams its blocks front to back, and up to kTile rows share each weight load.
//
// A model whose weights outgrow the last-level cache gains nothing from caching them: a pass reads
// every weight once, and the next pass reads it again only after all the others. Such a model's
// products are *streamed* (specdec/packed_linear.py decides): they prefetch their weights ahead with
// the non-temporal hint, so the stream does not evict from that cache what the process and its
// neighbours use again between passes (a small draft model's weights, for one).
// A prefetch changes no bit of the sums.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kVectors = 2;              // 16-output registers per block
constexpr int64_t kBlock = 16 * kVectors;    // outputs per packed block
constexpr int64_t kTile = 8;                 // rows sharing one pass over a block
constexpr int64_t kStreamAhead = 2048;       // bytes ahead of its reads a streamed product prefetches

// Weight [N, K] -> [ceil(N / kBlock), ceil(K / 2), kBlock, 2], zero-padded: block b's pair p holds
// inputs 2p and 2p + 1 of outputs b kBlock .. (b + 1) kBlock, adjacent, as the dot instruction reads.
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "pack: a 2-D bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t blocks = (n + kBlock - 1) / kBlock, pairs = (k + 1) / 2;
  auto padded = torch::zeros({blocks * kBlock, pairs * 2}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({blocks, kBlock, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)

// The pair of row x's inputs 2p, 2p + 1 as one 32-bit lane (the last pair of an odd K is padded with 0).
inline int32_t input_pair(const c10::BFloat16* x, int64_t p, int64_t k) {
  int32_t pair = 0;
  if (2 * p + 1 < k) {
    std::memcpy(&pair, x + 2 * p, 4);
  } else {
    std::memcpy(&pair, x + 2 * p, 2);
  }
  return pair;
}

// Rows 0 .. R of x [R, k] against one packed block; writes outputs n0 .. n0 + kBlock (those below n).
// Stream: prefetch the weight kStreamAhead bytes ahead, non-temporal (past the block's end it reads
// the thread's next block; past the weight's end a prefetch is a no-op, never a fault).
template <int R, bool Stream>
void tile(const c10::BFloat16* x, int64_t k, const uint16_t* block, int64_t pairs, const float* bias,
          c10::BFloat16* out, int64_t n, int64_t n0) {
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    if constexpr (Stream) {
      const char* ahead = reinterpret_cast<const char*>(block + p * kBlock * 2) + kStreamAhead;
      for (int v = 0; v < kVectors; ++v) _mm_prefetch(ahead + v * 64, _MM_HINT_NTA);
    }
    __m512i w[kVectors];
    for (int v = 0; v < kVectors; ++v) w[v] = _mm512_loadu_si512(block + (p * kBlock + v * 16) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512i pair = _mm512_set1_epi32(input_pair(x + r * k, p, k));
      for (int v = 0; v < kVectors; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], reinterpret_cast<__m512bh>(pair), reinterpret_cast<__m512bh>(w[v]));
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    const int64_t first = n0 + v * 16;
    if (first >= n) break;
    const __mmask16 mask = n - first >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - first)) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][v], b));
      _mm256_mask_storeu_epi16(out + r * n + first, mask, reinterpret_cast<__m256i>(rounded));
    }
  }
}

using TileFn = void (*)(const c10::BFloat16*, int64_t, const uint16_t*, int64_t, const float*, c10::BFloat16*,
                        int64_t, int64_t);
constexpr TileFn kTiles[2][kTile + 1] = {
    {nullptr, &tile<1, false>, &tile<2, false>, &tile<3, false>, &tile<4, false>, &tile<5, false>, &tile<6, false>,
     &tile<7, false>, &tile<8, false>},
    {nullptr, &tile<1, true>, &tile<2, true>, &tile<3, true>, &tile<4, true>, &tile<5, true>, &tile<6, true>,
     &tile<7, true>, &tile<8, true>}};

#endif

bool supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M, K] bf16 times the packed weight of `n` outputs, plus bias (float32 [n] or None): [M, n] bf16;
// `stream`: prefetch the weight non-temporally where it is read once (see the top of this file).
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& packed, const std::optional<torch::Tensor>& bias,
                      int64_t n, bool stream) {
  TORCH_CHECK(supported(), "row_product: built for a CPU without AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kBlock && packed.size(3) == 2,
              "packed: a weight from pack()");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(pairs == (k + 1) / 2, "x has ", k, " inputs; the weight ", 2 * pairs);
  TORCH_CHECK(n > 0 && n <= blocks * kBlock && n > (blocks - 1) * kBlock, "n does not match the packed weight");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == n),
              "bias: contiguous float32 [n]");
  auto out = torch::empty({m, n}, x.options());
#if defined(__AVX512BF16__)
  const auto* xs = x.data_ptr<c10::BFloat16>();
  const auto* weights = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto* outs = out.data_ptr<c10::BFloat16>();
  // Streamed only where the call reads each block once: over more than a tile of rows it reads a
  // block once per tile, and the block's later reads find it cached.
  const bool nta = stream && m <= kTile;
  // Threads split the blocks, never a row's reduction: the split changes no bit.
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t blk = lo; blk < hi; ++blk) {
      const uint16_t* block = weights + blk * pairs * kBlock * 2;
      for (int64_t r = 0; r < m; r += kTile) {
        const int64_t rows = std::min(kTile, m - r);
        kTiles[nta][rows](xs + r * k, k, block, pairs, b, outs + r * n, n, blk * kBlock);
      }
    }
  });
#endif
  return out;
}

// Weights a compiled graph multiplies by through the `specdec_kernels::row_product` op, which names
// them by slot: the graph then holds no weight, and its call goes from the graph's code to this kernel
// through the dispatcher alone, with no Python in between (a pass makes about 120 such calls).
struct Slot {
  torch::Tensor packed;
  std::optional<torch::Tensor> bias;
  int64_t n;
  bool stream;
};

std::mutex slots_mutex;
std::deque<Slot> slots;  // a deque: a slot's address never moves while others are added

int64_t add_slot(const torch::Tensor& packed, const std::optional<torch::Tensor>& bias, int64_t n, bool stream) {
  std::lock_guard<std::mutex> lock(slots_mutex);
  slots.push_back(Slot{packed, bias, n, stream});
  return static_cast<int64_t>(slots.size()) - 1;
}

torch::Tensor slot_product(const torch::Tensor& x, int64_t slot, int64_t n) {
  const Slot* found = nullptr;
  {
    std::lock_guard<std::mutex> lock(slots_mutex);
    TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(slots.size()), "row_product: no weight in slot ", slot);
    found = &slots[slot];
  }
  TORCH_CHECK(found->n == n, "row_product: slot ", slot, " has ", found->n, " outputs, not ", n);
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();  // [N, in]
  auto out = product(rows, found->packed, found->bias, n, found->stream);  // [N, n]
  auto shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY(specdec_kernels, m) {
  m.def("row_product(Tensor x, int slot, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_kernels, CPU, m) { m.impl("row_product", &slot_product); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a bf16 weight [N, K] in the product's blocked layout");
  m.def("product", &product, "row-invariant bf16 product of rows and a packed weight");
  m.def("add_slot", &add_slot,
        "keeps a packed weight (and float32 bias, and whether it is streamed) for the row_product op; returns its slot");
  m.def("supported", &supported, "whether this build computes (the CPU has AVX-512 BF16)");
}
