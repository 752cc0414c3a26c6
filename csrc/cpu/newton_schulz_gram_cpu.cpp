// Gram Newton–Schulz on the CPU: runs a GramProgram (megatron_eopt/ns_gram_plan.h) with ATen's
// BLAS-backed batched products, op by op as the CUDA executor does.
//
// "medium" keeps W in bf16 values, as the CUDA path stores it, but holds them in fp32 tensors
// with fp32 products: the iteration needs R = W W^T with an fp32 result (a bf16-rounded R costs
// the recursion far more than the standard iteration's bf16 rounding), and ATen's CPU bf16 GEMMs
// only write bf16. A bf16 value is exact in fp32, so these are the bf16 products with fp32
// accumulation. Results are rounded to bf16 where the CUDA path stores bf16 (W after a restart, Q
// before a product with W). "auto" weighs that fp32 cost against the standard iteration's bf16
// GEMMs (ns_algorithm.h). As in the standard iteration, the program's one product with scalars,
// c R^2 + b R, is the plain GEMM R R followed by one s x s pass.
#include "cpu/newton_schulz_gram_cpu.h"

#include "cpu/batched_gemm.h"
#include "cpu/cpu_product_plan.h"
#include "cpu/scratch_cpu.h"
#include "megatron_eopt/ns_algorithm.h"
#include "megatron_eopt/ns_gram_placement.h"
#include "megatron_eopt/ns_scratch_layout.h"

#include "ops/aten_ops.h"

#include <array>
#include <vector>

namespace megatron_eopt {
namespace {

// Operand positions of GramPlacement::operand_slot.
constexpr int kA = 0, kB = 1, kD = 3;

}  // namespace

void gram_newton_schulz_cpu(const Tensor& w, Tensor& out, const NsOptions& opts, const GramProgram& program) {
  const bool bf16 = opts.precision == NsPrecision::kMedium;
  const int64_t batch = w.size(0), m = w.size(1), n = w.size(2), s = program.gram_side;
  const bool transpose = opts.transpose;

  // W buffers by name; the s x s values in the slots of their placement: pieces of W buffers while
  // those hold nothing (ns_gram_placement.h), else dedicated buffers.
  std::array<Tensor, kGramBufCount> w_buf;
  w_buf[gram_buf_index(GramBuf::kOut)] = out;
  const int64_t square = batch * s * s;
  // Pieces at whole cache lines from the W buffer's start (a slice of the in-place op or of the
  // batch loop may start anywhere; the results do not depend on it).
  const int64_t piece_stride = ns_cpu_aligned_elems(square, 4);
  const int64_t w_pieces = gram_pieces_in(batch * m * n, square, piece_stride);
  std::array<int64_t, kGramBufCount> pieces{};
  for (GramBuf b : {GramBuf::kX0, GramBuf::kX1, GramBuf::kOut}) {
    const bool held = b == GramBuf::kOut ? out.is_contiguous() : program.uses[gram_buf_index(b)];
    if (held) pieces[gram_buf_index(b)] = w_pieces;
  }
  const GramPlacement placement = place_gram_values(program, pieces);

  // The call's temporaries, taken at once (one pooled buffer): the W buffers, then the dedicated
  // s x s buffers.
  std::vector<std::vector<int64_t>> sizes;
  std::vector<GramBuf> scratch_w;
  for (GramBuf b : {GramBuf::kX0, GramBuf::kX1}) {
    if (!program.uses[gram_buf_index(b)]) continue;
    scratch_w.push_back(b);
    sizes.push_back({batch, m, n});
  }
  sizes.insert(sizes.end(), static_cast<std::size_t>(placement.dedicated), {batch, s, s});
  CpuScratch scratch;
  std::vector<Tensor> temps = scratch.take_all(sizes, kFloat);
  for (std::size_t i = 0; i < scratch_w.size(); ++i) w_buf[gram_buf_index(scratch_w[i])] = temps[i];
  std::vector<Tensor> slot(placement.slots.size());
  for (std::size_t i = 0; i < slot.size(); ++i) {
    const GramSlot& home = placement.slots[i];
    if (home.region == GramBuf::kNone) {
      slot[i] = temps[scratch_w.size() + static_cast<std::size_t>(home.index)];
    } else {
      const Tensor flat = aten::view(w_buf[gram_buf_index(home.region)], {batch * m * n});
      slot[i] = aten::view(aten::narrow(flat, 0, home.index * piece_stride, square), {batch, s, s});
    }
  }
  std::size_t op_index = 0;  // the op being run: its operands' slots
  const auto at_ = [&](GramBuf b, int operand) -> Tensor& {
    const int k = placement.operand_slot[op_index][static_cast<std::size_t>(operand)];
    return k >= 0 ? slot[static_cast<std::size_t>(k)] : w_buf[gram_buf_index(b)];
  };
  // Each buffer's transposed view, made on first use and kept: every view made is a dispatcher
  // call, which shows on small matrices.
  std::array<Tensor, kGramBufCount> w_transposed;
  std::vector<Tensor> slot_transposed(slot.size());
  const auto at_t = [&](GramBuf b, int operand) -> const Tensor& {
    const int k = placement.operand_slot[op_index][static_cast<std::size_t>(operand)];
    Tensor& view = k >= 0 ? slot_transposed[static_cast<std::size_t>(k)] : w_transposed[gram_buf_index(b)];
    if (!view.defined()) view = aten::mT(at_(b, operand));
    return view;
  };
  const int64_t blocks = ns_symmetric_blocks(s, NsDevice::kCpu);

  // W0 = x / max(||x||_F, eps) per matrix (or the recipe's normalization), in x's own layout (the
  // Gram side is a choice of product, not of storage).
  Tensor& x0 = w_buf[gram_buf_index(program.x_first)];
  normalize_input_out(x0, w, opts.eps, opts.recipe);
  if (bf16) round_bf16_(x0);

  for (; op_index < program.ops.size(); ++op_index) {
    const GramOp& op = program.ops[op_index];
    switch (op.kind) {
      case GramOpKind::kAddDiag: add_to_diagonal_(at_(op.d, kD), op.alpha); break;
      case GramOpKind::kRound: aten::copy_(at_(op.d, kD), aten::to_dtype(at_(op.a, kA), kBFloat16)); break;
      case GramOpKind::kGemm: {
        Tensor& d = at_(op.d, kD);
        if (op.gemm == GramGemm::kGram) {
          if (transpose) gram_product_out(d, at_t(op.a, kA), at_(op.a, kA), blocks, opts.products);  // X^T X
          else gram_product_out(d, at_(op.a, kA), at_t(op.a, kA), blocks, opts.products);  // X X^T
        } else if (op.gemm == GramGemm::kApply) {
          // Operands as the column-major plan orders them: (X, Q) wide, (Q, X) tall.
          const Tensor& x = transpose ? at_(op.b, kB) : at_(op.a, kA);
          const Tensor& q = transpose ? at_(op.a, kA) : at_(op.b, kB);
          if (transpose) gemm_out(d, x, q);  // X Q = (Q X^T)^T
          else gemm_out(d, q, x);            // Q X
          // Every product with W but the last writes W (a restart), in the W type.
          if (bf16 && op_index + 1 < program.ops.size()) round_bf16_(d);
        } else {
          // s x s: every such product of the program is a polynomial in one R, so symmetric.
          if (op.alpha == 1.f && op.beta == 0.f) {
            symmetric_gemm_out(d, at_(op.a, kA), at_(op.b, kB), opts.products == NsProducts::kFull ? 1 : blocks);
          } else {
            // The one product with scalars, c R R + b R: the plain GEMM R R, then one s x s pass.
            MEGATRON_EOPT_CHECK_VALUE(op.a == op.b && op.a == op.c,
                                      "gram program: a product with scalars must be c R R + b R");
            const Tensor& r = at_(op.a, kA);
            if (op.alpha != 0.f) gram_product_out(d, r, at_t(op.a, kA), blocks, opts.products);  // R R = R R^T
            polynomial_out(d, op.alpha, op.alpha != 0.f ? d : r, op.beta, r, 0.f);
          }
        }
        break;
      }
    }
  }
  // Muon+: the program's last product writes the fp32 result, rescaled here in place.
  if (opts.recipe.frobenius_renorm) frobenius_renorm_out(out, out);
}

}  // namespace megatron_eopt
