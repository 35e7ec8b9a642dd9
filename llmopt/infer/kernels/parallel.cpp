// The kernels' thread pool (see parallel.h for why it exists).
//
// One pool per process, sized to the dispatching call's thread count (rebuilt when the count
// changes). A dispatch publishes the job and bumps a generation counter; workers spin on it
// for kSpin (a decode step's regions are microseconds apart), then sleep on a condition
// variable so an idle server leaves the cores to the HTTP loop. Tasks are claimed from an
// atomic counter by the caller and the workers alike, so a worker that lost its core to
// another process delays nothing it has not started; the caller returns once every task is
// done. A mutex serialises dispatches, so calls from several threads at once take turns.
#include "parallel.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace llmopt {

namespace {

constexpr int64_t kMaxThreads = 4096;  // task counts must fit the 16 bits pack() gives them
constexpr auto kSpin = std::chrono::microseconds(50);  // a worker's busy wait before sleeping

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

thread_local int64_t t_threads = 0;     // ThreadScope's count for this thread, 0: torch's
thread_local bool t_in_task = false;    // inside a pool task: nested loops run inline

// The claim word packs (generation, task count, next task index), so a worker that woke late
// cannot claim a task of a job that has already finished.
inline uint64_t pack(uint64_t gen, uint64_t n_tasks, uint64_t next) {
  return gen << 32 | n_tasks << 16 | next;
}

class Pool {
 public:
  explicit Pool(int64_t size) : size_(size) {
    for (int64_t i = 1; i < size; ++i) workers_.emplace_back([this] { work(); });
  }

  ~Pool() {
    stop_.store(true);
    wake(next_gen());
    for (auto& w : workers_) w.join();
  }

  int64_t size() const { return size_; }

  void dispatch(int64_t n_tasks, void (*task)(void*, int64_t), void* ctx) {
    task_ = task;
    ctx_ = ctx;
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = next_gen();
    claim_.store(pack(gen, n_tasks, 0), std::memory_order_release);
    wake(gen);
    t_in_task = true;
    run_claimed(gen);  // the caller takes tasks too, and any a late worker has not claimed
    t_in_task = false;
    for (int64_t spin = 0; done_.load(std::memory_order_acquire) != n_tasks; ++spin) {
      if (spin < 1024)
        cpu_relax();
      else
        std::this_thread::yield();  // a worker running a task may have lost its core
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  uint64_t next_gen() const { return (gen_.load() + 1) & 0xffffffff; }  // 32 bits: see pack()

  void wake(uint64_t gen) {
    gen_.store(gen);  // seq_cst, paired with the sleepers_ increment in wait_next()
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      sleep_cv_.notify_all();
    }
  }

  // Claims and runs tasks of job `gen` until none is left.
  void run_claimed(uint64_t gen) {
    uint64_t c = claim_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t n_tasks = (c >> 16) & 0xffff, next = c & 0xffff;
      if (c >> 32 != gen || next >= n_tasks) return;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
      try {
        task_(ctx_, static_cast<int64_t>(next));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
      c = claim_.load(std::memory_order_acquire);
    }
  }

  uint64_t wait_next(uint64_t seen) {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    for (int64_t spin = 1;; ++spin) {
      const uint64_t g = gen_.load(std::memory_order_acquire);
      if (g != seen) return g;
      cpu_relax();
      if (spin % 64 == 0 && std::chrono::steady_clock::now() > deadline) break;
    }
    std::unique_lock<std::mutex> lock(sleep_mutex_);
    sleepers_.fetch_add(1);
    sleep_cv_.wait(lock, [&] { return gen_.load() != seen; });
    sleepers_.fetch_sub(1);
    return gen_.load(std::memory_order_acquire);
  }

  void work() {
    t_in_task = true;
    for (uint64_t gen = 0;;) {
      gen = wait_next(gen);
      if (stop_.load()) return;
      run_claimed(gen);
    }
  }

  const int64_t size_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0};    // bumped per job (low 32 bits go into claim_)
  std::atomic<uint64_t> claim_{0};  // pack(generation, task count, next unclaimed task)
  std::atomic<int64_t> done_{0};    // finished tasks of the current job
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex sleep_mutex_, error_mutex_;
  std::condition_variable sleep_cv_;
  // the current job: written by the dispatcher only once every task of the last one is done
  void (*task_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  std::exception_ptr error_;
};

// Never destroyed: joining threads during interpreter shutdown can hang, and the process
// exit ends them anyway. A forked child gets a fresh state (the parent's threads are gone).
struct State {
  std::mutex dispatch;
  Pool* pool = nullptr;
};
State* g_state = nullptr;
std::once_flag g_once;

State& state() {
  std::call_once(g_once, [] {
    g_state = new State();
    pthread_atfork(nullptr, nullptr, [] { g_state = new State(); });
  });
  return *g_state;
}

}  // namespace

int64_t num_threads() {
  if (t_threads > 0) return t_threads;
  return std::min<int64_t>(at::get_num_threads(), kMaxThreads);
}

ThreadScope::ThreadScope(int64_t threads) : previous_(t_threads) {
  TORCH_CHECK(threads >= 0 && threads <= kMaxThreads, "threads=", threads,
              " must be in [0, ", kMaxThreads, "] (0: torch's setting)");
  t_threads = threads;
}

ThreadScope::~ThreadScope() { t_threads = previous_; }

namespace detail {

bool in_pool_task() { return t_in_task; }

void run_tasks(int64_t n_tasks, void (*task)(void*, int64_t), void* ctx) {
  State& s = state();
  const int64_t size = std::max(num_threads(), n_tasks);
  std::lock_guard<std::mutex> lock(s.dispatch);
  if (s.pool == nullptr || s.pool->size() != size) {
    delete s.pool;  // joins the old workers
    s.pool = new Pool(size);
  }
  s.pool->dispatch(n_tasks, task, ctx);
}

}  // namespace detail

}  // namespace llmopt
