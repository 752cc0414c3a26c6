// Strided-batched GEMM through cuBLASLt, D = alpha op(A) op(B) + beta C with C and D distinct,
// so scaled additions fold into the epilogue. Algorithms are chosen once per problem and cached;
// when cuBLASLt offers none (odd alignments), the problem runs through cublasGemmStridedBatchedEx.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "megatron_eopt/blas_context.h"
#include "megatron_eopt/ns_gemm_plan.h"
#include "megatron_eopt/ns_precision.h"

namespace megatron_eopt {

enum class LtElement { kFloat32, kBFloat16 };
enum class LtCompute { kFp32, kTf32 };  // fp32 accumulation; TF32: tensor-core products of fp32 operands

// Element types of A and B (always equal), of C and D (equal), and the compute mode.
struct LtTypes {
  LtElement ab;
  LtElement cd;
  LtCompute compute;
};

// The standard Newton–Schulz iteration keeps every operand in its compute type: bf16 ("medium"),
// fp32 with TF32 products ("high") or fp32 ("highest").
inline LtTypes lt_types(NsPrecision precision) {
  switch (precision) {
    case NsPrecision::kMedium: return {LtElement::kBFloat16, LtElement::kBFloat16, LtCompute::kFp32};
    case NsPrecision::kHigh: return {LtElement::kFloat32, LtElement::kFloat32, LtCompute::kTf32};
    case NsPrecision::kHighest: break;
  }
  return {LtElement::kFloat32, LtElement::kFloat32, LtCompute::kFp32};
}

inline std::size_t lt_element_bytes(LtElement e) { return e == LtElement::kBFloat16 ? 2 : 4; }

struct LtGemmArgs {
  const GemmShape* shape;
  int64_t batch;
  LtTypes types;
  float alpha;
  const void* a;
  const void* b;
  float beta;
  const void* c;  // read only when beta != 0; may equal d (cuBLASLt allows C and D to alias)
  void* d;
};

// Whether `stream` is capturing a CUDA graph (the legacy stream counts as capturing while another
// stream captures in global mode). Throws on any other error of the query.
bool stream_is_capturing(cudaStream_t stream);

// Runs the GEMM with the plan chosen for its problem. During capture a plan chosen for the same
// problem on less aligned operands serves. Throws when a problem's plan does not exist yet and `stream` is capturing a CUDA graph: the
// algorithm query must run before capture (a warm-up call on the same shapes).
void lt_strided_batched_gemm(const LtGemmArgs& args, const LtContext& ctx);

// GEMMs run so far in this process (all devices): through cuBLASLt and through the cuBLAS
// fallback. Read by the doctor and the tests to see which path served a problem.
struct LtGemmCounts {
  int64_t lt_calls;
  int64_t fallback_calls;
};
LtGemmCounts lt_gemm_counts();

// While on, every GEMM takes the cuBLAS fallback (the doctor and the tests exercise that path on
// shapes cuBLASLt would serve). Off by default.
void lt_force_fallback(bool on);

}  // namespace megatron_eopt
