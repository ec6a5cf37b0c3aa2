#include "poolkeeper/pools/logging_pool.hpp"

#include <pthread.h>

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <set>
#include <thread>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace poolkeeper {

namespace {

constexpr const char* kHeader = "Thread,Time,Action,Pointer,Size,Stream\n";

// Open adaptors, flushed by the exit handler: a process that never closes its pool (the usual
// case for a process-wide allocator) still leaves a complete log.
// Immortal: the exit handler is registered before the first set would be built, so a static set
// was destroyed before the handler ran, which then walked a freed tree (a hang at exit whenever a
// LoggingPool outlived the interpreter).
std::mutex& g_open_mu = *new std::mutex;
std::set<LoggingPool*>& open_pools() {
  static std::set<LoggingPool*>& s = *new std::set<LoggingPool*>;
  return s;
}
std::once_flag g_atexit_once;

// fork(): an inherited adaptor belongs to the parent, which writes its buffered lines. The child
// must neither write them again at its exit (the file offset is shared: every line appeared twice)
// nor wait on g_open_mu held by a parent thread that did not come through the fork.
void open_fork_prepare() { g_open_mu.lock(); }
void open_fork_parent() { g_open_mu.unlock(); }
void open_fork_child() {
  open_pools().clear();
  g_open_mu.unlock();
}

std::uint64_t thread_id() {
  thread_local std::uint64_t tid = [] {
#if defined(__linux__)
    return static_cast<std::uint64_t>(::syscall(SYS_gettid));
#else
    return static_cast<std::uint64_t>(std::hash<std::thread::id>{}(std::this_thread::get_id()));
#endif
  }();
  return tid;
}

// "HH:MM:SS.ffffff" in local time; localtime_r only when the second changes (it takes a lock in
// glibc and costs about a microsecond).
char* put_time(char* out) {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  thread_local time_t cached_sec = -1;
  thread_local char hms[9];
  if (ts.tv_sec != cached_sec) {
    tm t{};
    localtime_r(&ts.tv_sec, &t);
    const int v[3] = {t.tm_hour, t.tm_min, t.tm_sec};
    for (int i = 0; i < 3; ++i) {
      hms[i * 3] = char('0' + v[i] / 10);
      hms[i * 3 + 1] = char('0' + v[i] % 10);
      if (i < 2) hms[i * 3 + 2] = ':';
    }
    cached_sec = ts.tv_sec;
  }
  std::memcpy(out, hms, 8);
  out += 8;
  *out++ = '.';
  unsigned us = unsigned(ts.tv_nsec / 1000);
  for (int i = 5; i >= 0; --i) {
    out[i] = char('0' + us % 10);
    us /= 10;
  }
  return out + 6;
}

// One CSV line into `out` (at least 128 bytes); returns its length.
std::size_t format_line(char* out, const char* action, std::size_t action_len, std::uintptr_t p, std::size_t n,
                        Stream s) {
  char* o = out;
  char* end = out + 128;
  o = std::to_chars(o, end, thread_id()).ptr;
  *o++ = ',';
  o = put_time(o);
  *o++ = ',';
  std::memcpy(o, action, action_len);
  o += action_len;
  *o++ = ',';
  o = std::to_chars(o, end, static_cast<std::uint64_t>(p), 16).ptr;
  *o++ = ',';
  o = std::to_chars(o, end, static_cast<std::uint64_t>(n)).ptr;
  *o++ = ',';
  o = std::to_chars(o, end, s == kNoStream ? std::uint64_t{0} : static_cast<std::uint64_t>(s), 16).ptr;
  *o++ = '\n';
  return std::size_t(o - out);
}

constexpr char kAlloc[] = "allocate";
constexpr char kFree[] = "free";
constexpr char kFail[] = "allocate failure";

}  // namespace

LoggingPool::LoggingPool(std::shared_ptr<Pool> inner, const std::string& path, std::size_t buffer_bytes)
    : Pool(inner ? inner->upstream() : nullptr), inner_(std::move(inner)), path_(path), cap_(buffer_bytes) {
  if (!inner_) throw InvalidArgument("LoggingPool needs an inner pool");
  if (inner_->closed()) throw PoolClosed(inner_->name() + " #" + std::to_string(inner_->id()) + " is closed");
  if (path_.empty()) throw InvalidArgument("LoggingPool: the log path is empty");
  // fopen() reads the path up to its first NUL: "a\0b.csv" created or truncated a file "a".
  if (const std::size_t nul = path_.find('\0'); nul != std::string::npos)
    throw InvalidArgument("LoggingPool: the log path is not a valid path: it has a NUL byte at offset " +
                          std::to_string(nul));
  // The whole buffer is reserved now: 2^62 passed the absurd-size check and ended as
  // std::bad_alloc (after the file had been created, and its FILE* was lost).
  if (cap_ > kMaxLogBuffer)
    throw InvalidArgument("LoggingPool: buffer_bytes must be at most 1 GiB; got " + std::to_string(cap_));
  if (cap_ < 4096) cap_ = 4096;
  buf_.reserve(cap_ + 256);
  buf_.append(kHeader);
  sizes_.reserve(1024);
  file_ = std::fopen(path_.c_str(), "w");
  if (!file_)
    throw InvalidArgument("LoggingPool: cannot create the log file '" + path_ + "': " + std::strerror(errno));
  // Our own buffer does the batching; stdio's would only copy it once more.
  std::setvbuf(file_, nullptr, _IONBF, 0);
  try {
    std::call_once(g_atexit_once, [] {
      std::atexit(&LoggingPool::flush_all_at_exit);
      pthread_atfork(open_fork_prepare, open_fork_parent, open_fork_child);
    });
    std::lock_guard<std::mutex> g(g_open_mu);
    open_pools().insert(this);
  } catch (...) {  // (std::bad_alloc, std::system_error) no destructor runs for a throwing constructor
    std::fclose(file_);
    file_ = nullptr;
    throw;
  }
  // Last, as every pool: in the directory a fork marks it (closed in the child, its methods a
  // typed error); outside it, a child's stats()/validate() reached the inner pool's lock, which a
  // parent thread may have held at the fork (a hang), and its exit wrote the parent's lines again.
  join_directory();
}

LoggingPool::~LoggingPool() {
  unregister();
  {
    std::lock_guard<std::mutex> g(g_open_mu);
    open_pools().erase(this);
  }
  // Inherited through fork(): the buffered lines are the parent's to write, and mu_ / file_mu_
  // may have been held at the fork.
  if (forked()) return;
  try {
    finish_file();
  } catch (...) {
  }
}

void LoggingPool::flush_all_at_exit() {
  std::lock_guard<std::mutex> g(g_open_mu);
  for (LoggingPool* p : open_pools()) {
    try {
      p->flush();
    } catch (...) {
    }
  }
}

void LoggingPool::write_out(std::string& out) {
  if (!file_ || out.empty()) return;
  const std::size_t w = std::fwrite(out.data(), 1, out.size(), file_);
  if (w != out.size()) ++write_errors_;
  written_ += w;
  out.clear();
}

void LoggingPool::append_locked(std::unique_lock<std::mutex>& lk, const char* line, std::size_t len) {
  buf_.append(line, len);
  ++events_;
  if (buf_.size() < cap_) return;
  // Hand the full buffer to the file outside the log lock; taking file_mu_ first keeps buffers
  // in log order when two threads fill one each.
  std::string out;
  out.reserve(cap_ + 256);
  out.swap(buf_);
  std::unique_lock<std::mutex> f(file_mu_);
  lk.unlock();
  write_out(out);
}

void* LoggingPool::do_allocate(std::size_t nbytes, Stream s) {
  void* p;
  try {
    p = inner_->allocate(nbytes, s);
  } catch (const OutOfMemory&) {
    char line[128];
    const std::size_t len = format_line(line, kFail, sizeof(kFail) - 1, 0, nbytes, s);
    std::unique_lock<std::mutex> lk(mu_);
    append_locked(lk, line, len);
    throw;
  }
  char line[128];
  const std::size_t len = format_line(line, kAlloc, sizeof(kAlloc) - 1, reinterpret_cast<std::uintptr_t>(p), nbytes, s);
  std::unique_lock<std::mutex> lk(mu_);
  sizes_[reinterpret_cast<std::uintptr_t>(p)] = nbytes;
  append_locked(lk, line, len);
  return p;
}

void* LoggingPool::try_allocate_locked_nowait(std::size_t nbytes, Stream s) {
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock()) return nullptr;
  // The inner attempt never blocks, so holding the log lock through it cannot deadlock.
  void* p = inner_->try_allocate_nowait(nbytes, s);
  if (!p) return nullptr;
  char line[128];
  const std::size_t len = format_line(line, kAlloc, sizeof(kAlloc) - 1, reinterpret_cast<std::uintptr_t>(p), nbytes, s);
  sizes_[reinterpret_cast<std::uintptr_t>(p)] = nbytes;
  append_locked(lk, line, len);
  return p;
}

Refusal LoggingPool::do_deallocate(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::size_t n = 0;
  {
    std::unique_lock<std::mutex> lk(mu_);
    auto it = sizes_.find(a);
    if (it != sizes_.end()) {
      n = it->second;
      sizes_.erase(it);
      char line[128];
      const std::size_t len = format_line(line, kFree, sizeof(kFree) - 1, a, n, s);
      append_locked(lk, line, len);
    }
  }
  try {
    inner_->deallocate(p, s);
  } catch (const InvalidPointer&) {
    // Not live in the inner pool: another thread freed this pointer at once, after we took the
    // entry (so it found none and logged nothing). Our `free` line stands for that free; putting
    // the entry back would let a third free of the pointer log a second `free` for one allocation
    // (or overwrite the entry of a block allocated at this address since).
    throw;
  } catch (...) {
    // The inner pool refused a block we had logged as live (its upstream failed to free it): it
    // is still live, so keep it in the table; the `free` line already written stays.
    if (n) {
      std::lock_guard<std::mutex> g(mu_);
      sizes_[a] = n;
    }
    throw;
  }
  return {};
}

bool LoggingPool::try_deallocate_locked_nowait(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock()) return false;
  auto it = sizes_.find(a);
  if (it == sizes_.end()) return false;  // not ours or bad: the blocking path reports it
  // Under the log lock: an allocate that gets this address back must log after this free.
  if (!inner_->try_deallocate_nowait(p, s)) return false;
  const std::size_t n = it->second;
  sizes_.erase(it);
  char line[128];
  const std::size_t len = format_line(line, kFree, sizeof(kFree) - 1, a, n, s);
  append_locked(lk, line, len);
  return true;
}

PoolStats LoggingPool::stats() {
  PoolStats st = inner_->stats();
  std::uint64_t ev, errs, written;
  {
    std::lock_guard<std::mutex> g(mu_);
    ev = events_;
  }
  {
    std::lock_guard<std::mutex> g(file_mu_);
    errs = write_errors_;
    written = written_;
  }
  st.extra.emplace_back("log_events", ev);
  st.extra.emplace_back("log_bytes_written", written);
  st.extra.emplace_back("log_write_errors", errs);
  return st;
}

Snapshot LoggingPool::snapshot() {
  Snapshot s = inner_->snapshot();
  s.pool = name();
  return s;
}

std::uint64_t LoggingPool::events() const {
  std::lock_guard<std::mutex> g(mu_);
  return events_;
}

void LoggingPool::flush() {
  std::string out;
  std::unique_lock<std::mutex> lk(mu_);
  out.swap(buf_);
  buf_.reserve(cap_ + 256);
  std::lock_guard<std::mutex> f(file_mu_);
  lk.unlock();
  write_out(out);
  if (write_errors_)
    throw Error("LoggingPool: " + std::to_string(write_errors_) + " write(s) to '" + path_ +
                "' failed; the log is incomplete");
}

void LoggingPool::finish_file() {
  std::string out;
  {
    std::lock_guard<std::mutex> lk(mu_);
    out.swap(buf_);
  }
  std::lock_guard<std::mutex> f(file_mu_);
  write_out(out);
  if (file_) {
    if (std::fclose(file_) != 0) ++write_errors_;
    file_ = nullptr;
  }
}

bool LoggingPool::do_close(LiveAtClose&) {
  inner_->close();
  {
    std::lock_guard<std::mutex> g(g_open_mu);
    open_pools().erase(this);
  }
  finish_file();
  mark_closed();
  if (write_errors_)
    throw Error("LoggingPool: " + std::to_string(write_errors_) + " write(s) to '" + path_ +
                "' failed; the log is incomplete");
  return true;
}

}  // namespace poolkeeper
