// The one schema block of the megatron_eopt operator library. Implementations register per
// backend (CPU in csrc/cpu, CUDA in csrc/cuda); fake kernels live in megatron_eopt/ops/.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(megatron_eopt, m) {
  // ---- Newton–Schulz orthogonalization (docs/design.md §4.1) ----
  // x: fp32 (m, n) or (batch, m, n). coefficients: the (a, b, c) table flattened row by row;
  // `steps` rows are consumed, cycling through the table or, with repeat_last, repeating its last
  // row. transpose: iterate on x^T (default: when m > n). precision: medium | high | highest.
  // algorithm: standard (§4.1) | gram (the same iteration on the Gram matrix, §4.4) | auto (gram
  // where it does less work on this device, see ns_algorithm.h). The 2026 recipe, folded into the
  // first and last passes (ns_recipe.h; the defaults leave the results unchanged): eps_mode "clamp"
  // divides by max(||x||, eps), "add" by ||x|| + eps; norm_divisor s >= 1 multiplies the norm;
  // row_equilibration rescales each row to the RMS row norm first (MuonEq); frobenius_renorm sets
  // the result's Frobenius norm to sqrt(min(m, n)) (Muon+). products: how the symmetric products
  // run (ns_products.h): auto (measured, or the process-wide setting) | symmetric | full.
  m.def(
      "newton_schulz(Tensor x, float[] coefficients, int steps, bool repeat_last, float eps, "
      "bool? transpose, str precision, str algorithm, str eps_mode=\"clamp\", float norm_divisor=1.0, "
      "bool row_equilibration=False, bool frobenius_renorm=False, str products=\"auto\") -> Tensor");
  // The same in place: x (contiguous fp32) is replaced by its result. What the optimizers call when
  // nothing reads the Newton–Schulz input afterwards: the result takes the input's memory instead
  // of a tensor of its own (a step's working set per matrix is a quarter smaller).
  m.def(
      "newton_schulz_(Tensor(a!) x, float[] coefficients, int steps, bool repeat_last, float eps, "
      "bool? transpose, str precision, str algorithm, str eps_mode=\"clamp\", float norm_divisor=1.0, "
      "bool row_equilibration=False, bool frobenius_renorm=False, str products=\"auto\") -> ()");
  // Same for a list of 2-D matrices of any shapes: equal shapes run as one batch.
  m.def(
      "newton_schulz_list(Tensor[] xs, float[] coefficients, int steps, bool repeat_last, float eps, "
      "bool? transpose, str precision, str algorithm, str eps_mode=\"clamp\", float norm_divisor=1.0, "
      "bool row_equilibration=False, bool frobenius_renorm=False, str products=\"auto\") -> Tensor[]");

  // ---- Foreach momentum + weight decay and update (docs/design.md §4.6), multi-tensor style ----
  // Per index i: unscaling by grad_scale, l2 decay of the gradient (params read only then), the EMA
  // of the momentum buffer and the Newton–Schulz input (nesterov or not) written in ns_inputs'
  // dtype. The parameter-side decays (decoupled, independent, palm) are applied by foreach_update_.
  // Every per-step scalar (momentum, weight_decay, lr, grad_scale, found_inf) is a 0-dim fp32 or
  // fp64 tensor on the lists' device, read by the kernels: no host sync, graph-capturable, and a
  // value that changes every step (warm-up schedules) neither breaks nor recompiles a compiled
  // step. found_inf != 0 (GradScaler) leaves every tensor untouched. Tensors of one index may
  // differ in layout (a transposed parameter): the op then works on contiguous copies.
  m.def(
      "foreach_momentum_(Tensor[] grads, Tensor(a!)[] momentum_buffers, Tensor(b!)[] ns_inputs, "
      "Tensor[] params, Tensor momentum, bool nesterov, Tensor weight_decay, str weight_decay_method, "
      "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  // params[i] <- params[i] - f * params[i] - lr * scales[i] * updates[i], f from the method.
  m.def(
      "foreach_update_(Tensor(a!)[] params, Tensor[] updates, float[] scales, Tensor lr, Tensor weight_decay, "
      "str weight_decay_method, Tensor? found_inf=None) -> ()");

  // ---- Low-memory optimizer state (state_quantization.h) ----
  // foreach_momentum_ with the momentum kept in states[i]: bfloat16 (no scales), int8 or
  // float8_e4m3fn with one fp32 scale per block of block_size values of a row (states[i]'s last
  // dimension; scales[i] holds rows * ceil(row_len / block_size) values). The step reads the state,
  // updates it in fp32, writes the NS input from the fp32 momentum and stores the state back with
  // stochastic rounding, drawn from (seed, key, element index): seed is a 0-dim int64 tensor on the
  // lists' device, changed by the caller every step. draws: empty (key i, index the element's in
  // states[i]) or five values per tensor, key, local_rows, global_rows, global_cols, base
  // (DrawIndex: the element's index in its whole parameter, so shards and chunks draw alike).
  // grads, params and ns_inputs pair up with states[i] element by element in row-major order (any
  // shapes of equal numel).
  m.def(
      "foreach_momentum_quantized_(Tensor[] grads, Tensor(a!)[] states, Tensor(b!)[] scales, "
      "Tensor(c!)[] ns_inputs, Tensor[] params, Tensor momentum, bool nesterov, Tensor weight_decay, "
      "str weight_decay_method, int block_size, Tensor seed, Tensor? grad_scale=None, "
      "Tensor? found_inf=None, int[] draws=[]) -> ()");
  // adamuon_normalize_ with the second moment kept in moment2[i]: bfloat16 (v, no scales) or
  // float8_e4m3fn (sqrt(v), block scales as above); updates[i] fp32 of moment2[i]'s numel; draws
  // as above.
  m.def(
      "adamuon_normalize_quantized_(Tensor(a!)[] updates, Tensor(b!)[] moment2, Tensor(c!)[] scales, "
      "Tensor beta2, Tensor eps, int block_size, Tensor seed, Tensor? found_inf=None, int[] draws=[]) -> ()");

  // ---- Second-moment normalization of the raw NS output O (docs/design.md §4.7, AdaptiveMuon) ----
  // Per list entry i: updates[i] is O (fp32, 2-D), normalized in place; moment2[i] its fp32 state:
  // adamuon (m, n); normuon (m, 1) if m >= n else (1, n); namo (1,) (or 0-D). No bias correction.
  // namo also reads grads[i] (the gradient, divided by grad_scale when given) and ns_inputs[i] (the
  // NS input G~), shaped like O. beta2, eps, grad_scale and found_inf as the foreach scalars above.
  m.def(
      "adamuon_normalize_(Tensor(a!)[] updates, Tensor(b!)[] moment2, Tensor beta2, Tensor eps, "
      "Tensor? found_inf=None) -> ()");
  m.def(
      "normuon_normalize_(Tensor(a!)[] updates, Tensor(b!)[] moment2, Tensor beta2, Tensor eps, "
      "Tensor? found_inf=None) -> ()");
  m.def(
      "namo_normalize_(Tensor(a!)[] updates, Tensor(b!)[] moment2, Tensor[] grads, Tensor[] ns_inputs, "
      "Tensor beta2, Tensor eps, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");

  // ---- Split orthogonalization of fused projections (docs/design.md §4.8, Megatron's QKV split) ----
  // x (rows, n) fp32 = (num_groups, sum(split_sizes), n); part k = its rows of size
  // split_sizes[k] across the groups, orthogonalized as one (num_groups * split_sizes[k], n)
  // matrix (the NS arguments as in newton_schulz), times its Muon scale for (rows_k, n) and
  // extra_scale_factor when scale_mode is given (spectral | shape_scaling | unit_rms_norm). The
  // recipe arguments as in newton_schulz, each part being its own matrix (Muon+ before the scale).
  m.def(
      "newton_schulz_split(Tensor x, int[] split_sizes, int num_groups, float[] coefficients, int steps, "
      "bool repeat_last, float eps, bool? transpose, str precision, str? scale_mode, float extra_scale_factor, "
      "str algorithm, str eps_mode=\"clamp\", float norm_divisor=1.0, bool row_equilibration=False, "
      "bool frobenius_renorm=False, str products=\"auto\") -> Tensor");
  // QK-clip (MuonClip): weights[i] (rows, cols) cut into blocks of block_rows[i] rows (attention
  // heads); block b multiplied in place by factors[i][b] (fp32 math, stored in the weight's dtype).
  m.def("qk_clip_(Tensor(a!)[] weights, Tensor[] factors, int[] block_rows) -> ()");
}
