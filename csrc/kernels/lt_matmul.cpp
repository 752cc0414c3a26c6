#include "lt_matmul.h"

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "megatron_eopt/cuda_check.h"

namespace megatron_eopt {
namespace {

void check_lt(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("megatron_eopt: cuBLASLt ") + what + " failed with status " +
                             std::to_string(static_cast<int>(status)));
  }
}

using Alignments = std::tuple<uint32_t, uint32_t, uint32_t, uint32_t>;  // A, B, C, D in bytes

// Everything that determines the descriptors and the heuristic's choice.
using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int, int, int, std::size_t, Alignments>;

cudaDataType_t lt_data_type(LtElement e) { return e == LtElement::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F; }

// Largest power of two (at most 256) dividing the address and every batch stride in bytes: the
// heuristic then only offers kernels that work for every matrix of the batch (its default
// assumes 256-byte alignment, which odd shapes such as 97 x 37 bf16 do not have).
uint32_t alignment_of(const void* ptr, int64_t stride_elems, std::size_t elem_bytes) {
  uint64_t bits = reinterpret_cast<uintptr_t>(ptr) | static_cast<uint64_t>(stride_elems) * elem_bytes | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

// Descriptors and algorithm of one problem, created once and reused by every later call.
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~LtPlan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                                   int64_t batch, int64_t stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  check_lt(cublasLtMatrixLayoutCreate(&layout, type, static_cast<uint64_t>(rows),
                                      static_cast<uint64_t>(cols), ld),
           "MatrixLayoutCreate");
  const int32_t count = static_cast<int32_t>(batch);
  check_lt(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                            sizeof(count)),
           "set batch count");
  check_lt(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                            &stride, sizeof(stride)),
           "set batch stride");
  return layout;
}

std::unique_ptr<LtPlan> make_plan(const LtGemmArgs& args, cublasLtHandle_t handle,
                                  std::size_t workspace_bytes, const Alignments& align) {
  const GemmShape& s = *args.shape;
  const cudaDataType_t ab_type = lt_data_type(args.types.ab);
  const cudaDataType_t cd_type = lt_data_type(args.types.cd);
  const cublasComputeType_t compute =
      args.types.compute == LtCompute::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  auto plan = std::make_unique<LtPlan>();
  check_lt(cublasLtMatmulDescCreate(&plan->desc, compute, CUDA_R_32F), "MatmulDescCreate");
  const cublasOperation_t ta = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
           "set transa");
  check_lt(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
           "set transb");
  // Stored shapes: A is (rows x depth) or, transposed, (depth x rows); likewise B.
  plan->a = s.trans_a ? make_layout(ab_type, s.depth, s.rows, s.lda, args.batch, s.stride_a)
                      : make_layout(ab_type, s.rows, s.depth, s.lda, args.batch, s.stride_a);
  plan->b = s.trans_b ? make_layout(ab_type, s.cols, s.depth, s.ldb, args.batch, s.stride_b)
                      : make_layout(ab_type, s.depth, s.cols, s.ldb, args.batch, s.stride_b);
  plan->c = make_layout(cd_type, s.rows, s.cols, s.ldc, args.batch, s.stride_c);

  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
  // The preference is destroyed on every path, a failed attribute set included.
  const std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)> pref_owner(
      pref, &cublasLtMatmulPreferenceDestroy);
  const uint64_t ws = workspace_bytes;
  check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
           "set max workspace");
  const uint32_t aligns[4] = {std::get<0>(align), std::get<1>(align), std::get<2>(align), std::get<3>(align)};
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &aligns[i], sizeof(aligns[i])),
             "set min alignment");
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, plan->desc, plan->a, plan->b, plan->c, plan->c, pref, 1, &result, &found);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) {
    throw std::runtime_error("megatron_eopt: cuBLASLt has no algorithm for a " + std::to_string(s.rows) +
                             "x" + std::to_string(s.cols) + "x" + std::to_string(s.depth) +
                             " batched GEMM (status " + std::to_string(static_cast<int>(status)) + ")");
  }
  plan->algo = result.algo;
  return plan;
}

}  // namespace

void lt_strided_batched_gemm(const LtGemmArgs& args, int device, cublasLtHandle_t handle, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream) {
  // Process-wide and intentionally leaked: destroying the descriptors at static destruction
  // would call into cuBLASLt after the CUDA context may already be gone.
  static auto* const mutex = new std::mutex;
  static auto* const cache = new std::map<PlanKey, std::unique_ptr<LtPlan>>;
  const GemmShape& s = *args.shape;
  const std::size_t ab = lt_element_bytes(args.types.ab), cd = lt_element_bytes(args.types.cd);
  const Alignments align{alignment_of(args.a, s.stride_a, ab), alignment_of(args.b, s.stride_b, ab),
                         alignment_of(args.c, s.stride_c, cd), alignment_of(args.d, s.stride_c, cd)};
  const PlanKey key{device, s.rows, s.cols, s.depth, s.trans_a, s.trans_b, s.lda, s.ldb, s.ldc,
                    s.stride_a, s.stride_b, s.stride_c, args.batch,
                    static_cast<int>(args.types.ab), static_cast<int>(args.types.cd),
                    static_cast<int>(args.types.compute), workspace_bytes, align};
  LtPlan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(*mutex);
    auto it = cache->find(key);
    if (it == cache->end()) it = cache->emplace(key, make_plan(args, handle, workspace_bytes, align)).first;
    plan = it->second.get();
  }
  check_lt(cublasLtMatmul(handle, plan->desc, &args.alpha, args.a, plan->a, args.b, plan->b, &args.beta,
                          args.c, plan->c, args.d, plan->c, &plan->algo, workspace, workspace_bytes,
                          stream),
           "Matmul");
}

}  // namespace megatron_eopt
