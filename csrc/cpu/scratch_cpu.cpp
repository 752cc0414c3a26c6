#include "cpu/scratch_cpu.h"

#include <cstddef>

#include "megatron_eopt/ns_scratch_layout.h"
#include "ops/aten_ops.h"

namespace megatron_eopt {
namespace {

KeptBytesBudget process_budget(kMaxPooledBytesPerProcess);  // constant-initialized, trivially destroyed

int64_t bytes_of(const Tensor& flat) { return flat.numel() * (flat.scalar_type() == kBFloat16 ? 2 : 4); }

struct Pool : KeptBuffers<Tensor> {
  // a thread that ends gives its share of the process's cap back
  ~Pool() { process_budget.release(bytes); }
};

Pool& thread_pool() {
  thread_local Pool pool;
  return pool;
}

}  // namespace

Tensor CpuScratch::take(const std::vector<int64_t>& sizes, ScalarType dtype) { return take_all({sizes}, dtype)[0]; }

std::vector<Tensor> CpuScratch::take_all(const std::vector<std::vector<int64_t>>& sizes, ScalarType dtype) {
  const int64_t elem_bytes = dtype == kBFloat16 ? 2 : 4;
  std::vector<int64_t> offsets, counts;
  int64_t numel = 0;
  for (const std::vector<int64_t>& shape : sizes) {
    int64_t count = 1;
    for (int64_t s : shape) count *= s;
    offsets.push_back(numel);
    counts.push_back(count);
    numel += ns_cpu_aligned_elems(count, elem_bytes);  // each tensor starts on a cache line
  }
  Pool& pool = thread_pool();
  const std::vector<Tensor>& free = pool.buffers;
  std::size_t best = free.size();
  for (std::size_t i = 0; i < free.size(); ++i) {
    const Tensor& t = free[i];
    if (t.scalar_type() == dtype && t.numel() >= numel && (best == free.size() || t.numel() < free[best].numel())) {
      best = i;
    }
  }
  Tensor flat;
  if (best < free.size()) {
    flat = take_kept(pool, best, process_budget, bytes_of);
  } else {
    drop_smaller(pool, numel * elem_bytes, kMaxPooledBytes, process_budget, bytes_of,
                 [dtype](const Tensor& t) { return t.scalar_type() == dtype; });
    flat = aten::empty({numel}, dtype, Device(kCPU));
  }
  lent_.push_back(flat);
  std::vector<Tensor> out;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    out.push_back(aten::view(aten::narrow(flat, 0, offsets[i], counts[i]), sizes[i]));
  }
  return out;
}

CpuScratch::~CpuScratch() { keep_returned(thread_pool(), lent_, kMaxPooledBytes, process_budget, bytes_of); }

}  // namespace megatron_eopt
