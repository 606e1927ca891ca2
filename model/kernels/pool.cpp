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
// made while another thread holds it runs serially; chunks go to whichever thread claims them first. Results
// never depend on who runs what: each kernel splits its work over outputs only. One decode step through local workers, same runs alternated: 4 workers
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

  // fn over [begin, end) in n chunks of `chunk` (the last shorter); the calling thread takes chunks too
  void run(int64_t begin, int64_t end, int64_t chunk, int n, const Body& fn) {
    std::unique_lock<std::mutex> own(busy_, std::try_to_lock);
    if (!own.owns_lock()) return fn(begin, end);
    grow(n - 1);
    body_ = &fn, begin_ = begin, end_ = end, chunk_ = chunk, error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t call = ++calls_ & 0xffffffff;
    claim_.store(call << 32 | static_cast<uint64_t>(n) << 16, std::memory_order_seq_cst);  // published
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mutex_);  // a sleeper is inside cv.wait or will see the new call
      cv_.notify_all();
    }
    in_pool = true;
    work(call);
    in_pool = false;
    for (int k = 0; done_.load(std::memory_order_acquire) < n; ++k)
      if (k < 4096) ES_RELAX(); else std::this_thread::yield();  // a chunk's thread lost its core
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void grow(int workers) {
    while (static_cast<int>(threads_.size()) < workers) {
      // detached: the pool lives until the process ends, and joining at exit could wait on a sleeping thread
      const uint64_t seen = claim_.load(std::memory_order_relaxed) >> 32;  // so it takes part in this call
      threads_.emplace_back([this, seen] { loop(seen); });
      threads_.back().detach();
    }
  }

  void loop(uint64_t seen) {
    in_pool = true;
    for (;;) work(seen = await(seen));
  }

  // Take the call's chunks until none is left. Chunks are claimed, not assigned: a thread that wakes late,
  // or waits for a core another process holds, finds its share done by the threads that ran. In a 4-worker
  // server each stage's kernels took about 3 ms more than its layers' share (the 4 stages' own times added
  // up to 17.0-18.7 ms a decode step with chunks assigned to threads, 9.9-11.1 claimed). The call's fields are
  // read only after a claim, and the caller rewrites them only after every claimed chunk is done, so they are
  // the claimed call's.
  void work(uint64_t call) {
    for (;;) {
      uint64_t c = claim_.load(std::memory_order_acquire);
      do {
        if (c >> 32 != call || (c & 0xffff) >= (c >> 16 & 0xffff)) return;  // another call, or all claimed
      } while (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel));
      const int64_t lo = begin_ + static_cast<int64_t>(c & 0xffff) * chunk_;
      if (lo < end_) {
        try {
          (*body_)(lo, std::min(end_, lo + chunk_));
        } catch (...) {
          std::lock_guard<std::mutex> lk(mutex_);
          if (!error_) error_ = std::current_exception();
        }
      }
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  // spin until a new call is published, for spin_ of wall time at most, then sleep until one is
  uint64_t await(uint64_t seen) {
    const auto t0 = Clock::now();
    for (int k = 1;; ++k) {
      const uint64_t call = claim_.load(std::memory_order_acquire) >> 32;
      if (call != seen) return call;
      ES_RELAX();
      if ((k & 63) == 0 && Clock::now() - t0 > spin_) {
        std::unique_lock<std::mutex> lk(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lk, [&] { return claim_.load(std::memory_order_seq_cst) >> 32 != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
    }
  }

  std::mutex busy_;  // held by the thread whose call the pool runs
  std::vector<std::thread> threads_;
  uint64_t calls_ = 0;  // the caller's count of calls; its low 32 bits name the call in claim_
  std::atomic<uint64_t> claim_{0};  // call << 32 | chunks << 16 | next chunk to claim
  std::atomic<int> done_{0}, sleepers_{0};
  // measured with 4 local workers on 2 cores, one decode step through them: 10-12.5 ms at 200 us, 14-16 at 0
  // or 50 (a wake per kernel between layers), 15 at 1000 (the spin takes a core from the next stage)
  static constexpr std::chrono::microseconds spin_{200};
  std::mutex mutex_;
  std::condition_variable cv_;
  const Body* body_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
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
