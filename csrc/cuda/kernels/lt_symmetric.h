// Products with a symmetric result on CUDA: the lower block triangle through cuBLASLt panels
// (symmetric_panels.h) and one mirror kernel for the rest. By default only where a GPU run measured
// it faster; a process-wide rule overrides that (docs/newton-schulz.md). Torch-free.
#pragma once

#include <cstdint>

#include "lt_matmul.h"
#include "megatron_eopt/symmetric_panels.h"

namespace megatron_eopt {

// The process-wide rule the CUDA Newton–Schulz executors follow for their symmetric products.
// Default {0, 1024}: none set, the measured default applies (measured_symmetric_blocks).
SymmetricPanelRule symmetric_panel_rule();
void set_symmetric_panel_rule(const SymmetricPanelRule& rule);

// The panel width of a product of this side and batch (bf16: "medium" operands) under the
// process rule, or under the measured default when none is set; a call's `products` overrides
// both: full gives one GEMM (width = side), symmetric kSymmetricBlocks block columns.
int64_t cuda_symmetric_panel_width(int64_t side, int64_t batch, bool bf16, NsProducts products);

// Block columns of a product whose call asks for symmetric products (the H100 measurement's best).
constexpr int64_t kSymmetricBlocks = 4;

// D = alpha op(A) op(B) + beta C for a product whose result is symmetric (square, C symmetric when
// read): panels of `width` columns, then the upper blocks copied from the lower ones. width >=
// rows: one full GEMM. Enqueued on ctx.stream; graph-capturable once a call outside capture has
// planned the panels' GEMMs.
void lt_symmetric_batched_gemm(const LtGemmArgs& args, int64_t width, const LtContext& ctx);

}  // namespace megatron_eopt
