// Symmetric products on CUDA (lt_symmetric.h): the panels run through lt_strided_batched_gemm, one
// 32 x 32-tiled transpose copy fills the blocks above the block diagonal.
#include "lt_symmetric.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "megatron_eopt/cuda_check.h"

namespace megatron_eopt {
namespace {

std::atomic<int64_t> g_max_blocks{0};  // 0: no rule set, the measured default
std::atomic<int64_t> g_min_panel{1024};

constexpr int kTile = 32;
constexpr int kRowsPerPass = 8;
constexpr unsigned kMaxGridZ = 65535;

// d: batch column-major side x side matrices (leading dimension ld, batch stride `stride`).
// D[r, c] = D[c, r] wherever mirror_source_is_lower(r, c, width). The copied entries and their
// sources lie on opposite sides of the block diagonal, so no entry is both read and written.
// T is a same-size integer type: the copy moves bits, whatever the floating type.
template <typename T>
__global__ void mirror_upper_blocks_kernel(T* __restrict__ d, int64_t batch, int64_t side, int64_t ld, int64_t stride,
                                           int64_t width) {
  __shared__ T tile[kTile][kTile + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c_last = std::min<int64_t>(c0 + kTile, side) - 1;
  if (r0 / width >= c_last / width) return;  // the whole tile is on or below the block diagonal
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    T* m = d + b * stride;
    // Read D[c, r] (contiguous along c) ...
    for (int i = threadIdx.y; i < kTile; i += kRowsPerPass) {
      const int64_t r = r0 + i, c = c0 + threadIdx.x;
      if (r < side && c < side && mirror_source_is_lower(r, c, width)) tile[i][threadIdx.x] = m[c + r * ld];
    }
    __syncthreads();
    // ... and write D[r, c] (contiguous along r).
    for (int j = threadIdx.y; j < kTile; j += kRowsPerPass) {
      const int64_t c = c0 + j, r = r0 + threadIdx.x;
      if (r < side && c < side && mirror_source_is_lower(r, c, width)) m[r + c * ld] = tile[threadIdx.x][j];
    }
    __syncthreads();  // the tile is reused by the next matrix
  }
}

void mirror_upper_blocks(void* d, std::size_t element_bytes, int64_t batch, int64_t side, int64_t ld, int64_t stride,
                         int64_t width, cudaStream_t stream) {
  const unsigned tiles = static_cast<unsigned>((side + kTile - 1) / kTile);
  const dim3 grid(tiles, tiles, static_cast<unsigned>(std::min<int64_t>(batch, kMaxGridZ)));
  const dim3 block(kTile, kRowsPerPass);
  if (element_bytes == 2) {
    mirror_upper_blocks_kernel<<<grid, block, 0, stream>>>(static_cast<uint16_t*>(d), batch, side, ld, stride, width);
  } else {
    mirror_upper_blocks_kernel<<<grid, block, 0, stream>>>(static_cast<uint32_t*>(d), batch, side, ld, stride, width);
  }
  MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
}

}  // namespace

SymmetricPanelRule symmetric_panel_rule() { return {g_max_blocks.load(), g_min_panel.load()}; }

void set_symmetric_panel_rule(const SymmetricPanelRule& rule) {
  g_max_blocks.store(rule.max_blocks < 0 ? 0 : rule.max_blocks);
  g_min_panel.store(rule.min_panel < kSymmetricPanelQuantum ? kSymmetricPanelQuantum : rule.min_panel);
}

int64_t cuda_symmetric_panel_width(int64_t side, int64_t batch, bool bf16, NsProducts products) {
  if (products == NsProducts::kFull) return side;
  if (products == NsProducts::kSymmetric) return symmetric_panel_width(side, kSymmetricBlocks);
  const SymmetricPanelRule rule = symmetric_panel_rule();
  if (rule.max_blocks == 0) return symmetric_panel_width(side, measured_symmetric_blocks(side, batch, bf16));
  return symmetric_panel_width(side, rule);
}

void lt_symmetric_batched_gemm(const LtGemmArgs& args, int64_t width, const LtContext& ctx) {
  const GemmShape& full = *args.shape;
  if (width >= full.rows || full.rows != full.cols) {
    lt_strided_batched_gemm(args, ctx);
    return;
  }
  const std::size_t ab = lt_element_bytes(args.types.ab), cd = lt_element_bytes(args.types.cd);
  const std::vector<GemmPanel> panels = symmetric_panels(full, width);
  for (const GemmPanel& p : panels) {
    LtGemmArgs panel = args;
    panel.shape = &p.shape;
    panel.a = static_cast<const char*>(args.a) + p.a_offset * ab;
    panel.b = static_cast<const char*>(args.b) + p.b_offset * ab;
    panel.c = static_cast<const char*>(args.c) + p.cd_offset * cd;
    panel.d = static_cast<char*>(args.d) + p.cd_offset * cd;
    lt_strided_batched_gemm(panel, ctx);
  }
  mirror_upper_blocks(args.d, cd, args.batch, full.rows, full.ldc, full.stride_c, width, ctx.stream);
}

}  // namespace megatron_eopt
