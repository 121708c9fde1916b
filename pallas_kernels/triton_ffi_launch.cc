// An XLA FFI handler that launches a Triton-compiled kernel (a cubin) on the call's CUDA stream: the "ffi" launcher
// of pallas_kernels/triton_call.py (built and registered by pallas_kernels/triton_ffi.py).
//
// Operands: every kernel operand, then every output, as device buffers (the kernel's pointer arguments, in order).
// Attributes: name (the cubin's entry function), cubin (its bytes), cubin_hash (the cache key of the loaded module),
// grid_x / grid_y / grid_z, num_warps, shared_mem (dynamic shared memory bytes, Triton's metadata.shared).
//
// The handler is bound to the initialize stage (which loads the cubin into the stream's context before XLA records or
// runs anything; it runs on every execution, so its usual path is one lookup) and to the execute stage (a lookup by
// cubin and device ordinal, then one cuLaunchKernel: no other driver call, no allocation, no host sync), and is
// declared command-buffer compatible, so that XLA may record it into a CUDA graph with the fusions around it.
// The CUDA driver is opened with dlopen: no CUDA headers or libraries are needed to build this file.
#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The few driver types and constants used here (cuda.h, stable across CUDA 12 and 13).
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
constexpr CUresult kCudaSuccess = 0;
constexpr int kFuncAttributeSharedSizeBytes = 1;            // CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
constexpr int kFuncAttributeMaxDynamicSharedSizeBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr int kDeviceAttributeMaxSharedPerBlockOptin = 97;  // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
constexpr int kFuncCachePreferShared = 1;                   // CU_FUNC_CACHE_PREFER_SHARED
constexpr int kDefaultSharedLimit = 48 * 1024;              // a block's shared memory before opting in

struct Driver {
  CUresult (*StreamGetCtx)(CUstream, CUcontext*);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext*);
  CUresult (*CtxGetDevice)(CUdevice*);
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*ModuleLoadData)(CUmodule*, const void*);
  CUresult (*ModuleUnload)(CUmodule);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*FuncGetAttribute)(int*, int, CUfunction);
  CUresult (*FuncSetAttribute)(CUfunction, int, int);
  CUresult (*FuncSetCacheConfig)(CUfunction, int);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                           void**, void**);
  CUresult (*GetErrorString)(CUresult, const char**);
  CUresult (*StreamIsCapturing)(CUstream, int*);
  CUresult (*FuncLoad)(CUfunction);  // CUDA >= 12.4; null before (then the first launch loads the function lazily)
  std::string missing;  // why the driver could not be opened; empty when every symbol resolved
};

template <typename F>
void Resolve(void* library, const char* symbol, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(library, symbol));
  if (*out == nullptr && missing->empty()) missing->assign(std::string("libcuda.so.1 has no symbol ") + symbol);
}

const Driver& GetDriver() {
  static const Driver driver = [] {
    Driver d{};
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      d.missing = "could not open libcuda.so.1 (no NVIDIA driver on this machine?)";
      return d;
    }
    Resolve(library, "cuStreamGetCtx", &d.StreamGetCtx, &d.missing);
    Resolve(library, "cuCtxPushCurrent_v2", &d.CtxPushCurrent, &d.missing);
    Resolve(library, "cuCtxPopCurrent_v2", &d.CtxPopCurrent, &d.missing);
    Resolve(library, "cuCtxGetDevice", &d.CtxGetDevice, &d.missing);
    Resolve(library, "cuDeviceGetAttribute", &d.DeviceGetAttribute, &d.missing);
    Resolve(library, "cuModuleLoadData", &d.ModuleLoadData, &d.missing);
    Resolve(library, "cuModuleUnload", &d.ModuleUnload, &d.missing);
    Resolve(library, "cuModuleGetFunction", &d.ModuleGetFunction, &d.missing);
    Resolve(library, "cuFuncGetAttribute", &d.FuncGetAttribute, &d.missing);
    Resolve(library, "cuFuncSetAttribute", &d.FuncSetAttribute, &d.missing);
    Resolve(library, "cuFuncSetCacheConfig", &d.FuncSetCacheConfig, &d.missing);
    Resolve(library, "cuLaunchKernel", &d.LaunchKernel, &d.missing);
    Resolve(library, "cuGetErrorString", &d.GetErrorString, &d.missing);
    Resolve(library, "cuStreamIsCapturing", &d.StreamIsCapturing, &d.missing);
    d.FuncLoad = reinterpret_cast<decltype(d.FuncLoad)>(dlsym(library, "cuFuncLoad"));
    return d;
  }();
  return driver;
}

ffi::Error DriverError(const Driver& driver, CUresult status, std::string_view what, std::string_view kernel) {
  const char* text = nullptr;
  if (driver.GetErrorString(status, &text) != kCudaSuccess || text == nullptr) text = "unknown CUDA error";
  return ffi::Error::Internal(std::string(what) + " failed for Triton kernel " + std::string(kernel) + ": " + text +
                              " (CUresult " + std::to_string(status) + ")");
}

// Loaded kernels, one per (cubin, device): loaded once, never unloaded (a process holds a few dozen variants). Looked
// up under a shared lock on every launch; written under the exclusive one.
std::shared_mutex loaded_mutex;
std::map<std::tuple<int64_t, int32_t>, CUfunction>* loaded = new std::map<std::tuple<int64_t, int32_t>, CUfunction>;

// The loaded kernel of `cubin_hash` on device `ordinal`, or null.
CUfunction Find(int64_t cubin_hash, int32_t ordinal) {
  std::shared_lock<std::shared_mutex> lock(loaded_mutex);
  auto it = loaded->find(std::make_tuple(cubin_hash, ordinal));
  return it == loaded->end() ? nullptr : it->second;
}

// Loads `cubin` into `stream`'s context for device `ordinal`, as Triton's own loader does (the function loaded now,
// not lazily at its first launch; the shared-memory carveout and limit raised past 48 KB). Never while `stream` is
// being captured into a CUDA graph: XLA's initialize stage runs before any capture, and a module load (or
// cuStreamGetCtx, which a CUDA bug breaks there) inside a capture is refused with an error instead.
ffi::ErrorOr<CUfunction> Load(const Driver& driver, CUstream stream, std::string_view name, std::string_view cubin,
                              int64_t cubin_hash, int32_t ordinal, int32_t shared_mem) {
  int capturing = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  if (CUresult s = driver.StreamIsCapturing(stream, &capturing); s != kCudaSuccess) {
    return DriverError(driver, s, "cuStreamIsCapturing", name);
  }
  if (capturing != 0) {
    return ffi::Error::Internal("Triton kernel " + std::string(name) + " was first launched inside a CUDA graph "
                                "capture, before XLA's initialize stage loaded its cubin; it must be registered with "
                                "both stages (pallas_kernels/triton_ffi.py)");
  }
  CUcontext context = nullptr;
  if (CUresult s = driver.StreamGetCtx(stream, &context); s != kCudaSuccess) {
    return DriverError(driver, s, "cuStreamGetCtx", name);
  }
  std::unique_lock<std::shared_mutex> lock(loaded_mutex);
  auto key = std::make_tuple(cubin_hash, ordinal);
  if (auto it = loaded->find(key); it != loaded->end()) return it->second;
  if (CUresult s = driver.CtxPushCurrent(context); s != kCudaSuccess) {
    return DriverError(driver, s, "cuCtxPushCurrent", name);
  }
  std::string entry(name);
  CUmodule module = nullptr;
  CUfunction function = nullptr;
  CUdevice device = 0;
  int shared_optin = 0, shared_static = 0;
  CUresult s = driver.ModuleLoadData(&module, cubin.data());
  std::string_view failed = "cuModuleLoadData";
  if (s == kCudaSuccess) s = driver.ModuleGetFunction(&function, module, entry.c_str()), failed = "cuModuleGetFunction";
  if (s == kCudaSuccess && driver.FuncLoad != nullptr) s = driver.FuncLoad(function), failed = "cuFuncLoad";
  if (s == kCudaSuccess) s = driver.CtxGetDevice(&device), failed = "cuCtxGetDevice";
  if (s == kCudaSuccess) {
    s = driver.DeviceGetAttribute(&shared_optin, kDeviceAttributeMaxSharedPerBlockOptin, device);
    failed = "cuDeviceGetAttribute";
  }
  if (s == kCudaSuccess) {
    s = driver.FuncGetAttribute(&shared_static, kFuncAttributeSharedSizeBytes, function), failed = "cuFuncGetAttribute";
  }
  bool too_large = s == kCudaSuccess && shared_mem > shared_optin;
  if (s == kCudaSuccess && !too_large && shared_mem > kDefaultSharedLimit) {
    s = driver.FuncSetCacheConfig(function, kFuncCachePreferShared), failed = "cuFuncSetCacheConfig";
    if (s == kCudaSuccess) {
      s = driver.FuncSetAttribute(function, kFuncAttributeMaxDynamicSharedSizeBytes, shared_optin - shared_static);
      failed = "cuFuncSetAttribute";
    }
  }
  if ((s != kCudaSuccess || too_large) && module != nullptr) driver.ModuleUnload(module);
  CUcontext popped;
  driver.CtxPopCurrent(&popped);
  if (too_large) {
    return ffi::Error::InvalidArgument("Triton kernel " + entry + " asks " + std::to_string(shared_mem) +
                                       " bytes of shared memory; this GPU gives a block at most " +
                                       std::to_string(shared_optin) + ": choose a smaller tiling or fewer stages");
  }
  if (s != kCudaSuccess) return DriverError(driver, s, failed, name);
  loaded->emplace(key, function);
  return function;
}

template <bool kExecute>
ffi::Error LaunchImpl(CUstream stream, int32_t ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                      std::string_view name, std::string_view cubin, int64_t cubin_hash, int32_t grid_x,
                      int32_t grid_y, int32_t grid_z, int32_t num_warps, int32_t shared_mem) {
  const Driver& driver = GetDriver();
  if (!driver.missing.empty()) {
    return ffi::Error::Internal("Triton kernel " + std::string(name) + ": " + driver.missing);
  }
  CUfunction function = Find(cubin_hash, ordinal);  // the execute stage's only lookup: no driver call
  if (function == nullptr) {
    ffi::ErrorOr<CUfunction> loaded_now = Load(driver, stream, name, cubin, cubin_hash, ordinal, shared_mem);
    if (!loaded_now.has_value()) return loaded_now.error();
    function = *loaded_now;
  }
  if (!kExecute || grid_x == 0 || grid_y == 0 || grid_z == 0) return ffi::Error::Success();
  // The kernel's parameters: one device pointer per operand and output, then Triton's global and profile scratch
  // pointers (triton_ffi.py refuses kernels that need either, so both are null).
  std::vector<CUdeviceptr> pointers;
  pointers.reserve(args.size() + rets.size() + 2);
  for (size_t i = 0; i < args.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> buffer = args.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return buffer.error();
    pointers.push_back(reinterpret_cast<CUdeviceptr>(buffer->untyped_data()));
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> buffer = rets.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return buffer.error();
    pointers.push_back(reinterpret_cast<CUdeviceptr>((*buffer)->untyped_data()));
  }
  pointers.push_back(0);
  pointers.push_back(0);
  std::vector<void*> params(pointers.size());
  for (size_t i = 0; i < pointers.size(); ++i) params[i] = &pointers[i];
  CUresult s = driver.LaunchKernel(function, grid_x, grid_y, grid_z, 32 * num_warps, 1, 1, shared_mem, stream,
                                   params.data(), nullptr);
  if (s != kCudaSuccess) return DriverError(driver, s, "cuLaunchKernel", name);
  return ffi::Error::Success();
}

template <ffi::ExecutionStage kStage>
auto Binding() {
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<ffi::PlatformStream<CUstream>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .RemainingArgs()
      .RemainingRets()
      .template Attr<std::string_view>("name")
      .template Attr<std::string_view>("cubin")
      .template Attr<int64_t>("cubin_hash")
      .template Attr<int32_t>("grid_x")
      .template Attr<int32_t>("grid_y")
      .template Attr<int32_t>("grid_z")
      .template Attr<int32_t>("num_warps")
      .template Attr<int32_t>("shared_mem");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdtreeTritonInitialize, LaunchImpl<false>, Binding<ffi::ExecutionStage::kInitialize>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(KdtreeTritonLaunch, LaunchImpl<true>, Binding<ffi::ExecutionStage::kExecute>(),
                              {ffi::Traits::kCmdBufferCompatible});
