// The CUDA driver API, reached at run time: libcuda.so.1 is dlopen'ed on first use and every
// function is resolved through cuGetProcAddress (dlsym where the driver predates it). Nothing
// CUDA is needed to build or import poolkeeper; cuda.h is never included -- the few types and
// constants we use are declared below with the driver's ABI values (CUDA 12.0 ABI, requested
// explicitly from cuGetProcAddress so a newer driver hands us the signatures declared here).
//
// Contracts:
// - Thread safety: every function here may be called from any thread. Loading and cuInit run
//   once per process (std::call_once); a failed load is remembered, not retried.
// - Errors: a driver call that fails throws UpstreamFailure carrying the error's name
//   (cuGetErrorName), or UpstreamOutOfMemory for CUDA_ERROR_OUT_OF_MEMORY. No driver, a stub
//   driver, or no device throws CudaUnavailable with the reason. The driver API keeps no "last
//   error" state, so a failure here never latches onto a later, unrelated call.
// - Contexts: each device is used through its primary context (the one the CUDA runtime, PyTorch
//   and CuPy share), retained once per device on first use and released at process exit.
//   ScopedContext makes a device's primary context current for one call and puts back whatever
//   the thread had before, so callers never change the thread's current device as a side effect.
// - The loader honours POOLKEEPER_LIBCUDA (a path or soname to load instead of libcuda.so.1), read
//   once at first use: tests point it at a missing or fake library to exercise the failure paths.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "poolkeeper/core/errors.hpp"

namespace poolkeeper::cuda {

// ---- our own declarations of the driver ABI (values from the CUDA driver API) ----
namespace drv {
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUmemoryPool = struct CUmemPoolHandle_st*;

inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
inline constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
inline constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
inline constexpr CUresult CUDA_ERROR_DEINITIALIZED = 4;
inline constexpr CUresult CUDA_ERROR_STUB_LIBRARY = 34;
inline constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
inline constexpr CUresult CUDA_ERROR_INVALID_DEVICE = 101;
inline constexpr CUresult CUDA_ERROR_INVALID_CONTEXT = 201;
inline constexpr CUresult CUDA_ERROR_NOT_FOUND = 500;
inline constexpr CUresult CUDA_ERROR_NOT_READY = 600;
inline constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;
inline constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906;

inline constexpr int CU_STREAM_CAPTURE_STATUS_NONE = 0;
inline constexpr int CU_STREAM_CAPTURE_STATUS_ACTIVE = 1;
inline constexpr int CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2;

inline constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
inline constexpr int CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115;

inline constexpr int CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4;      // cuuint64_t
inline constexpr int CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5;   // cuuint64_t
inline constexpr int CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6;      // cuuint64_t
inline constexpr int CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7;       // cuuint64_t
inline constexpr int CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8;          // cuuint64_t

inline constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x2;
inline constexpr unsigned CU_STREAM_NON_BLOCKING = 0x1;
inline constexpr unsigned CU_MEMHOSTALLOC_PORTABLE = 0x1;
inline constexpr std::uint64_t CU_GET_PROC_ADDRESS_LEGACY_STREAM = 0x1;

// Virtual memory management (CUDA 10.2+): our declarations of the ABI structs, laid out as the
// driver API documents them (CUmemLocation: type, id; CUmemAllocationProp: type,
// requestedHandleTypes, location, win32HandleMetaData, allocFlags{compressionType,
// gpuDirectRDMACapable, usage, reserved[4]}; CUmemAccessDesc: location, flags).
using CUmemGenericAllocationHandle = unsigned long long;
struct CUmemLocation {
  int type;  // CUmemLocationType
  int id;
};
struct CUmemAllocationProp {
  int type;                  // CUmemAllocationType
  int requestedHandleTypes;  // CUmemAllocationHandleType
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CUmemAccess_flags
};
static_assert(sizeof(CUmemAllocationProp) == 32 && sizeof(CUmemAccessDesc) == 12, "driver ABI layout");
inline constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 0x1;
inline constexpr int CU_MEM_HANDLE_TYPE_NONE = 0x0;
inline constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 0x1;
inline constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3;
inline constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0;
inline constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;

// Special stream handles: the legacy default stream and the per-thread default stream.
inline constexpr std::uintptr_t CU_STREAM_LEGACY = 0x1;
inline constexpr std::uintptr_t CU_STREAM_PER_THREAD = 0x2;
}  // namespace drv

// The resolved entry points. Members marked optional are null on drivers that lack them; the
// feature that needs one reports itself unavailable instead of failing the whole load.
struct DriverApi {
  using R = drv::CUresult;
  R (*cuInit)(unsigned) = nullptr;
  R (*cuDriverGetVersion)(int*) = nullptr;
  R (*cuGetErrorName)(R, const char**) = nullptr;
  R (*cuGetErrorString)(R, const char**) = nullptr;
  R (*cuDeviceGetCount)(int*) = nullptr;
  R (*cuDeviceGet)(drv::CUdevice*, int) = nullptr;
  R (*cuDeviceGetName)(char*, int, drv::CUdevice) = nullptr;
  R (*cuDeviceGetPCIBusId)(char*, int, drv::CUdevice) = nullptr;
  R (*cuDeviceTotalMem)(std::size_t*, drv::CUdevice) = nullptr;
  R (*cuDeviceGetAttribute)(int*, int, drv::CUdevice) = nullptr;
  R (*cuDevicePrimaryCtxRetain)(drv::CUcontext*, drv::CUdevice) = nullptr;
  R (*cuDevicePrimaryCtxRelease)(drv::CUdevice) = nullptr;
  R (*cuCtxGetCurrent)(drv::CUcontext*) = nullptr;
  R (*cuCtxSetCurrent)(drv::CUcontext) = nullptr;
  R (*cuCtxGetDevice)(drv::CUdevice*) = nullptr;
  R (*cuCtxSynchronize)() = nullptr;
  R (*cuMemGetInfo)(std::size_t*, std::size_t*) = nullptr;
  R (*cuMemAlloc)(drv::CUdeviceptr*, std::size_t) = nullptr;
  R (*cuMemFree)(drv::CUdeviceptr) = nullptr;
  R (*cuMemHostAlloc)(void**, std::size_t, unsigned) = nullptr;
  R (*cuMemFreeHost)(void*) = nullptr;
  R (*cuEventCreate)(drv::CUevent*, unsigned) = nullptr;
  R (*cuEventDestroy)(drv::CUevent) = nullptr;
  R (*cuEventRecord)(drv::CUevent, drv::CUstream) = nullptr;
  R (*cuEventQuery)(drv::CUevent) = nullptr;
  R (*cuEventSynchronize)(drv::CUevent) = nullptr;
  R (*cuStreamCreate)(drv::CUstream*, unsigned) = nullptr;
  R (*cuStreamDestroy)(drv::CUstream) = nullptr;
  R (*cuStreamSynchronize)(drv::CUstream) = nullptr;
  R (*cuStreamGetCtx)(drv::CUstream, drv::CUcontext*) = nullptr;
  R (*cuMemcpyHtoD)(drv::CUdeviceptr, const void*, std::size_t) = nullptr;
  R (*cuMemcpyDtoH)(void*, drv::CUdeviceptr, std::size_t) = nullptr;
  R (*cuMemcpyHtoDAsync)(drv::CUdeviceptr, const void*, std::size_t, drv::CUstream) = nullptr;
  R (*cuMemcpyDtoHAsync)(void*, drv::CUdeviceptr, std::size_t, drv::CUstream) = nullptr;
  R (*cuMemsetD8)(drv::CUdeviceptr, unsigned char, std::size_t) = nullptr;
  R (*cuMemsetD8Async)(drv::CUdeviceptr, unsigned char, std::size_t, drv::CUstream) = nullptr;
  // optional: stream-ordered allocation (CUDA 11.2+)
  R (*cuMemAllocAsync)(drv::CUdeviceptr*, std::size_t, drv::CUstream) = nullptr;
  R (*cuMemFreeAsync)(drv::CUdeviceptr, drv::CUstream) = nullptr;
  R (*cuDeviceGetDefaultMemPool)(drv::CUmemoryPool*, drv::CUdevice) = nullptr;
  R (*cuMemPoolGetAttribute)(drv::CUmemoryPool, int, void*) = nullptr;
  R (*cuMemPoolSetAttribute)(drv::CUmemoryPool, int, void*) = nullptr;
  R (*cuMemPoolTrimTo)(drv::CUmemoryPool, std::size_t) = nullptr;
  // optional: virtual memory management (all or none)
  R (*cuMemGetAllocationGranularity)(std::size_t*, const drv::CUmemAllocationProp*, int) = nullptr;
  R (*cuMemAddressReserve)(drv::CUdeviceptr*, std::size_t, std::size_t, drv::CUdeviceptr, unsigned long long) = nullptr;
  R (*cuMemAddressFree)(drv::CUdeviceptr, std::size_t) = nullptr;
  R (*cuMemCreate)(drv::CUmemGenericAllocationHandle*, std::size_t, const drv::CUmemAllocationProp*,
                   unsigned long long) = nullptr;
  R (*cuMemRelease)(drv::CUmemGenericAllocationHandle) = nullptr;
  R (*cuMemMap)(drv::CUdeviceptr, std::size_t, std::size_t, drv::CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  R (*cuMemUnmap)(drv::CUdeviceptr, std::size_t) = nullptr;
  R (*cuMemSetAccess)(drv::CUdeviceptr, std::size_t, const drv::CUmemAccessDesc*, std::size_t) = nullptr;
  // optional: stream capture (CUDA 10.1+); absent means no capture can be under way
  R (*cuStreamIsCapturing)(drv::CUstream, int*) = nullptr;       // CUstreamCaptureStatus
  R (*cuThreadExchangeStreamCaptureMode)(int*) = nullptr;        // CUstreamCaptureMode

  int driver_version = 0;  // e.g. 13000
  int device_count = 0;
  std::string library;     // what was loaded
  bool via_get_proc_address = false;
  bool has_stream_ordered_allocator() const { return cuMemAllocAsync && cuMemFreeAsync && cuDeviceGetDefaultMemPool; }
  bool has_virtual_memory() const { return cuMemCreate != nullptr; }
};

// The loaded driver. Throws CudaUnavailable (with the reason) when there is no usable driver or
// no device. Cheap after the first call.
const DriverApi& api();
// Never throws: is a driver with at least one device present?
bool is_available() noexcept;
// Why not ("" when available).
std::string unavailable_reason() noexcept;
// Devices visible to the driver; 0 when unavailable. Never throws.
int device_count() noexcept;
// Throws CudaUnavailable without a driver/device, InvalidArgument for an index out of range.
void require_device(int device);

// "CUDA_ERROR_OUT_OF_MEMORY" (or "CUDA_ERROR_<code>" when the driver cannot name it).
std::string error_name(drv::CUresult r);
// Throws UpstreamOutOfMemory for CUDA_ERROR_OUT_OF_MEMORY, UpstreamFailure otherwise, with a
// message "<call> failed: <NAME> (<description>)". `who` names the upstream for the error.
[[noreturn]] void throw_error(drv::CUresult r, const std::string& call, const std::string& who = "CUDA");
inline void check(drv::CUresult r, const char* call, const std::string& who = "CUDA") {
  if (r != drv::CUDA_SUCCESS) throw_error(r, call, who);
}

// The device's primary context, retained on first use (once per device, thread-safe) and
// released at process exit.
drv::CUcontext primary_context(int device);

// Makes a context current on the calling thread for the guard's lifetime and restores the
// previous one (which may be none) on exit. Switching costs one cuCtxSetCurrent each way; when
// the context is already current nothing is switched.
class ScopedContext {
 public:
  explicit ScopedContext(int device);
  explicit ScopedContext(drv::CUcontext ctx);
  // The calling thread's current context if it has one, else device 0's primary context (the
  // CUDA runtime's "current device" rule).
  static ScopedContext current_or_default();
  // The context that owns stream s (the current-or-default one for the special handles 0, 1, 2).
  static ScopedContext for_stream(std::uintptr_t s);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  ScopedContext(ScopedContext&& o) noexcept : prev_(o.prev_), switched_(o.switched_) { o.switched_ = false; }

 private:
  ScopedContext() = default;
  void enter(drv::CUcontext ctx);
  drv::CUcontext prev_ = nullptr;
  bool switched_ = false;
};

// Run call() -- a driver call on an explicit stream, which names its context itself -- without
// touching the thread's current context; only if the driver still answers
// CUDA_ERROR_INVALID_CONTEXT, run it again with `device`'s primary context made current. This keeps
// stream-ordered calls free of context switches on threads with no (or another) current context.
template <class F>
drv::CUresult on_stream_call(std::uintptr_t stream, int device, F&& call);

// The context that owns stream s; for the special handles 0, 1 and 2, the calling thread's current
// context, or device 0's primary context when it has none. For threads that must later work in
// the same context as a stream named on another thread (the upload engine's workers).
drv::CUcontext context_for_stream(std::uintptr_t s);

// Device index of the calling thread's current context; -1 when none is current.
int current_device();
// Make device's primary context current on the calling thread (like cudaSetDevice).
void set_current_device(int device);

// True once process exit has begun (our atexit handler ran): frees and event/stream destruction
// become no-ops, because the driver may already be tearing down and the OS reclaims everything.
bool shutting_down() noexcept;

struct DeviceInfo {
  int index = 0;
  std::string name, pci_bus_id;
  std::size_t total_memory = 0, free_memory = 0;
  int compute_capability_major = 0, compute_capability_minor = 0, multiprocessors = 0;
  bool memory_pools_supported = false;
  bool virtual_memory_supported = false;  // CudaVirtual (and so the expandable arena) can run here
};
DeviceInfo device_info(int device);
// Can CudaVirtual (reserve and map) run on `device`: the driver has the virtual memory calls and
// the device says VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED. False for a bad index or without a driver;
// makes no context. Thread-safe.
bool virtual_memory_supported(int device) noexcept;

template <class F>
drv::CUresult on_stream_call(std::uintptr_t stream, int device, F&& call) {
  if (stream > drv::CU_STREAM_PER_THREAD) {
    const drv::CUresult r = call();
    if (r != drv::CUDA_ERROR_INVALID_CONTEXT) return r;
  }
  ScopedContext ctx(device);
  return call();
}

}  // namespace poolkeeper::cuda
