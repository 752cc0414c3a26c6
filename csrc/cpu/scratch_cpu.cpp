#include "cpu/scratch_cpu.h"

#include <cstddef>

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

Tensor CpuScratch::take(const std::vector<int64_t>& sizes, ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  Pool& pool = thread_pool();
  const std::vector<Tensor>& free = pool.buffers;
  std::size_t best = free.size();
  for (std::size_t i = 0; i < free.size(); ++i) {
    const Tensor& t = free[i];
    if (t.scalar_type() == dtype && t.numel() >= numel && (best == free.size() || t.numel() < free[best].numel())) {
      best = i;
    }
  }
  Tensor flat = best < free.size() ? take_kept(pool, best, process_budget, bytes_of)
                                   : aten::empty({numel}, dtype, Device(kCPU));
  lent_.push_back(flat);
  return aten::view(aten::narrow(flat, 0, 0, numel), sizes);
}

CpuScratch::~CpuScratch() { keep_returned(thread_pool(), lent_, kMaxPooledBytes, process_budget, bytes_of); }

}  // namespace megatron_eopt
