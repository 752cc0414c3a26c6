#include "ops/qk_clip_args.h"

#include "megatron_eopt/strided_layout.h"
#include "ops/aten_ops.h"

namespace megatron_eopt {

QkClipCall parse_qk_clip(const TensorList& weights, const TensorList& factors, const std::vector<int64_t>& block_rows,
                         DeviceType backend) {
  constexpr const char* op = "qk_clip_";
  MEGATRON_EOPT_CHECK_VALUE(factors.size() == weights.size(), op, ": factors has ", factors.size(), " tensors but ",
                            weights.size(), " weights were given");
  MEGATRON_EOPT_CHECK_VALUE(block_rows.size() == weights.size(), op, ": block_rows has ", block_rows.size(),
                            " values but ", weights.size(), " weights were given");
  QkClipCall call;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = weights[i];
    const Tensor& f = factors[i];
    const ScalarType t = w.scalar_type();
    MEGATRON_EOPT_CHECK_TYPE(t == kFloat || t == kBFloat16 || t == kHalf, op, ": weights[", i, "] is ", t,
                             "; weights must be float32, bfloat16 or float16");
    MEGATRON_EOPT_CHECK_TYPE(t == weights[0].scalar_type(), op, ": weights[", i, "] is ", t, " but weights[0] is ",
                             weights[0].scalar_type(), "; all weights must share one dtype");
    MEGATRON_EOPT_CHECK_VALUE(w.dim() == 2, op, ": weights[", i, "] must be 2-D, got ", w.dim(), "-D");
    MEGATRON_EOPT_CHECK_VALUE(w.device().type() == backend && w.device() == weights[0].device(), op, ": weights[", i,
                              "] is on ", w.device(), "; all weights must be on one ", device_type_name(backend),
                              " device");
    MEGATRON_EOPT_CHECK_VALUE(w.size(1) <= 1 || w.stride(1) == 1, op, ": weights[", i,
                              "] must have contiguous rows (stride 1 along dim 1), got strides ", w.strides());
    MEGATRON_EOPT_CHECK_VALUE(w.numel() == 0 || !has_internal_overlap(aten::sizes_of(w), aten::strides_of(w)), op,
                              ": weights[", i, "] has overlapping memory and cannot be written in place");
    const int64_t b = block_rows[i];
    MEGATRON_EOPT_CHECK_VALUE(b >= 1 && w.size(0) % b == 0, op, ": block_rows[", i, "] = ", b,
                              " must be positive and divide the ", w.size(0), " rows of weights[", i, "]");
    MEGATRON_EOPT_CHECK_TYPE(f.scalar_type() == kFloat, op, ": factors[", i, "] must be float32, got ",
                             f.scalar_type());
    MEGATRON_EOPT_CHECK_VALUE(f.dim() == 1 && f.size(0) == w.size(0) / b, op, ": factors[", i, "] must be 1-D with ",
                              w.size(0) / b, " values (one per block of ", b, " rows), got shape ", f.sizes());
    MEGATRON_EOPT_CHECK_VALUE(f.device() == w.device(), op, ": factors[", i, "] is on ", f.device(), " but weights[", i,
                              "] is on ", w.device());
    MEGATRON_EOPT_CHECK_VALUE(f.is_contiguous(), op, ": factors[", i, "] must be contiguous");
  }
  if (!weights.empty()) call.type = storage_type(weights[0].scalar_type());
  for (std::size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = weights[i];
    if (w.numel() == 0) continue;
    call.weights.push_back(QkClipWeight{w.data_ptr(), factors[i].const_data_ptr<float>(), w.size(0), w.size(1),
                                        w.size(0) > 1 ? w.stride(0) : w.size(1), block_rows[i]});
  }
  return call;
}

}  // namespace megatron_eopt
