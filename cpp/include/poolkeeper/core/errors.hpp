// Typed errors of the core. Every one is translated into a poolkeeper.errors class in Python
// (see cpp/bindings/errors.cpp) carrying the figures below as attributes.
//
// Contract: a function that throws one of these leaves its pool exactly as it was before the call
// (validate() passes), unless its own doc says otherwise.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "poolkeeper/core/types.hpp"

namespace poolkeeper {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad size, alignment, option or stream object.
class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& m, bool type_error = false) : Error(m), type_error(type_error) {}
  bool type_error;  // the argument had the wrong type (Python: also a TypeError)
};

// A pointer this pool cannot take back: unknown, double free, interior, or another pool's.
class InvalidPointer : public Error {
 public:
  InvalidPointer(const std::string& m, std::uintptr_t ptr, std::string reason)
      : Error(m), ptr(ptr), reason(std::move(reason)) {}
  std::uintptr_t ptr;
  std::string reason;  // "unknown" | "double_free" | "interior" | "other_pool" | "null"
};

// The pool is closed (use after close).
class PoolClosed : public Error {
 public:
  using Error::Error;
};

// close() with blocks still live: they are reported, never freed under the user.
class LiveBlocksAtClose : public Error {
 public:
  LiveBlocksAtClose(const std::string& m, std::size_t blocks, std::size_t bytes, std::vector<std::uintptr_t> sample)
      : Error(m), blocks(blocks), bytes(bytes), sample(std::move(sample)) {}
  std::size_t blocks, bytes;
  std::vector<std::uintptr_t> sample;
};

// An upstream call failed for a reason other than lack of memory (or a CUDA error).
class UpstreamFailure : public Error {
 public:
  UpstreamFailure(const std::string& m, std::string upstream, std::string error_name, int code)
      : Error(m), upstream(std::move(upstream)), error_name(std::move(error_name)), code(code) {}
  std::string upstream, error_name;
  int code;
};

// The upstream itself is out of memory (raised by upstreams; pools turn it into OutOfMemory
// with a diagnosis once their own recovery has failed).
class UpstreamOutOfMemory : public UpstreamFailure {
 public:
  using UpstreamFailure::UpstreamFailure;
};

class CudaUnavailable : public Error {
 public:
  using Error::Error;
};

// A broken invariant found by validate(). Never thrown by a correct pool: it is the test oracle.
class InvariantViolation : public Error {
 public:
  using Error::Error;
};

// Why an allocation failed, as Pool's one diagnosis (pool.cpp: diagnose_oom) classifies it.
// Python sees the name (oom_cause_name): the `cause` of OutOfMemoryError's figures.
enum class OomCause : std::uint8_t {
  Upstream,       // the upstream refused more
  Limit,          // the pool's limit would be passed
  Pending,        // enough is pending on streams whose events have not completed
  ThreadCache,    // enough is free, but in other threads' caches
  Fragmentation,  // enough is free, but in no one piece
};
const char* oom_cause_name(OomCause c);

// Out of memory after the pool's own recovery (drain completed pending, flush caches, trim, retry).
struct OomFigures {
  std::size_t requested = 0, reserved = 0, live = 0, free = 0, largest_free = 0, pending = 0;
  std::size_t free_chunks = 0, limit = 0, thread_cached = 0;
  std::vector<std::pair<Stream, std::size_t>> pending_by_stream;
  std::string pool, upstream;
  OomCause cause = OomCause::Upstream;
  std::string upstream_error;         // the upstream's own error text when it refused
  // The growth the limit refused, when the pool grows in units larger than the request (an
  // expandable arena maps whole granules of growth_unit bytes); 0 otherwise. For the message.
  std::size_t refused_growth = 0, growth_unit = 0;
};

class OutOfMemory : public Error {
 public:
  OutOfMemory(const std::string& m, OomFigures f) : Error(m), figures(std::move(f)) {}
  OomFigures figures;
};

// Human-readable byte counts for messages ("1.2 GiB").
std::string format_bytes(std::size_t n);
std::string format_stream(Stream s);
std::string format_ptr(std::uintptr_t p);

}  // namespace poolkeeper
