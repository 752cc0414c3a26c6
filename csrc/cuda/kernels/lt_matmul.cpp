#include "lt_matmul.h"

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "megatron_eopt/cuda_check.h"
#include "megatron_eopt/gemm_alignment.h"

namespace megatron_eopt {
namespace {

std::atomic<int64_t> g_lt_calls{0};
std::atomic<int64_t> g_fallback_calls{0};
std::atomic<bool> g_force_fallback{false};

// The heuristic may pick algorithms that use up to this much workspace; each call then allocates
// what its algorithm reports (often nothing).
constexpr std::size_t kMaxWorkspaceBytes = 32u << 20;

// Pitches up to this take one 2-D copy (cudaMemcpy2D's limit is the device's maximum pitch,
// at least 2 GiB on the GPUs built for); larger matrices are copied one by one.
constexpr std::size_t kMaxCopyPitchBytes = std::size_t{1} << 30;

void check_lt(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("megatron_eopt: cuBLAS ") + what + " failed with status " +
                             std::to_string(static_cast<int>(status)));
  }
}

std::string shape_text(const GemmShape& s, int64_t batch) {
  return std::to_string(batch) + " x (" + std::to_string(s.rows) + "x" + std::to_string(s.depth) + " @ " +
         std::to_string(s.depth) + "x" + std::to_string(s.cols) + ")";
}

using Alignments = GemmAlignments;

// The problem: everything but the operands' addresses that determines the descriptors.
using ProblemKey = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int, int, int>;
// A plan is chosen for a problem and the alignments its operands guarantee; it serves every call
// of that problem whose operands are at least as aligned (gemm_alignment.h).
using PlanKey = std::pair<ProblemKey, Alignments>;

cudaDataType_t lt_data_type(LtElement e) { return e == LtElement::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F; }

// The heuristic is told each operand's alignment (gemm_alignment), so it only offers kernels that
// work for every matrix of the batch (its default assumes 256-byte alignment, which odd shapes such
// as 97 x 37 bf16 do not have).
uint32_t alignment_of(const void* ptr, int64_t stride_elems, std::size_t elem_bytes) {
  return gemm_alignment(reinterpret_cast<uintptr_t>(ptr), stride_elems, elem_bytes);
}

// Descriptors and algorithm of one problem, created once and reused by every later call.
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace_bytes = 0;  // what `algo` needs
  bool fallback = false;            // cuBLASLt has no algorithm: cublasGemmStridedBatchedEx runs it
  ~LtPlan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                                   int64_t stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  check_lt(cublasLtMatrixLayoutCreate(&layout, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld),
           "MatrixLayoutCreate");
  const int32_t count = static_cast<int32_t>(batch);
  check_lt(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
           "set batch count");
  check_lt(
      cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)),
      "set batch stride");
  return layout;
}

std::unique_ptr<LtPlan> make_plan(const LtGemmArgs& args, cublasLtHandle_t handle, const Alignments& align) {
  const GemmShape& s = *args.shape;
  const cudaDataType_t ab_type = lt_data_type(args.types.ab);
  const cudaDataType_t cd_type = lt_data_type(args.types.cd);
  const cublasComputeType_t compute = args.types.compute == LtCompute::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                             : CUBLAS_COMPUTE_32F;
  auto plan = std::make_unique<LtPlan>();
  check_lt(cublasLtMatmulDescCreate(&plan->desc, compute, CUDA_R_32F), "MatmulDescCreate");
  const cublasOperation_t ta = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "set transa");
  check_lt(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "set transb");
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
  const uint64_t ws = kMaxWorkspaceBytes;
  check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
           "set max workspace");
  if (args.types.cd == LtElement::kBFloat16) {
    // Split-K may otherwise reduce its partial sums in the output type (in place in D, or in a
    // bf16 workspace): bf16 partials would break the fp32 accumulation of "medium" products.
    // Only no split or a reduction in the fp32 compute type is allowed.
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                                  sizeof(schemes)),
             "set reduction scheme mask");
  }
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &align[i], sizeof(align[i])),
             "set min alignment");
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->c, plan->c,
                                                               pref, 1, &result, &found);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) {
    // No Lt algorithm: NOT_SUPPORTED (e.g. 97 x 37 bf16 at these alignments), INVALID_VALUE for
    // layouts the heuristic refuses (degenerate 37 x 1 ones), or none found. The cuBLAS GEMM runs
    // the problem instead, and reports its own error if it cannot either.
    plan->fallback = true;
    return plan;
  }
  plan->algo = result.algo;
  plan->workspace_bytes = result.workspaceSize;
  return plan;
}

cudaDataType_t blas_type(LtElement e) { return e == LtElement::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F; }

// cuBLAS computes C in place: D starts as a copy of C when beta reads it. C and D share one
// layout (ldc, stride_c); each matrix's copy is one span from its first to its last element,
// whose gaps are D's own rows outside the product. The span stops there: D may be a panel of a
// larger matrix (lt_symmetric.h), whose other panels between two matrices of the batch must not
// be overwritten.
void blas_gemm(const LtGemmArgs& args, const LtContext& ctx) {
  const GemmShape& s = *args.shape;
  const std::size_t cd = lt_element_bytes(args.types.cd);
  if (args.beta != 0.f && args.c != args.d) {
    const std::size_t span = static_cast<std::size_t>((s.cols - 1) * s.ldc + s.rows) * cd;
    const std::size_t pitch = static_cast<std::size_t>(s.stride_c) * cd;
    if (args.batch > 1 && pitch >= span && pitch <= kMaxCopyPitchBytes) {
      MEGATRON_EOPT_CUDA_CHECK(cudaMemcpy2DAsync(args.d, pitch, args.c, pitch, span,
                                                 static_cast<std::size_t>(args.batch), cudaMemcpyDeviceToDevice,
                                                 ctx.stream));
    } else {
      for (int64_t t = 0; t < args.batch; ++t) {
        MEGATRON_EOPT_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(args.d) + t * pitch,
                                                 static_cast<const char*>(args.c) + t * pitch, span,
                                                 cudaMemcpyDeviceToDevice, ctx.stream));
      }
    }
  }
  // The handle is torch's, already bound by torch's getter to the current stream and to that
  // stream's workspace from torch's caching allocator. cublasSetStream is not called: it would
  // reset the handle's workspace to cuBLAS's default pool, shared by all streams.
  const cublasHandle_t handle = ctx.blas();
  cudaStream_t bound = nullptr;
  check_lt(cublasGetStream(handle, &bound), "GetStream");
  if (bound != ctx.stream) {
    throw std::runtime_error(
        "megatron_eopt: torch's cuBLAS handle is bound to another stream than the op's "
        "current stream");
  }
  // Its math mode may allow TF32 for fp32 products. The compute type says what this problem
  // wants, so the default math mode is set for the call and restored after. Split-K partial sums
  // of bf16 outputs stay in the fp32 compute type (cuBLAS would otherwise be free to reduce them
  // in bf16), as the cuBLASLt path's reduction-scheme mask asks above.
  cublasMath_t previous = CUBLAS_DEFAULT_MATH;
  check_lt(cublasGetMathMode(handle, &previous), "GetMathMode");
  const auto mode = static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
  check_lt(cublasSetMathMode(handle, mode), "SetMathMode");
  const cublasComputeType_t compute = args.types.compute == LtCompute::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                             : CUBLAS_COMPUTE_32F;
  const cublasStatus_t status = cublasGemmStridedBatchedEx(
      handle, s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(s.rows),
      static_cast<int>(s.cols), static_cast<int>(s.depth), &args.alpha, args.a, blas_type(args.types.ab),
      static_cast<int>(s.lda), s.stride_a, args.b, blas_type(args.types.ab), static_cast<int>(s.ldb), s.stride_b,
      &args.beta, args.d, blas_type(args.types.cd), static_cast<int>(s.ldc), s.stride_c, static_cast<int>(args.batch),
      compute, CUBLAS_GEMM_DEFAULT);
  cublasSetMathMode(handle, previous);
  check_lt(status, "GemmStridedBatchedEx");
}

}  // namespace

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t error = cudaStreamIsCapturing(stream, &status);
  if (error == cudaErrorStreamCaptureImplicit) {
    // The legacy stream while another stream captures in global mode: a capture is under way.
    // The failed query recorded this error as the thread's last error, overwriting whatever was
    // there; reset it so that the next launch check does not report it.
    cudaGetLastError();
    return true;
  }
  MEGATRON_EOPT_CUDA_CHECK(error);
  return status != cudaStreamCaptureStatusNone;
}

LtGemmCounts lt_gemm_counts() { return {g_lt_calls.load(), g_fallback_calls.load()}; }

void lt_force_fallback(bool on) { g_force_fallback.store(on); }

void lt_strided_batched_gemm(const LtGemmArgs& args, const LtContext& ctx) {
  if (g_force_fallback.load(std::memory_order_relaxed)) {
    blas_gemm(args, ctx);
    g_fallback_calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // Process-wide and intentionally leaked: destroying the descriptors at static destruction
  // would call into cuBLASLt after the CUDA context may already be gone.
  static auto* const mutex = new std::mutex;
  static auto* const cache = new std::map<PlanKey, std::unique_ptr<LtPlan>>;
  const GemmShape& s = *args.shape;
  const std::size_t ab = lt_element_bytes(args.types.ab), cd = lt_element_bytes(args.types.cd);
  const Alignments align{alignment_of(args.a, s.stride_a, ab), alignment_of(args.b, s.stride_b, ab),
                         alignment_of(args.c, s.stride_c, cd), alignment_of(args.d, s.stride_c, cd)};
  const ProblemKey problem{ctx.device,
                           s.rows,
                           s.cols,
                           s.depth,
                           s.trans_a,
                           s.trans_b,
                           s.lda,
                           s.ldb,
                           s.ldc,
                           s.stride_a,
                           s.stride_b,
                           s.stride_c,
                           args.batch,
                           static_cast<int>(args.types.ab),
                           static_cast<int>(args.types.cd),
                           static_cast<int>(args.types.compute)};
  const PlanKey key{problem, align};
  LtPlan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(*mutex);
    auto it = cache->find(key);
    if (it == cache->end() && stream_is_capturing(ctx.stream)) {
      // A warm-up on differently aligned operands (another view, another allocation) planned the
      // same problem: a plan chosen for alignments no larger than these serves.
      auto first = cache->lower_bound(PlanKey{problem, Alignments{}});
      auto last = first;
      while (last != cache->end() && last->first.first == problem) ++last;
      it = find_serving_plan(first, last, align, [](const auto& entry) { return entry.first.second; });
      if (it == last) {
        throw std::runtime_error(
            "megatron_eopt: a Newton-Schulz GEMM of shape " + shape_text(s, args.batch) +
            " is met for the first time while a CUDA graph is being captured; its cuBLASLt algorithm must be "
            "chosen outside capture. Run the same step (or op) once before capturing it (a warm-up iteration on a "
            "side stream, as torch.cuda.graphs recommends).");
      }
    } else if (it == cache->end()) {
      it = cache->emplace(key, make_plan(args, ctx.lt, align)).first;
    }
    plan = it->second.get();
  }
  if (plan->fallback) {
    blas_gemm(args, ctx);
    g_fallback_calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  void* workspace = plan->workspace_bytes == 0 ? nullptr
                                               : ctx.workspace.get(ctx.workspace.context, plan->workspace_bytes);
  check_lt(cublasLtMatmul(ctx.lt, plan->desc, &args.alpha, args.a, plan->a, args.b, plan->b, &args.beta, args.c,
                          plan->c, args.d, plan->c, &plan->algo, workspace, plan->workspace_bytes, ctx.stream),
           "LtMatmul");
  g_lt_calls.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace megatron_eopt
