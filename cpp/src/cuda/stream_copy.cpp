// Non-temporal copy for staging fills. The staging buffer is written by the CPU and read only by
// the DMA engine, so bringing its lines into the cache first (the read-for-ownership of a normal
// store) is pure extra memory traffic, and that traffic competes with the DMA itself for the
// host's memory bandwidth. Streaming stores skip it. Whether that wins depends on the machine
// (the DMA may also read lines from the last-level cache), so the uploader makes it a knob and
// the benchmark measures both.
#include <cstdint>
#include <cstring>

#include "poolkeeper/staging/upload_engine.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define POOLKEEPER_X86 1
#endif

namespace poolkeeper {

namespace {
#ifdef POOLKEEPER_X86
// Bring dst to `align` bytes with a plain copy; returns the bytes copied.
inline std::size_t align_head(char*& d, const char*& s, std::size_t& n, std::size_t align) {
  std::size_t head = (align - (reinterpret_cast<std::uintptr_t>(d) & (align - 1))) & (align - 1);
  if (head > n) head = n;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  return head;
}

__attribute__((target("avx2"))) void copy_avx2(char* d, const char* s, std::size_t n) {
  align_head(d, s, n, 32);
  for (; n >= 128; d += 128, s += 128, n -= 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
  }
  for (; n >= 32; d += 32, s += 32, n -= 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  std::memcpy(d, s, n);
  _mm_sfence();  // streaming stores are weakly ordered: make them visible before the DMA is enqueued
}

void copy_sse2(char* d, const char* s, std::size_t n) {
  align_head(d, s, n, 16);
  for (; n >= 64; d += 64, s += 64, n -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  for (; n >= 16; d += 16, s += 16, n -= 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  std::memcpy(d, s, n);
  _mm_sfence();
}

bool has_avx2() noexcept {
  static const bool v = __builtin_cpu_supports("avx2");
  return v;
}
#endif
}  // namespace

void stream_copy(void* dst, const void* src, std::size_t n) noexcept {
#ifdef POOLKEEPER_X86
  if (has_avx2())
    copy_avx2(static_cast<char*>(dst), static_cast<const char*>(src), n);
  else
    copy_sse2(static_cast<char*>(dst), static_cast<const char*>(src), n);
#else
  std::memcpy(dst, src, n);
#endif
}

const char* stream_copy_isa() noexcept {
#ifdef POOLKEEPER_X86
  return has_avx2() ? "avx2" : "sse2";
#else
  return "";
#endif
}

}  // namespace poolkeeper
