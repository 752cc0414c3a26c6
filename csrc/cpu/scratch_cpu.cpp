#include "cpu/scratch_cpu.h"

#include <cstddef>

#include "torch/aten_ops.h"

namespace megatron_eopt {
namespace {

struct Pool {
  std::vector<Tensor> free;  // flat buffers, oldest first
  int64_t bytes = 0;
};

Pool& thread_pool() {
  thread_local Pool pool;
  return pool;
}

int64_t bytes_of(const Tensor& flat) { return flat.numel() * (flat.scalar_type() == kBFloat16 ? 2 : 4); }

}  // namespace

Tensor CpuScratch::take(const std::vector<int64_t>& sizes, ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  Pool& pool = thread_pool();
  std::size_t best = pool.free.size();
  for (std::size_t i = 0; i < pool.free.size(); ++i) {
    const Tensor& t = pool.free[i];
    if (t.scalar_type() == dtype && t.numel() >= numel &&
        (best == pool.free.size() || t.numel() < pool.free[best].numel())) {
      best = i;
    }
  }
  Tensor flat;
  if (best < pool.free.size()) {
    flat = pool.free[best];
    pool.bytes -= bytes_of(flat);
    pool.free.erase(pool.free.begin() + static_cast<std::ptrdiff_t>(best));
  } else {
    flat = aten::empty({numel}, dtype, Device(kCPU));
  }
  lent_.push_back(flat);
  return aten::view(aten::narrow(flat, 0, 0, numel), sizes);
}

CpuScratch::~CpuScratch() {
  Pool& pool = thread_pool();
  for (Tensor& t : lent_) {
    pool.bytes += bytes_of(t);
    pool.free.push_back(std::move(t));
  }
  while (pool.bytes > kMaxPooledBytes && !pool.free.empty()) {
    pool.bytes -= bytes_of(pool.free.front());
    pool.free.erase(pool.free.begin());
  }
}

}  // namespace megatron_eopt
