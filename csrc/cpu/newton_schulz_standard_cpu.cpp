// The standard Newton–Schulz iteration (docs/design.md §4.1) on the CPU in the compute type: bf16 for
// "medium" (fp32 accumulation, as the CUDA path and the peers), fp32 otherwise ("high" has no TF32
// on a CPU). W P runs on ATen's GEMMs, the symmetric W W^T and G G on gram_product_out.
//
// Each product is one plain GEMM (docs/design.md §4.3): with G = W W^T and H = G G, a step is
//   W' = a W + b G W + c G^2 W = P W,   P = c H + b G + a I,
// where P is formed in one s x s pass (fp32 arithmetic, rounded once) instead of a full-size pass
// over W after the product. Rounding P once keeps its diagonal, a small difference of large terms
// near convergence (a + b + c = 0.12 for quintic's first row), as accurate as the peers' fused
// bf16 epilogues; folding the scalars into a bf16 factor instead (G (c G + b I), B + a I) rounds
// the large terms first and lands up to twice as far from float64 (aol, polar_express).
// With c = 0 the G G product is skipped. Iterating on W^T (tall inputs) is a choice of products
// (G = W^T W, W' = W P, P symmetric), so no transpose is materialized.
#include <utility>
#include <vector>

#include "cpu/batched_gemm.h"
#include "cpu/cpu_product_plan.h"
#include "cpu/newton_schulz_gram_cpu.h"
#include "cpu/scratch_cpu.h"
#include "megatron_eopt/ns_algorithm.h"
#include "megatron_eopt/ns_scratch_layout.h"
#include "ops/aten_ops.h"

namespace megatron_eopt {

void standard_newton_schulz_cpu(const Tensor& w, Tensor& out, const NsOptions& opts, bool bf16_gemms) {
  const bool medium = opts.precision == NsPrecision::kMedium;
  const bool bf16 = medium && bf16_gemms;
  const bool round = medium && !bf16;
  const ScalarType type = bf16 ? kBFloat16 : kFloat;
  const bool t = opts.transpose;
  const int64_t batch = w.size(0), m = w.size(1), n = w.size(2), side = t ? n : m;
  const std::size_t steps = opts.schedule.size();

  // In fp32 W alternates between `out` and one scratch buffer, starting where the last step lands
  // in `out` (so an even number of steps starts in `out`). In bf16 it alternates between a scratch
  // buffer and the first half of out's storage, idle until the result is widened into it, whose
  // second half takes G and P where they fit (ns_cpu_bf16_layout). `out` may be w itself (the
  // in-place op): w is read only by the normalization, which is elementwise (in place where W0 is
  // `out`) or writes the scratch buffer, before any product writes `out`.
  // G, then G^2 overwritten in place by P: both symmetric, only their upper parts multiplied.
  // Where out's storage does not take G, G lives at the start of the spare iterate: it is dead
  // from the step's P on, and the spare iterate is written only by the step's last product, P W
  // (s x s fits in s x L unless a forced transpose made s the longer side). P cannot: that
  // product reads it. G then moves between the two iterates' storage with the iterate, so both
  // must be contiguous: out is in fp32.
  // The call's temporaries are taken at once (one pooled buffer).
  const bool first_in_out = !bf16 && steps % 2 == 0;
  const bool iterate_in_out = bf16 && out.is_contiguous();  // the second iterate in out's first half
  const NsCpuBf16Layout in_out = iterate_in_out ? ns_cpu_bf16_layout(batch, m, n, side) : NsCpuBf16Layout{-1, -1};
  const bool gram_in_spare = in_out.gram < 0 && side * side <= m * n && (bf16 || out.is_contiguous());
  std::vector<std::vector<int64_t>> sizes(bf16 && !iterate_in_out ? 2 : 1, std::vector<int64_t>{batch, m, n});
  if (in_out.gram < 0 && !gram_in_spare) sizes.push_back({batch, side, side});
  if (in_out.poly < 0) sizes.push_back({batch, side, side});
  CpuScratch scratch;
  const std::vector<Tensor> temps = scratch.take_all(sizes, type);
  std::size_t next = 1;  // temps[0] is the iterate that is not in out
  Tensor out_bf16;
  if (iterate_in_out) out_bf16 = aten::view_dtype(aten::view(out, {batch * m * n}), kBFloat16);
  const auto in_out_view = [&out_bf16](int64_t offset, const std::vector<int64_t>& shape) {
    return aten::view(aten::narrow(out_bf16, 0, offset, shape[0] * shape[1] * shape[2]), shape);
  };
  Tensor it, spare;
  if (!bf16) {
    it = first_in_out ? out : temps[0];
    spare = first_in_out ? temps[0] : out;
  } else {
    it = temps[0];
    spare = iterate_in_out ? in_out_view(0, {batch, m, n}) : temps[next++];
  }
  // The first batch * side * side values of a contiguous iterate, as the batch of G.
  const auto gram_at_start = [batch, side, m, n](const Tensor& iterate) {
    return aten::view(aten::narrow(aten::view(iterate, {batch * m * n}), 0, 0, batch * side * side),
                      {batch, side, side});
  };
  Tensor gram;
  if (in_out.gram >= 0) gram = in_out_view(in_out.gram, {batch, side, side});
  else if (gram_in_spare) gram = gram_at_start(spare);
  else gram = temps[next++];
  Tensor poly = in_out.poly >= 0 ? in_out_view(in_out.poly, {batch, side, side}) : temps[next++];
  normalize_input_out(it, w, opts.eps, opts.recipe);
  if (round) round_bf16_(it);
  const int64_t blocks = ns_symmetric_blocks(side, NsDevice::kCpu);
  // The transposed views the products take, made once: W (and G with it, where G lives in the
  // spare iterate) alternates between two buffers.
  Tensor gram_t = aten::mT(gram);
  Tensor it_t = aten::mT(it);
  Tensor spare_t = aten::mT(spare);
  Tensor other_gram, other_gram_t;  // G's place in the other iterate
  if (gram_in_spare) {
    other_gram = gram_at_start(it);
    other_gram_t = aten::mT(other_gram);
  }
  for (std::size_t k = 0; k < steps; ++k) {
    const NsCoefficients& co = opts.schedule[k];
    if (t) gram_product_out(gram, it_t, it, blocks, opts.products);  // W = X^T
    else gram_product_out(gram, it, it_t, blocks, opts.products);
    if (round) round_bf16_(gram);
    if (co.c != 0.0f) gram_product_out(poly, gram, gram_t, blocks, opts.products);  // G G = G G^T
    if (round && co.c != 0.0f) round_bf16_(poly);
    polynomial_out(poly, co.c, co.c != 0.0f ? poly : gram, co.b, gram, co.a);
    if (round) round_bf16_(poly);
    if (t) gemm_out(spare, it, poly);  // W P
    else gemm_out(spare, poly, it);    // P W
    if (round) round_bf16_(spare);
    std::swap(spare, it);
    std::swap(spare_t, it_t);
    if (gram_in_spare) {
      std::swap(gram, other_gram);
      std::swap(gram_t, other_gram_t);
    }
  }
  // A bf16 result in out's storage moves to the scratch iterate first: widening reads 2 bytes
  // and writes 4 per value, over itself.
  if (iterate_in_out && steps % 2 == 1) {
    aten::copy_(spare, it);
    std::swap(it, spare);
  }
  // Muon+ rides on the pass that widens the bf16 result; in fp32 it rescales the result in place.
  if (opts.recipe.frobenius_renorm) frobenius_renorm_out(out, bf16 ? it : out);
  else if (bf16) aten::copy_(out, it);
}

}  // namespace megatron_eopt
