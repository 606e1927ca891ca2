// The kernels' own threads: a pool whose idle threads spin for a bounded time, then sleep.
//
// at::parallel_for runs on libgomp, whose idle threads spin GOMP_SPINCOUNT rounds of `pause` after every
// parallel region (300000 by default, several ms on a Xeon whose `pause` takes ~100 cycles) and then sleep,
// with no bound in time. Two things went wrong with that on a 2-core machine:
// - stages as processes on shared cores: after a worker's stage, its spinning thread took a core from the next
//   worker's stage for milliseconds (4 local workers: the stages' compute 51-93% above the same layers in one
//   process), and a small spin count instead made every region inside a stage wake a sleeping thread (30 layers
//   in 10.8 ms at GOMP_SPINCOUNT=1000 against 4.5 ms; a wake costs ~100 us in this VM);
// - a second thread doing tensor work: once the main thread had run a region, libgomp counted more threads
//   than cores and "throttled" every pool's spin to almost nothing, so each region of the model thread woke its
//   team from sleep (a 1536x576 matmul: 30 us on the first thread, 130 us on a second one).
// Here idle threads spin for 200 us of wall time (enough for the gaps between one step's kernels, short
// beside the next stage's compute), then block; every thread that calls in finds the same pool, and a call
// made while another thread holds it runs serially, so results never depend on who runs what: each kernel
// splits its work over outputs only. One decode step through local workers, same runs alternated: 4 workers
// 13.1-14.4 ms on libgomp, 9.9-13.0 on this pool; 2 workers 9.1-9.3 against 7.4-7.9.
#include "common.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unistd.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ES_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define ES_RELAX() asm volatile("yield")
#else
#define ES_RELAX() std::this_thread::yield()
#endif

namespace {

using Clock = std::chrono::steady_clock;
using Body = std::function<void(int64_t, int64_t)>;
thread_local bool in_pool = false;  // a pool thread, or a caller inside its own call: nested calls run serially

class Pool {
 public:
  Pool() = default;
  Pool(const Pool&) = delete;

  // fn over [begin, end) in n chunks of `chunk` (the last shorter), chunk 0 on the calling thread
  void run(int64_t begin, int64_t end, int64_t chunk, int n, const Body& fn) {
    std::unique_lock<std::mutex> own(busy_, std::try_to_lock);
    if (!own.owns_lock()) return fn(begin, end);
    grow(n - 1);
    const int workers = static_cast<int>(threads_.size());
    body_ = &fn, begin_ = begin, end_ = end, chunk_ = chunk, n_ = n, error_ = nullptr;
    pending_.store(workers, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mutex_);  // a sleeper is inside cv.wait or will see the new generation
      cv_.notify_all();
    }
    in_pool = true;
    std::exception_ptr mine;
    try {
      fn(begin, std::min(end, begin + chunk));
    } catch (...) {
      mine = std::current_exception();
    }
    in_pool = false;
    for (int k = 0; pending_.load(std::memory_order_acquire) > 0; ++k)
      if (k < 4096) ES_RELAX(); else std::this_thread::yield();  // a worker lost its core: let it have ours
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void grow(int workers) {
    while (static_cast<int>(threads_.size()) < workers) {
      const int index = static_cast<int>(threads_.size()) + 1;
      // detached: the pool lives until the process ends, and joining at exit could wait on a sleeping thread
      // it starts from the generation before the call that made it, so it takes part in that call
      const uint64_t seen = gen_.load(std::memory_order_relaxed);
      threads_.emplace_back([this, index, seen] { loop(index, seen); });
      threads_.back().detach();
    }
  }

  void loop(int index, uint64_t seen) {
    in_pool = true;
    for (;;) {
      seen = await(seen);
      if (index < n_) {  // chunks beyond the call's count: nothing to do but check in
        const int64_t lo = begin_ + index * chunk_;
        if (lo < end_) {
          try {
            (*body_)(lo, std::min(end_, lo + chunk_));
          } catch (...) {
            std::lock_guard<std::mutex> lk(mutex_);
            error_ = std::current_exception();
          }
        }
      }
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  // spin until the generation moves on, for spin_ of wall time at most, then sleep until it does
  uint64_t await(uint64_t seen) {
    const auto t0 = Clock::now();
    for (int k = 1;; ++k) {
      const uint64_t g = gen_.load(std::memory_order_acquire);
      if (g != seen) return g;
      ES_RELAX();
      if ((k & 63) == 0 && Clock::now() - t0 > spin_) {
        std::unique_lock<std::mutex> lk(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lk, [&] { return gen_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
    }
  }

  std::mutex busy_;  // held by the thread whose call the pool runs
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> gen_{0};  // one more per call; the call's fields below are written before it moves
  std::atomic<int> pending_{0}, sleepers_{0};
  // measured with 4 local workers on 2 cores, one decode step through them: 10-12.5 ms at 200 us, 14-16 at 0
  // or 50 (a wake per kernel between layers), 15 at 1000 (the spin takes a core from the next stage)
  static constexpr std::chrono::microseconds spin_{200};
  std::mutex mutex_;
  std::condition_variable cv_;
  const Body* body_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  int n_ = 0;
  std::exception_ptr error_;
};

// The process's pool, made at first use; after a fork the child (which has none of the parent's threads)
// makes its own. Never freed: detached threads may still be inside `await` when the process exits.
Pool& pool() {
  static pid_t owner = 0;
  static Pool* current = nullptr;
  static std::mutex made;
  std::lock_guard<std::mutex> lk(made);
  if (current == nullptr || owner != getpid()) {
    current = new Pool();
    owner = getpid();
  }
  return *current;
}

}  // namespace

void parallel_chunks(int64_t begin, int64_t end, int64_t grain, const Body& fn) {
  if (begin >= end) return;
  const int64_t most = (end - begin + grain - 1) / grain;
  const int n = static_cast<int>(std::min<int64_t>(at::get_num_threads(), most));
  if (n <= 1 || in_pool) return fn(begin, end);
  pool().run(begin, end, (end - begin + n - 1) / n, n, fn);
}
