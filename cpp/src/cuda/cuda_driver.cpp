#include "poolkeeper/cuda/cuda_driver.hpp"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

namespace poolkeeper::cuda {

using namespace drv;

namespace {

struct State {
  std::once_flag once;
  DriverApi api;
  bool ok = false;
  std::string reason;
  void* handle = nullptr;
  std::vector<CUdevice> devices;  // ordinal -> CUdevice
  std::mutex ctx_mu;
  std::unique_ptr<std::atomic<CUcontext>[]> ctx;  // ordinal -> retained primary context
};

// Leaked on purpose: upstreams destroyed late in process exit may still consult it, and a static
// destructor could run before them.
State& st() {
  static State* s = new State;
  return *s;
}

std::atomic<bool> g_shutting_down{false};

void at_exit() {
  // Runs before the driver's own exit handlers (registered after cuInit, so called first) and after
  // Python's finalization. Release our primary-context references; errors are ignored because
  // nothing can act on them now.
  g_shutting_down.store(true);
  State& s = st();
  if (!s.ok) return;
  for (std::size_t i = 0; i < s.devices.size(); ++i)
    if (s.ctx[i].load()) s.api.cuDevicePrimaryCtxRelease(s.devices[i]);
}

using GetProcAddress = CUresult (*)(const char*, void**, int, std::uint64_t, int*);

struct Sym {
  const char* base;       // the name cuGetProcAddress knows
  const char* versioned;  // the exported symbol with the CUDA 12.0 ABI, for dlsym
  void** slot;
  bool optional;
};

template <class F>
void** slot(F*& f) {
  return reinterpret_cast<void**>(&f);
}

void load(State& s) {
  DriverApi& a = s.api;
  const char* env = std::getenv("POOLKEEPER_LIBCUDA");
  const std::string lib = (env && *env) ? env : "libcuda.so.1";
  a.library = lib;
  dlerror();
  s.handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!s.handle) {
    const char* e = dlerror();
    s.reason = "no CUDA driver: could not load " + lib + " (" + (e ? e : "unknown dlopen error") +
               "); poolkeeper's Host and Simulated upstreams work without one";
    return;
  }
  // cuInit and the error names come straight from the export table: they must work before
  // cuGetProcAddress is trusted.
  a.cuInit = reinterpret_cast<decltype(a.cuInit)>(dlsym(s.handle, "cuInit"));
  a.cuGetErrorName = reinterpret_cast<decltype(a.cuGetErrorName)>(dlsym(s.handle, "cuGetErrorName"));
  a.cuGetErrorString = reinterpret_cast<decltype(a.cuGetErrorString)>(dlsym(s.handle, "cuGetErrorString"));
  if (!a.cuInit) {
    s.reason = "no CUDA driver: " + lib + " has no cuInit (not a CUDA driver library)";
    return;
  }
  const CUresult init = a.cuInit(0);
  if (init != CUDA_SUCCESS) {
    const std::string name = error_name(init);
    if (init == CUDA_ERROR_STUB_LIBRARY)
      s.reason = "no CUDA driver: " + lib + " is the CUDA toolkit's stub library, not a driver (" + name + ")";
    else if (init == CUDA_ERROR_NO_DEVICE)
      s.reason = "no CUDA device: cuInit returned " + name + " (no GPU, or CUDA_VISIBLE_DEVICES hides them all)";
    else
      s.reason = "CUDA driver unusable: cuInit failed with " + name;
    return;
  }

  auto gpa = reinterpret_cast<GetProcAddress>(dlsym(s.handle, "cuGetProcAddress_v2"));
  a.via_get_proc_address = gpa != nullptr;
  const Sym syms[] = {
      {"cuDriverGetVersion", "cuDriverGetVersion", slot(a.cuDriverGetVersion), false},
      {"cuDeviceGetCount", "cuDeviceGetCount", slot(a.cuDeviceGetCount), false},
      {"cuDeviceGet", "cuDeviceGet", slot(a.cuDeviceGet), false},
      {"cuDeviceGetName", "cuDeviceGetName", slot(a.cuDeviceGetName), false},
      {"cuDeviceGetPCIBusId", "cuDeviceGetPCIBusId", slot(a.cuDeviceGetPCIBusId), false},
      {"cuDeviceTotalMem", "cuDeviceTotalMem_v2", slot(a.cuDeviceTotalMem), false},
      {"cuDeviceGetAttribute", "cuDeviceGetAttribute", slot(a.cuDeviceGetAttribute), false},
      {"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", slot(a.cuDevicePrimaryCtxRetain), false},
      {"cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", slot(a.cuDevicePrimaryCtxRelease), false},
      {"cuCtxGetCurrent", "cuCtxGetCurrent", slot(a.cuCtxGetCurrent), false},
      {"cuCtxSetCurrent", "cuCtxSetCurrent", slot(a.cuCtxSetCurrent), false},
      {"cuCtxGetDevice", "cuCtxGetDevice", slot(a.cuCtxGetDevice), false},
      {"cuCtxSynchronize", "cuCtxSynchronize", slot(a.cuCtxSynchronize), false},
      {"cuMemGetInfo", "cuMemGetInfo_v2", slot(a.cuMemGetInfo), false},
      {"cuMemAlloc", "cuMemAlloc_v2", slot(a.cuMemAlloc), false},
      {"cuMemFree", "cuMemFree_v2", slot(a.cuMemFree), false},
      {"cuMemHostAlloc", "cuMemHostAlloc", slot(a.cuMemHostAlloc), false},
      {"cuMemFreeHost", "cuMemFreeHost", slot(a.cuMemFreeHost), false},
      {"cuEventCreate", "cuEventCreate", slot(a.cuEventCreate), false},
      {"cuEventDestroy", "cuEventDestroy_v2", slot(a.cuEventDestroy), false},
      {"cuEventRecord", "cuEventRecord", slot(a.cuEventRecord), false},
      {"cuEventQuery", "cuEventQuery", slot(a.cuEventQuery), false},
      {"cuEventSynchronize", "cuEventSynchronize", slot(a.cuEventSynchronize), false},
      {"cuStreamCreate", "cuStreamCreate", slot(a.cuStreamCreate), false},
      {"cuStreamDestroy", "cuStreamDestroy_v2", slot(a.cuStreamDestroy), false},
      {"cuStreamSynchronize", "cuStreamSynchronize", slot(a.cuStreamSynchronize), false},
      {"cuStreamGetCtx", "cuStreamGetCtx", slot(a.cuStreamGetCtx), false},
      {"cuMemcpyHtoD", "cuMemcpyHtoD_v2", slot(a.cuMemcpyHtoD), false},
      {"cuMemcpyDtoH", "cuMemcpyDtoH_v2", slot(a.cuMemcpyDtoH), false},
      {"cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2", slot(a.cuMemcpyHtoDAsync), false},
      {"cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2", slot(a.cuMemcpyDtoHAsync), false},
      {"cuMemsetD8", "cuMemsetD8_v2", slot(a.cuMemsetD8), false},
      {"cuMemsetD8Async", "cuMemsetD8Async", slot(a.cuMemsetD8Async), false},
      {"cuMemAllocAsync", "cuMemAllocAsync", slot(a.cuMemAllocAsync), true},
      {"cuMemFreeAsync", "cuMemFreeAsync", slot(a.cuMemFreeAsync), true},
      {"cuDeviceGetDefaultMemPool", "cuDeviceGetDefaultMemPool", slot(a.cuDeviceGetDefaultMemPool), true},
      {"cuMemPoolGetAttribute", "cuMemPoolGetAttribute", slot(a.cuMemPoolGetAttribute), true},
      {"cuMemPoolSetAttribute", "cuMemPoolSetAttribute", slot(a.cuMemPoolSetAttribute), true},
      {"cuMemPoolTrimTo", "cuMemPoolTrimTo", slot(a.cuMemPoolTrimTo), true},
      {"cuMemGetAllocationGranularity", "cuMemGetAllocationGranularity", slot(a.cuMemGetAllocationGranularity), true},
      {"cuMemAddressReserve", "cuMemAddressReserve", slot(a.cuMemAddressReserve), true},
      {"cuMemAddressFree", "cuMemAddressFree", slot(a.cuMemAddressFree), true},
      {"cuMemCreate", "cuMemCreate", slot(a.cuMemCreate), true},
      {"cuMemRelease", "cuMemRelease", slot(a.cuMemRelease), true},
      {"cuMemMap", "cuMemMap", slot(a.cuMemMap), true},
      {"cuMemUnmap", "cuMemUnmap", slot(a.cuMemUnmap), true},
      {"cuMemSetAccess", "cuMemSetAccess", slot(a.cuMemSetAccess), true},
      {"cuStreamIsCapturing", "cuStreamIsCapturing", slot(a.cuStreamIsCapturing), true},
      {"cuThreadExchangeStreamCaptureMode", "cuThreadExchangeStreamCaptureMode",
       slot(a.cuThreadExchangeStreamCaptureMode), true},
  };
  for (const Sym& y : syms) {
    void* p = nullptr;
    if (gpa) {
      int status = 0;
      // Ask for the CUDA 12.0 ABI (the signatures declared in cuda_driver.hpp) with legacy
      // default-stream semantics, so a newer driver never hands us a changed signature.
      if (gpa(y.base, &p, 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status) != CUDA_SUCCESS) p = nullptr;
    }
    if (!p) p = dlsym(s.handle, y.versioned);
    if (!p && !y.optional) {
      s.reason = "CUDA driver too old: " + lib + " lacks " + y.versioned;
      return;
    }
    *y.slot = p;
  }
  // The pool API is all-or-nothing: a partial set counts as absent.
  if (!a.cuMemAllocAsync || !a.cuMemFreeAsync || !a.cuDeviceGetDefaultMemPool || !a.cuMemPoolGetAttribute ||
      !a.cuMemPoolSetAttribute || !a.cuMemPoolTrimTo) {
    a.cuMemAllocAsync = nullptr;
    a.cuMemFreeAsync = nullptr;
    a.cuDeviceGetDefaultMemPool = nullptr;
    a.cuMemPoolGetAttribute = nullptr;
    a.cuMemPoolSetAttribute = nullptr;
    a.cuMemPoolTrimTo = nullptr;
  }

  if (!a.cuMemGetAllocationGranularity || !a.cuMemAddressReserve || !a.cuMemAddressFree || !a.cuMemCreate ||
      !a.cuMemRelease || !a.cuMemMap || !a.cuMemUnmap || !a.cuMemSetAccess)
    a.cuMemCreate = nullptr;  // has_virtual_memory() is all-or-nothing too

  a.cuDriverGetVersion(&a.driver_version);
  int n = 0;
  const CUresult rc = a.cuDeviceGetCount(&n);
  if (rc != CUDA_SUCCESS || n <= 0) {
    s.reason = rc != CUDA_SUCCESS ? "CUDA driver unusable: cuDeviceGetCount failed with " + error_name(rc)
                                  : "no CUDA device: the driver reports 0 devices";
    return;
  }
  s.devices.resize(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    const CUresult r = a.cuDeviceGet(&s.devices[static_cast<std::size_t>(i)], i);
    if (r != CUDA_SUCCESS) {
      s.reason = "CUDA driver unusable: cuDeviceGet(" + std::to_string(i) + ") failed with " + error_name(r);
      return;
    }
  }
  s.ctx.reset(new std::atomic<CUcontext>[static_cast<std::size_t>(n)]);
  for (int i = 0; i < n; ++i) s.ctx[static_cast<std::size_t>(i)].store(nullptr);
  a.device_count = n;
  s.ok = true;
  std::atexit(at_exit);
}

State& loaded() {
  State& s = st();
  std::call_once(s.once, [&] { load(s); });
  return s;
}

}  // namespace

const DriverApi& api() {
  State& s = loaded();
  if (!s.ok) throw CudaUnavailable(s.reason);
  return s.api;
}

bool is_available() noexcept {
  try {
    return loaded().ok;
  } catch (...) {
    return false;
  }
}

std::string unavailable_reason() noexcept {
  try {
    State& s = loaded();
    return s.ok ? std::string() : s.reason;
  } catch (...) {
    return "CUDA driver load failed";
  }
}

int device_count() noexcept { return is_available() ? st().api.device_count : 0; }

void require_device(int device) {
  const DriverApi& a = api();
  if (device < 0 || device >= a.device_count)
    throw InvalidArgument("CUDA device " + std::to_string(device) + " does not exist (" +
                          std::to_string(a.device_count) + " device" + (a.device_count == 1 ? "" : "s") +
                          " visible)");
}

std::string error_name(CUresult r) {
  const DriverApi& a = st().api;  // may be partially loaded: only cuGetErrorName is used
  const char* n = nullptr;
  if (a.cuGetErrorName && a.cuGetErrorName(r, &n) == CUDA_SUCCESS && n) return n;
  return "CUDA_ERROR_" + std::to_string(r);
}

void throw_error(CUresult r, const std::string& call, const std::string& who) {
  const DriverApi& a = st().api;
  const std::string name = error_name(r);
  const char* d = nullptr;
  std::string msg = call + " failed: " + name;
  if (a.cuGetErrorString && a.cuGetErrorString(r, &d) == CUDA_SUCCESS && d) msg += std::string(" (") + d + ")";
  if (r == CUDA_ERROR_OUT_OF_MEMORY) throw UpstreamOutOfMemory(msg, who, name, r);
  throw UpstreamFailure(msg, who, name, r);
}

CUcontext primary_context(int device) {
  require_device(device);
  State& s = st();
  auto& slot = s.ctx[static_cast<std::size_t>(device)];
  if (CUcontext c = slot.load(std::memory_order_acquire)) return c;
  std::lock_guard<std::mutex> lk(s.ctx_mu);
  if (CUcontext c = slot.load(std::memory_order_acquire)) return c;
  CUcontext c = nullptr;
  check(s.api.cuDevicePrimaryCtxRetain(&c, s.devices[static_cast<std::size_t>(device)]),
        ("cuDevicePrimaryCtxRetain(device " + std::to_string(device) + ")").c_str());
  slot.store(c, std::memory_order_release);
  return c;
}

void ScopedContext::enter(CUcontext ctx) {
  const DriverApi& a = api();
  CUcontext cur = nullptr;
  check(a.cuCtxGetCurrent(&cur), "cuCtxGetCurrent");
  if (cur == ctx) return;
  check(a.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  prev_ = cur;
  switched_ = true;
}

ScopedContext::ScopedContext(int device) { enter(primary_context(device)); }
ScopedContext::ScopedContext(CUcontext ctx) { enter(ctx); }

ScopedContext ScopedContext::current_or_default() {
  ScopedContext g;
  CUcontext cur = nullptr;
  check(api().cuCtxGetCurrent(&cur), "cuCtxGetCurrent");
  if (!cur) g.enter(primary_context(0));
  return g;
}

ScopedContext ScopedContext::for_stream(std::uintptr_t s) {
  if (s <= CU_STREAM_PER_THREAD) return current_or_default();
  CUcontext c = nullptr;
  check(api().cuStreamGetCtx(reinterpret_cast<CUstream>(s), &c), "cuStreamGetCtx");
  ScopedContext g;
  g.enter(c);
  return g;
}

CUcontext context_for_stream(std::uintptr_t s) {
  const DriverApi& a = api();
  CUcontext c = nullptr;
  if (s > CU_STREAM_PER_THREAD) {
    check(a.cuStreamGetCtx(reinterpret_cast<CUstream>(s), &c), "cuStreamGetCtx");
    return c;
  }
  check(a.cuCtxGetCurrent(&c), "cuCtxGetCurrent");
  return c ? c : primary_context(0);
}

ScopedContext::~ScopedContext() {
  if (switched_) st().api.cuCtxSetCurrent(prev_);  // nothing useful to do with a failure here
}

int current_device() {
  const DriverApi& a = api();
  CUcontext cur = nullptr;
  check(a.cuCtxGetCurrent(&cur), "cuCtxGetCurrent");
  if (!cur) return -1;
  CUdevice d = 0;
  check(a.cuCtxGetDevice(&d), "cuCtxGetDevice");
  const auto& devs = st().devices;
  for (std::size_t i = 0; i < devs.size(); ++i)
    if (devs[i] == d) return static_cast<int>(i);
  return -1;
}

void set_current_device(int device) {
  CUcontext c = primary_context(device);
  check(api().cuCtxSetCurrent(c), "cuCtxSetCurrent");
}

bool shutting_down() noexcept { return g_shutting_down.load(std::memory_order_relaxed); }

bool virtual_memory_supported(int device) noexcept {
  if (device < 0 || device >= device_count()) return false;
  const DriverApi& a = api();
  int v = 0;
  return a.has_virtual_memory() &&
         a.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                st().devices[static_cast<std::size_t>(device)]) == CUDA_SUCCESS &&
         v != 0;
}

DeviceInfo device_info(int device) {
  require_device(device);
  const DriverApi& a = api();
  const CUdevice dev = st().devices[static_cast<std::size_t>(device)];
  DeviceInfo info;
  info.index = device;
  char buf[256] = {0};
  check(a.cuDeviceGetName(buf, sizeof buf - 1, dev), "cuDeviceGetName");
  info.name = buf;
  char bus[64] = {0};
  if (a.cuDeviceGetPCIBusId(bus, sizeof bus - 1, dev) == CUDA_SUCCESS) info.pci_bus_id = bus;
  check(a.cuDeviceTotalMem(&info.total_memory, dev), "cuDeviceTotalMem");
  auto attr = [&](int which) {
    int v = 0;
    check(a.cuDeviceGetAttribute(&v, which, dev), "cuDeviceGetAttribute");
    return v;
  };
  info.compute_capability_major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  info.compute_capability_minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  info.multiprocessors = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  info.memory_pools_supported =
      a.has_stream_ordered_allocator() && attr(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) != 0;
  info.virtual_memory_supported = virtual_memory_supported(device);
  {
    ScopedContext ctx(device);
    std::size_t total = 0;
    check(a.cuMemGetInfo(&info.free_memory, &total), "cuMemGetInfo");
  }
  return info;
}

}  // namespace poolkeeper::cuda
