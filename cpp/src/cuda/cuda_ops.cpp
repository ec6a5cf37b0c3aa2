#include "poolkeeper/cuda/cuda_ops.hpp"

#include <string>

#include "poolkeeper/cuda/cuda_driver.hpp"

namespace poolkeeper::cuda {

using namespace drv;

namespace {
CUstream as_stream(std::uintptr_t s) { return reinterpret_cast<CUstream>(s); }
CUevent as_event(std::uintptr_t e) { return reinterpret_cast<CUevent>(e); }
CUdeviceptr as_dptr(std::uintptr_t p) { return static_cast<CUdeviceptr>(p); }
}  // namespace

std::uintptr_t stream_create(int device, bool non_blocking) {
  ScopedContext ctx(device);
  CUstream s = nullptr;
  check(api().cuStreamCreate(&s, non_blocking ? CU_STREAM_NON_BLOCKING : 0u), "cuStreamCreate");
  return reinterpret_cast<std::uintptr_t>(s);
}

void stream_destroy(std::uintptr_t stream) {
  if (shutting_down() || stream <= CU_STREAM_PER_THREAD) return;
  check(api().cuStreamDestroy(as_stream(stream)), "cuStreamDestroy");
}

void stream_synchronize(std::uintptr_t stream) {
  if (stream > CU_STREAM_PER_THREAD) {
    // An explicit stream names its context: no switch needed (retried in it if the driver says so).
    CUresult r = api().cuStreamSynchronize(as_stream(stream));
    if (r == CUDA_ERROR_INVALID_CONTEXT) {
      auto ctx = ScopedContext::for_stream(stream);
      r = api().cuStreamSynchronize(as_stream(stream));
    }
    check(r, "cuStreamSynchronize");
    return;
  }
  auto ctx = ScopedContext::current_or_default();
  check(api().cuStreamSynchronize(as_stream(stream)), "cuStreamSynchronize");
}

std::uintptr_t event_record_new(std::uintptr_t stream) {
  auto ctx = ScopedContext::for_stream(stream);
  const DriverApi& a = api();
  CUevent e = nullptr;
  check(a.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  const CUresult r = a.cuEventRecord(e, as_stream(stream));
  if (r != CUDA_SUCCESS) {
    a.cuEventDestroy(e);
    throw_error(r, "cuEventRecord");
  }
  return reinterpret_cast<std::uintptr_t>(e);
}

void event_record(std::uintptr_t event, std::uintptr_t stream) {
  auto ctx = ScopedContext::for_stream(stream);
  check(api().cuEventRecord(as_event(event), as_stream(stream)), "cuEventRecord");
}

bool event_query(std::uintptr_t event) {
  const CUresult r = api().cuEventQuery(as_event(event));
  if (r == CUDA_SUCCESS) return true;
  if (r == CUDA_ERROR_NOT_READY) return false;
  throw_error(r, "cuEventQuery");
}

void event_synchronize(std::uintptr_t event) { check(api().cuEventSynchronize(as_event(event)), "cuEventSynchronize"); }

void event_destroy(std::uintptr_t event) {
  if (shutting_down()) return;
  check(api().cuEventDestroy(as_event(event)), "cuEventDestroy");
}

void memcpy_htod(std::uintptr_t dst, const void* src, std::size_t n) {
  auto ctx = ScopedContext::current_or_default();
  check(api().cuMemcpyHtoD(as_dptr(dst), src, n), "cuMemcpyHtoD");
}

void memcpy_htod_async(std::uintptr_t dst, const void* src, std::size_t n, std::uintptr_t stream) {
  auto ctx = ScopedContext::for_stream(stream);
  check(api().cuMemcpyHtoDAsync(as_dptr(dst), src, n, as_stream(stream)), "cuMemcpyHtoDAsync");
}

void memcpy_dtoh(void* dst, std::uintptr_t src, std::size_t n) {
  auto ctx = ScopedContext::current_or_default();
  check(api().cuMemcpyDtoH(dst, as_dptr(src), n), "cuMemcpyDtoH");
}

void memcpy_dtoh_async(void* dst, std::uintptr_t src, std::size_t n, std::uintptr_t stream) {
  auto ctx = ScopedContext::for_stream(stream);
  check(api().cuMemcpyDtoHAsync(dst, as_dptr(src), n, as_stream(stream)), "cuMemcpyDtoHAsync");
}

void memset_d8(std::uintptr_t dst, unsigned char value, std::size_t n) {
  auto ctx = ScopedContext::current_or_default();
  check(api().cuMemsetD8(as_dptr(dst), value, n), "cuMemsetD8");
}

void memset_d8_async(std::uintptr_t dst, unsigned char value, std::size_t n, std::uintptr_t stream) {
  auto ctx = ScopedContext::for_stream(stream);
  check(api().cuMemsetD8Async(as_dptr(dst), value, n, as_stream(stream)), "cuMemsetD8Async");
}

void device_synchronize(int device) {
  ScopedContext ctx(device);
  check(api().cuCtxSynchronize(), ("cuCtxSynchronize(device " + std::to_string(device) + ")").c_str());
}

void mem_get_info(int device, std::size_t& free, std::size_t& total) {
  ScopedContext ctx(device);
  check(api().cuMemGetInfo(&free, &total), "cuMemGetInfo");
}

}  // namespace poolkeeper::cuda
