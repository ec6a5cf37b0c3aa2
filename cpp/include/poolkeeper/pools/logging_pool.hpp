// LoggingPool: a pool adaptor that records every allocate and deallocate made through it as RMM's
// logging_resource_adaptor CSV (header `Thread,Time,Action,Pointer,Size,Stream`), so a production
// process's allocations replay offline (`poolkeeper replay`, RMM's replay benchmark).
//
// Why a pool adaptor and not an upstream one: an upstream sees the pool's backing calls (a few,
// large); replaying a pool policy needs the user's calls. Why C++: allocations that arrive through
// the C ABI (PyTorch's pluggable allocator) never touch Python, and are logged all the same when
// the registry holds a LoggingPool.
//
// Contracts:
// - Every Pool member forwards to the inner pool, with the inner pool's errors and guarantees.
//   allocate logs `allocate` after the inner pool returns; a failed allocation (OutOfMemory) logs
//   `allocate failure` with a null pointer, then rethrows. deallocate logs `free` (with the size
//   the block was allocated with) before the inner pool can hand the address out again, so the log
//   never shows an address allocated twice without a free in between, whatever the threads.
// - Size: the requested size. Pointer and Stream: bare hex (RMM >= 23 style); stream=None (the
//   caller's guarantee) is logged as stream 0. Thread: the OS thread id. Time: local wall clock
//   HH:MM:SS.ffffff.
// - Buffered: lines collect in memory and are written when the buffer passes `buffer_bytes`, on
//   flush(), on close(), on destruction and at process exit (std::atexit). A process killed
//   without exit handlers loses at most one buffer.
// - Blocks allocated through the inner pool directly are not logged; freeing one through the
//   adaptor forwards to the inner pool unlogged.
// - Thread safety: as Pool. One mutex orders the log and the pointer->size table; the file is
//   written outside it (a second mutex keeps buffers in order).
// - Errors: the constructor throws InvalidArgument when the file cannot be created, the path has
//   a NUL byte, or buffer_bytes is above kMaxLogBuffer; nothing is created then. A failed
//   write is counted (stats extra `log_write_errors`) and flush()/close() then throw Error.
#pragma once
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "poolkeeper/core/pool.hpp"

namespace poolkeeper {

// The largest buffer_bytes: the buffer is reserved whole at construction.
inline constexpr std::size_t kMaxLogBuffer = std::size_t{1} << 30;

class LoggingPool final : public Pool {
 public:
  LoggingPool(std::shared_ptr<Pool> inner, const std::string& path, std::size_t buffer_bytes = std::size_t{1} << 20);
  ~LoggingPool() override;

  void* try_allocate_locked_nowait(std::size_t nbytes, Stream s) override;
  bool try_deallocate_locked_nowait(void* p, Stream s) override;
  PoolStats stats() override;
  void reset_peaks() override { inner_->reset_peaks(); }
  void validate() override { inner_->validate(); }
  std::size_t trim() override { return inner_->trim(); }
  std::size_t process_pending() override { return inner_->process_pending(); }
  void synchronize() override { inner_->synchronize(); }
  Snapshot snapshot() override;
  std::string name() const override { return "Logging(" + inner_->name() + ")"; }
  std::size_t alignment() const override { return inner_->alignment(); }

  // Write the buffered lines now. Throws Error if any write has failed since the file was opened.
  void flush();
  const std::shared_ptr<Pool>& inner() const { return inner_; }
  const std::string& path() const { return path_; }
  std::uint64_t events() const;

  // Every open LoggingPool's flush, for the exit handler.
  static void flush_all_at_exit();

 private:
  void* do_allocate(std::size_t nbytes, Stream s) override;
  Refusal do_deallocate(void* p, Stream s) override;  // the inner pool reports bad pointers
  bool do_record_stream(void* p, Stream s) override {
    inner_->record_stream(p, s);
    return true;
  }
  // Closes the inner pool (LiveBlocksAtClose propagates and both stay open), then writes the
  // buffer and closes the file.
  bool do_close(LiveAtClose& live) override;
  bool find_live(std::uintptr_t p) override { return inner_->owns_live(p); }

  // Appends one line; may hand the buffer to the file (then `lk` is released on return).
  void append_locked(std::unique_lock<std::mutex>& lk, const char* line, std::size_t len);
  void write_out(std::string& out);  // file_mu_ held
  void finish_file();

  std::shared_ptr<Pool> inner_;
  std::string path_;
  std::size_t cap_;
  mutable std::mutex mu_;  // buf_, sizes_, events_
  std::string buf_;
  std::unordered_map<std::uintptr_t, std::size_t> sizes_;
  std::uint64_t events_ = 0;
  std::mutex file_mu_;  // file_, write_errors_, written_
  std::FILE* file_ = nullptr;
  std::uint64_t write_errors_ = 0, written_ = 0;
};

}  // namespace poolkeeper
