// The thread pool's use: work items handed out to the caller and the pool's threads.
#ifndef JAX_FLASH_CPU_PARALLEL_H_
#define JAX_FLASH_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

namespace flash_cpu {

// Runs fn(item) for item in [0, n) on the caller and the pool's threads (`Pool`: num_threads()
// and Schedule(task), as XLA's ffi::ThreadPool). Items are handed out by an atomic counter; the
// caller returns once all are done, and a task that starts late finds none left and touches
// nothing.
template <typename Pool, typename F>
void ParallelFor(Pool& pool, int64_t n, F fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto drain = [state, n](const F* f) {
    for (int64_t item; (item = state->next.fetch_add(1)) < n;) {
      (*f)(item);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([drain, f = &fn]() { drain(f); });
  drain(&fn);
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_PARALLEL_H_
