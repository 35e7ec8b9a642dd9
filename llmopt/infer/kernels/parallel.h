// The kernels' own persistent thread pool, used by every parallel loop instead of
// at::parallel_for (the same idea as llama.cpp's ggml threadpool).
//
// Why: a decode step opens ~200 parallel regions per token. libgomp's fork/join wakes its
// team quickly only when called from the process's initial thread; the server runs the
// engine in a Python worker thread, where smollm2-135m at 2 threads measured ~60 tok/s
// against ~350 tok/s from the main thread (and ~150 tok/s at 1 thread); OMP_WAIT_POLICY /
// GOMP_SPINCOUNT only partly helped. These workers spin briefly on a generation counter and
// then sleep on a condition variable, whichever thread dispatches.
#pragma once

#include <algorithm>
#include <cstdint>

namespace llmopt {

// Threads parallel loops on this thread use: set by ThreadScope, else torch's
// at::get_num_threads() (so `threads=0` means torch's setting).
int64_t num_threads();

// Sets this thread's count for its lifetime (0: torch's at::get_num_threads()).
class ThreadScope {
 public:
  explicit ThreadScope(int64_t threads);
  ~ThreadScope();
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

 private:
  int64_t previous_;
};

namespace detail {
bool in_pool_task();
// Runs task(ctx, i) for i in [0, n_tasks) on up to n_tasks threads, the caller among them;
// rethrows the first exception a task threw once all have finished.
void run_tasks(int64_t n_tasks, void (*task)(void* ctx, int64_t i), void* ctx);
}  // namespace detail

// at::parallel_for's chunking: with T = min(num_threads(), ceil(range / grain)) threads,
// each gets one contiguous chunk of ceil(range / T) indices (grain 1: one chunk per thread).
// Runs f(begin, end) inline for a short range, one thread, or a call from inside a task.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t range = end - begin;
  grain = std::max<int64_t>(grain, 1);
  const int64_t threads = std::min<int64_t>(num_threads(), (range + grain - 1) / grain);
  if (threads <= 1 || detail::in_pool_task()) {
    f(begin, end);
    return;
  }
  struct Ctx {
    const F& f;
    int64_t begin, end, chunk;
  } ctx{f, begin, end, (range + threads - 1) / threads};
  detail::run_tasks(
      threads,
      [](void* p, int64_t i) {
        const Ctx& c = *static_cast<const Ctx*>(p);
        const int64_t b = c.begin + i * c.chunk, e = std::min(c.end, b + c.chunk);
        if (b < e) c.f(b, e);
      },
      &ctx);
}

}  // namespace llmopt
