#include "cpu/batched_gemm.h"

#include <algorithm>
#include <cmath>
#include <vector>
#include <type_traits>

#include "cpu/cpu_clones.h"
#include "cpu/mirror_cpu.h"
#include "cpu/scratch_cpu.h"
#include "cpu/syrk_cpu.h"
#include "megatron_eopt/storage_types.h"
#include "ops/aten_ops.h"

namespace megatron_eopt {
namespace {

// Elements per parallel task of the element loops.
constexpr int64_t kGrainElements = 32768;

// Element access of an fp32 or bf16 buffer in fp32 registers.
template <typename T>
void for_each_type(const Tensor& t, T&& body) {
  if (t.scalar_type() == kBFloat16) body(static_cast<Bf16*>(t.data_ptr()));
  else body(static_cast<float*>(t.data_ptr()));
}

void product_out(Tensor& d, const Tensor& a, const Tensor& b) {
  if (d.dim() == 2) aten::mm_out(d, a, b);
  else aten::bmm_out(d, a, b);
}

// The element loops, as functions compiled for AVX2 as well (cpu_clones.h; a lambda body would
// get the baseline ISA only). Each iteration reads and writes one index, so in-place is safe.
template <typename Out, typename H, typename G>
MEGATRON_EOPT_CPU_CLONES void polynomial_rows(Out* out, const H* h, const G* g, int64_t s, int64_t begin, int64_t end,
                                              float c, float b, float a) {
  for (int64_t r = begin; r < end; ++r) {
    const int64_t at = r * s, diag = at + r % s;
    // The diagonal term first, so that the row loop has no branch and vectorizes.
    const float diagonal = c * to_float(h[diag]) + b * to_float(g[diag]) + a;
    MEGATRON_EOPT_NO_ALIAS
    for (int64_t k = 0; k < s; ++k) out[at + k] = from_float<Out>(c * to_float(h[at + k]) + b * to_float(g[at + k]));
    out[diag] = from_float<Out>(diagonal);
  }
}

// dst[k] = src[k * stride] / divisor: a division, not a multiplication by the reciprocal, for the
// same rounding as torch's x / norm.
template <typename T>
MEGATRON_EOPT_CPU_CLONES void divide_row(T* dst, const float* src, int64_t stride, int64_t n, float divisor) {
  if (stride == 1) {
    MEGATRON_EOPT_NO_ALIAS
    for (int64_t k = 0; k < n; ++k) dst[k] = from_float<T>(src[k] / divisor);
  } else {
    for (int64_t k = 0; k < n; ++k) dst[k] = from_float<T>(src[k * stride] / divisor);
  }
}

// dst[k] = src[k * stride] * factor, rounded to dst's type.
template <typename T, typename S>
MEGATRON_EOPT_CPU_CLONES void scale_row(T* dst, const S* src, int64_t stride, int64_t n, float factor) {
  if (stride == 1) {
    MEGATRON_EOPT_NO_ALIAS
    for (int64_t k = 0; k < n; ++k) dst[k] = from_float<T>(to_float(src[k]) * factor);
  } else {
    for (int64_t k = 0; k < n; ++k) dst[k] = from_float<T>(to_float(src[k * stride]) * factor);
  }
}

// The mirror of a symmetric product computed on its lower column panels: every element above the
// diagonal blocks, d[r][c] = d[c][r] for block(r) < block(c) (mirror_cpu.h), in ranges of
// kMirrorRows rows dealt to the threads.
constexpr int64_t kMirrorRows = 32;
void mirror_above_blocks(Tensor& d, int64_t blocks) {
  const int64_t s = d.size(-1);
  const auto edge = [s, blocks](int64_t i) { return s * i / blocks; };
  if (d.stride(1) != 1) {
    for (int64_t i = 0; i + 1 < blocks; ++i) {
      const int64_t r0 = edge(i), rows = edge(i + 1) - r0, c0 = edge(i + 1);
      Tensor upper = aten::narrow(aten::narrow(d, 0, r0, rows), 1, c0, s - c0);
      aten::copy_(upper, aten::transpose(aten::narrow(aten::narrow(d, 0, c0, s - c0), 1, r0, rows), 0, 1));
    }
    return;
  }
  std::vector<int64_t> from(static_cast<std::size_t>(s));
  for (int64_t i = 0; i < blocks; ++i) {
    for (int64_t r = edge(i); r < edge(i + 1); ++r) from[static_cast<std::size_t>(r)] = edge(i + 1);
  }
  const int64_t rows = edge(blocks - 1);  // the last block's rows copy nothing
  const int64_t ranges = (rows + kMirrorRows - 1) / kMirrorRows;
  const int64_t ld = d.stride(0);
  const int64_t element_bytes = d.scalar_type() == kBFloat16 ? 2 : 4;
  void* base = d.data_ptr();
  // A row's work falls with its index; ranges are taken from both ends in turn (0, last, 1, ...)
  // so that the threads' even shares of them get even shares of the work.
  torch::stable::parallel_for(0, ranges, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t range = k % 2 == 0 ? k / 2 : ranges - 1 - k / 2;
      const int64_t r_begin = range * kMirrorRows, r_end = std::min(rows, r_begin + kMirrorRows);
      mirror_above_blocks_rows(base, element_bytes, ld, s, from.data(), r_begin, r_end);
    }
  });
}

MEGATRON_EOPT_CPU_CLONES void round_bf16_range(float* p, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) p[i] = to_float(from_float<Bf16>(p[i]));
}

}  // namespace

bool gemm_loops_per_matrix(int64_t batch, int64_t macs, int64_t element_bytes) {
  // fp32: one GEMM per matrix from 2^25 multiply-adds (ATen's bmm spreads the batch over the
  // threads and leaves one idle on the last matrix of an odd batch; below 2^25 the loop's per-call
  // overhead shows). bf16: ATen's bmm (oneDNN) was as fast as the loop or faster at every size
  // measured, so always one bmm. Figures: benchmarks/RESULTS.md.
  if (element_bytes == 2) return false;
  return batch > 1 && macs >= (int64_t{1} << 25);
}

void gemm_out(Tensor& d, const Tensor& a, const Tensor& b) {
  const int64_t batch = d.size(0);
  const int64_t element_bytes = d.scalar_type() == kBFloat16 ? 2 : 4;
  if (gemm_loops_per_matrix(batch, a.size(1) * a.size(2) * b.size(2), element_bytes)) {
    for (int64_t i = 0; i < batch; ++i) {
      Tensor di = aten::select(d, 0, i);
      product_out(di, aten::select(a, 0, i), aten::select(b, 0, i));
    }
    return;
  }
  product_out(d, a, b);
}

void symmetric_gemm_out(Tensor& d, const Tensor& a, const Tensor& b, int64_t blocks) {
  if (blocks <= 1) {
    gemm_out(d, a, b);
    return;
  }
  const int64_t s = d.size(-1);
  const auto edge = [s, blocks](int64_t i) { return s * i / blocks; };
  // One matrix at a time, one GEMM per block column: columns [c0, c1) of d from its diagonal
  // down, d[c0:, c0:c1] = a[c0:, :] . b[:, c0:c1], a strided matrix BLAS writes in place. One
  // product per column panel rather than per block: fewer, larger GEMMs, which ATen's bf16 and
  // fp32 GEMMs run faster (benchmarks/RESULTS.md, "The figures behind the built-in rules"). Column
  // panels rather than the row panels of the same blocks: a tall product (many rows of a, few
  // columns of b) ran 10 to 15% faster than the wide one in ATen's bf16 GEMM on AMX at 2048
  // (13.2 to 13.6 ms against 14.5 to 16 for X X^T), the same elsewhere.
  for (int64_t t = 0; t < d.size(0); ++t) {
    Tensor dt = aten::select(d, 0, t);
    const Tensor at_ = aten::select(a, 0, t), bt = aten::select(b, 0, t);
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t c0 = edge(i), cols = edge(i + 1) - c0;
      Tensor panel = aten::narrow(aten::narrow(dt, 1, c0, cols), 0, c0, s - c0);
      product_out(panel, aten::narrow(at_, 0, c0, s - c0), aten::narrow(bt, 1, c0, cols));
    }
    mirror_above_blocks(dt, blocks);
  }
}

void symmetric_kernel_out(Tensor& d, const Tensor& x) {
  const SyrkShape shape{x.size(0), x.size(1), x.size(2),
                        d.scalar_type() == kBFloat16 ? SyrkType::kBf16 : SyrkType::kFp32};
  CpuScratch scratch;
  // The packed copy as fp32 storage: 32-bit words, 64-byte aligned like every ATen CPU buffer;
  // then the partial sums of a deep product, if any.
  const int64_t partial_floats = shape.partial_floats();
  std::vector<std::vector<int64_t>> sizes{{shape.packed_words()}};
  if (partial_floats > 0) sizes.push_back({partial_floats});
  const std::vector<Tensor> temps = scratch.take_all(sizes, kFloat);
  uint32_t* words = static_cast<uint32_t*>(temps[0].data_ptr());
  float* partials = partial_floats > 0 ? temps[1].mutable_data_ptr<float>() : nullptr;
  const void* xp = x.data_ptr();
  torch::stable::parallel_for(0, shape.batch * shape.panels(), 1, [&](int64_t begin, int64_t end) {
    syrk_pack(xp, x.stride(0), x.stride(1), x.stride(2), shape, words, begin, end);
  });
  void* dp = d.data_ptr();
  torch::stable::parallel_for(0, shape.batch * shape.tiles_per_matrix(), 1,
                              [&](int64_t begin, int64_t end) { syrk_tiles(words, shape, dp, partials, begin, end); });
}

void polynomial_out(Tensor& d, float c, const Tensor& h, float b, const Tensor& g, float a) {
  const int64_t s = d.size(-1), rows = d.numel() / s;
  for_each_type(d, [&](auto* out) {
    for_each_type(h, [&](auto* hp) {
      for_each_type(g, [&](auto* gp) {
        using Out = std::remove_pointer_t<decltype(out)>;
        torch::stable::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / s), [&](int64_t begin, int64_t end) {
          polynomial_rows<Out>(out, hp, gp, s, begin, end, c, b, a);
        });
      });
    });
  });
}

void add_to_diagonal_(Tensor& d, float alpha) {
  const int64_t batch = d.size(0), s = d.size(1);
  for_each_type(d, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    for (int64_t i = 0; i < batch; ++i) {
      for (int64_t k = 0; k < s; ++k) {
        T& v = p[(i * s + k) * s + k];
        v = from_float<T>(to_float(v) + alpha);
      }
    }
  });
}

Tensor clamped_matrix_norms(const Tensor& w, float eps) {
  Tensor norms = aten::contiguous(aten::matrix_norms(w));
  float* v = norms.mutable_data_ptr<float>();
  for (int64_t i = 0; i < norms.numel(); ++i) v[i] = v[i] < eps ? eps : v[i];
  return norms;
}

void normalize_out(Tensor& out, const Tensor& w, const Tensor& norms) {
  const int64_t batch = w.size(0), m = w.size(1), n = w.size(2);
  const int64_t s0 = w.stride(0), s1 = w.stride(1), s2 = w.stride(2);
  const float* x = w.const_data_ptr<float>();
  const float* norm = norms.const_data_ptr<float>();
  for_each_type(out, [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    torch::stable::parallel_for(0, batch * m, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1)),
                                [&](int64_t begin, int64_t end) {
                                  for (int64_t r = begin; r < end; ++r) {
                                    const int64_t i = r / m, j = r % m;
                                    divide_row<T>(o + r * n, x + i * s0 + j * s1, s2, n, norm[i]);
                                  }
                                });
  });
}

void normalize_input_out(Tensor& out, const Tensor& w, float eps, const NsRecipe& recipe) {
  if (!recipe.changes_input()) {
    normalize_out(out, w, clamped_matrix_norms(w, eps));
    return;
  }
  if (!recipe.row_equilibration) {
    // Another convention or divisor: only the per-matrix denominator differs.
    Tensor denoms = aten::contiguous(aten::matrix_norms(w));
    float* v = denoms.mutable_data_ptr<float>();
    for (int64_t i = 0; i < denoms.numel(); ++i) v[i] = ns_denominator(v[i], eps, recipe.norm_divisor, recipe.eps_mode);
    normalize_out(out, w, denoms);
    return;
  }
  // MuonEq: the rows' sums of squares (one read of w), the per-row multipliers from them, then
  // one pass writing the scaled rows.
  const int64_t batch = w.size(0), m = w.size(1), n = w.size(2);
  const int64_t s0 = w.stride(0), s1 = w.stride(1), s2 = w.stride(2);
  const float* x = w.const_data_ptr<float>();
  std::vector<double> scale(static_cast<std::size_t>(batch * m));
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1));
  torch::stable::parallel_for(0, batch * m, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + (r / m) * s0 + (r % m) * s1;
      double acc = 0.0;
      for (int64_t k = 0; k < n; ++k) {
        const double v = row[k * s2];
        acc += v * v;
      }
      scale[static_cast<std::size_t>(r)] = acc;
    }
  });
  for (int64_t i = 0; i < batch; ++i) ns_row_scales(scale.data() + i * m, m, eps, recipe);
  for_each_type(out, [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    torch::stable::parallel_for(0, batch * m, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* row = x + (r / m) * s0 + (r % m) * s1;
        scale_row<T>(o + r * n, row, s2, n, static_cast<float>(scale[static_cast<std::size_t>(r)]));
      }
    });
  });
}

void frobenius_renorm_out(Tensor& out, const Tensor& src) {
  const int64_t batch = src.size(0), m = src.size(1), n = src.size(2);
  std::vector<double> rows(static_cast<std::size_t>(batch * m));
  std::vector<float> factor(static_cast<std::size_t>(batch));
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1));
  for_each_type(src, [&](auto* p) {
    torch::stable::parallel_for(0, batch * m, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        double acc = 0.0;
        for (int64_t k = 0; k < n; ++k) {
          const double v = to_float(p[r * n + k]);
          acc += v * v;
        }
        rows[static_cast<std::size_t>(r)] = acc;
      }
    });
  });
  for (int64_t i = 0; i < batch; ++i) {
    double total = 0.0;  // a fixed order: run-to-run identical
    for (int64_t j = 0; j < m; ++j) total += rows[static_cast<std::size_t>(i * m + j)];
    factor[static_cast<std::size_t>(i)] = muon_plus_factor(static_cast<float>(std::sqrt(total)), m, n);
  }
  float* o = out.mutable_data_ptr<float>();
  for_each_type(src, [&](auto* p) {
    torch::stable::parallel_for(0, batch * m, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        scale_row<float>(o + r * n, p + r * n, 1, n, factor[static_cast<std::size_t>(r / m)]);
    });
  });
}

void round_bf16_(Tensor& t) {
  // One pass in place, rounding to nearest even as torch's conversion does (storage_types.h).
  float* p = t.mutable_data_ptr<float>();
  torch::stable::parallel_for(0, t.numel(), kGrainElements,
                              [p](int64_t begin, int64_t end) { round_bf16_range(p, begin, end); });
}

}  // namespace megatron_eopt
