#include "cpu/batched_gemm.h"

#include <algorithm>
#include <vector>

#include "megatron_eopt/storage_types.h"
#include "torch/aten_ops.h"

namespace megatron_eopt {
namespace {

// Multiply-adds per matrix from which one GEMM per matrix beats one bmm (about 128^3: below it
// the per-call overhead of a loop shows, above it every GEMM keeps both threads busy).
constexpr int64_t kPerMatrixLoopMacs = int64_t{1} << 21;
// Elements per parallel task of the element loop.
constexpr int64_t kGrainElements = 32768;

void scale_add_rows(float* d, const float* c, const std::vector<int64_t>& size, const std::vector<int64_t>& d_stride,
                    const std::vector<int64_t>& c_stride, float alpha, float beta) {
  const int64_t rows = size[0] * size[1], cols = size[2];
  torch::stable::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(cols, 1)),
                              [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r / size[1], j = r % size[1];
      float* dr = d + i * d_stride[0] + j * d_stride[1];
      const float* cr = c == nullptr ? nullptr : c + i * c_stride[0] + j * c_stride[1];
      for (int64_t k = 0; k < cols; ++k) {
        const float scaled = alpha * dr[k * d_stride[2]];
        dr[k * d_stride[2]] = cr == nullptr ? scaled : scaled + beta * cr[k * c_stride[2]];
      }
    }
  });
}

// (batch, rows, cols) sizes and strides of a 2-D or 3-D tensor.
void as_3d(const Tensor& t, std::vector<int64_t>& size, std::vector<int64_t>& stride) {
  size = aten::sizes_of(t);
  stride = aten::strides_of(t);
  if (size.size() == 2) {
    size.insert(size.begin(), 1);
    stride.insert(stride.begin(), 0);
  }
}

// d <- alpha * d + beta * c element by element in fp32 (c unused when beta == 0): the scalar part
// of d = alpha * a . b + beta * c after the product. CPU float32 tensors of one shape, any strides
// (every product of the CPU iterations is fp32; "medium" rounds values, not storage).
void scale_add_(Tensor& d, double alpha, const Tensor& c, double beta) {
  std::vector<int64_t> size, d_stride, c_size, c_stride;
  as_3d(d, size, d_stride);
  const bool add_c = beta != 0.0;
  if (add_c) as_3d(c, c_size, c_stride);
  scale_add_rows(d.mutable_data_ptr<float>(), add_c ? c.const_data_ptr<float>() : nullptr, size, d_stride, c_stride,
                 static_cast<float>(alpha), static_cast<float>(beta));
}

// d = a . b (2-D, or batched 3-D), then the scalars. ATen's addmm / baddbmm would fuse them, but
// their Scalar arguments cannot cross the stable dispatcher interface.
void product_out(Tensor& d, const Tensor& a, const Tensor& b, double alpha, const Tensor& c, double beta) {
  if (d.dim() == 2) aten::mm_out(d, a, b);
  else aten::bmm_out(d, a, b);
  if (alpha != 1.0 || beta != 0.0) scale_add_(d, alpha, c, beta);
}

}  // namespace

void gemm_out(Tensor& d, const Tensor& a, const Tensor& b, double alpha, const Tensor& c, double beta) {
  const bool add_c = beta != 0.0;
  const int64_t batch = d.size(0);
  if (batch > 1 && a.size(1) * a.size(2) * b.size(2) >= kPerMatrixLoopMacs) {
    for (int64_t i = 0; i < batch; ++i) {
      Tensor di = aten::select(d, 0, i);
      product_out(di, aten::select(a, 0, i), aten::select(b, 0, i), alpha, add_c ? aten::select(c, 0, i) : Tensor(),
                  beta);
    }
    return;
  }
  product_out(d, a, b, alpha, c, beta);
}

void symmetric_gemm_out(Tensor& d, const Tensor& a, const Tensor& b, double alpha, const Tensor& c,
                        double beta, int64_t blocks) {
  if (blocks <= 1) {
    gemm_out(d, a, b, alpha, c, beta);
    return;
  }
  const int64_t s = d.size(-1);
  const bool add_c = beta != 0.0;
  const auto edge = [s, blocks](int64_t i) { return s * i / blocks; };
  // Blocks are large (ns_symmetric_blocks: at least 256 rows), so one matrix at a time, each block
  // written in place: a block of a row-major matrix is a strided matrix BLAS writes directly.
  for (int64_t t = 0; t < d.size(0); ++t) {
    Tensor dt = aten::select(d, 0, t);
    const Tensor at_ = aten::select(a, 0, t), bt = aten::select(b, 0, t);
    const Tensor ct = add_c ? aten::select(c, 0, t) : Tensor();
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t r0 = edge(i), rows = edge(i + 1) - r0;
      const Tensor a_rows = aten::narrow(at_, 0, r0, rows);
      for (int64_t j = i; j < blocks; ++j) {
        const int64_t c0 = edge(j), cols = edge(j + 1) - c0;
        Tensor block = aten::narrow(aten::narrow(dt, 0, r0, rows), 1, c0, cols);
        product_out(block, a_rows, aten::narrow(bt, 1, c0, cols), alpha,
                    add_c ? aten::narrow(aten::narrow(ct, 0, r0, rows), 1, c0, cols) : Tensor(), beta);
      }
    }
    // The blocks below the diagonal: transposes of those above.
    for (int64_t i = 0; i < blocks; ++i) {
      for (int64_t j = i + 1; j < blocks; ++j) {
        const int64_t r0 = edge(i), rows = edge(i + 1) - r0, c0 = edge(j), cols = edge(j + 1) - c0;
        Tensor lower = aten::narrow(aten::narrow(dt, 0, c0, cols), 1, r0, rows);
        aten::copy_(lower, aten::transpose(aten::narrow(aten::narrow(dt, 0, r0, rows), 1, c0, cols), 0, 1));
      }
    }
  }
}

Tensor clamped_matrix_norms(const Tensor& w, float eps) {
  Tensor norms = aten::contiguous(aten::matrix_norms(w));
  float* v = norms.mutable_data_ptr<float>();
  for (int64_t i = 0; i < norms.numel(); ++i) v[i] = v[i] < eps ? eps : v[i];
  return norms;
}

void round_bf16_(Tensor& t) {
  // One pass in place, rounding to nearest even as torch's conversion does (storage_types.h).
  float* p = t.mutable_data_ptr<float>();
  torch::stable::parallel_for(0, t.numel(), kGrainElements, [p](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) p[i] = to_float(from_float<Bf16>(p[i]));
  });
}

void add_to_diagonal_(Tensor& d, float alpha) {
  const int64_t batch = d.size(0), s = d.size(1);
  float* p = d.mutable_data_ptr<float>();
  for (int64_t i = 0; i < batch; ++i) {
    for (int64_t k = 0; k < s; ++k) p[(i * s + k) * s + k] += alpha;
  }
}

}  // namespace megatron_eopt
