/*
 * TEST FIXTURE ONLY -- a minimal stand-in for the NVIDIA driver, `libcuda.so.1`.
 *
 * kvikio's libkvikio dlopens `libcuda.so.1` and resolves the symbols below
 * (found with `strings`/undefined-symbol errors on the installed libkvikio)
 * even for host-memory I/O in POSIX compat mode. This stub lets the test suite
 * drive kvikio's real compat path on machines without a GPU. It is compiled by
 * `build_fake_libcuda` (`tests/backends/fake_libcuda/__init__.py`) into a
 * temporary directory and is only ever put on LD_LIBRARY_PATH of a test
 * *subprocess*; never install or ship it.
 *
 * Behaviour (environment variable FAKE_LIBCUDA_MODE):
 *   unset / "nodevice": cuInit succeeds, cuDeviceGetCount reports 0 devices,
 *                       every pointer is unregistered host memory.
 *   "uninit":           cuInit and every query return CUDA_ERROR_NOT_INITIALIZED.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_NOT_SUPPORTED = 801,
};

#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2

static int uninit(void) {
  const char *m = getenv("FAKE_LIBCUDA_MODE");
  return m != NULL && strcmp(m, "uninit") == 0;
}

/* Every query fails like an uninitialised driver in "uninit" mode. */
#define GUARD() do { if (uninit()) return CUDA_ERROR_NOT_INITIALIZED; } while (0)

/* ---- initialisation, versions, devices --------------------------------- */
CUresult cuInit(unsigned int flags) { (void)flags; GUARD(); return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *v) { if (!v) return CUDA_ERROR_INVALID_VALUE; *v = 12040; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *n) { GUARD(); if (!n) return CUDA_ERROR_INVALID_VALUE; *n = 0; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { (void)d; (void)ordinal; GUARD(); return CUDA_ERROR_INVALID_DEVICE; }
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) { (void)v; (void)attr; (void)d; GUARD(); return CUDA_ERROR_INVALID_DEVICE; }

CUresult cuGetErrorName(CUresult e, const char **s) {
  if (!s) return CUDA_ERROR_INVALID_VALUE;
  switch (e) {
    case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
    default: *s = "CUDA_ERROR_UNKNOWN"; break;
  }
  return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult e, const char **s) {
  CUresult r = cuGetErrorName(e, s);
  if (r == CUDA_SUCCESS && e != CUDA_SUCCESS) *s = "fake libcuda test fixture: no CUDA device";
  return r;
}

/* ---- contexts: there are none ------------------------------------------ */
CUresult cuCtxCreate_v2(CUcontext *c, unsigned int f, CUdevice d) { (void)c; (void)f; (void)d; GUARD(); return CUDA_ERROR_NO_DEVICE; }
CUresult cuCtxDestroy_v2(CUcontext c) { (void)c; GUARD(); return CUDA_ERROR_INVALID_VALUE; }
CUresult cuCtxPushCurrent_v2(CUcontext c) { (void)c; GUARD(); return CUDA_SUCCESS; }
CUresult cuCtxPopCurrent_v2(CUcontext *c) { GUARD(); if (c) *c = NULL; return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext *c) { GUARD(); if (c) *c = NULL; return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *d) { (void)d; GUARD(); return CUDA_ERROR_NO_DEVICE; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { (void)c; (void)d; GUARD(); return CUDA_ERROR_INVALID_DEVICE; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; GUARD(); return CUDA_ERROR_INVALID_DEVICE; }

/* ---- memory: everything is plain host memory ---------------------------- */
CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags) {
  (void)flags; GUARD();
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  return posix_memalign(p, 4096, n ? n : 1) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuMemFreeHost(void *p) { free(p); return CUDA_SUCCESS; }
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int f) { (void)p; (void)n; (void)f; GUARD(); return CUDA_SUCCESS; }
CUresult cuMemHostUnregister(void *p) { (void)p; GUARD(); return CUDA_SUCCESS; }
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr ptr) {
  (void)data; (void)attr; (void)ptr; GUARD();
  return CUDA_ERROR_INVALID_VALUE; /* what the real driver says for unregistered host memory */
}
CUresult cuPointerGetAttributes(unsigned int n, int *attrs, void **data, CUdeviceptr ptr) {
  (void)ptr; GUARD();
  for (unsigned int i = 0; i < n; ++i)
    if (attrs[i] == CU_POINTER_ATTRIBUTE_MEMORY_TYPE && data[i]) *(unsigned int *)data[i] = 0;
  return CUDA_SUCCESS;
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr *b, size_t *s, CUdeviceptr p) { (void)b; (void)s; (void)p; GUARD(); return CUDA_ERROR_INVALID_VALUE; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, CUstream st) { (void)d; (void)s; (void)n; (void)st; GUARD(); return CUDA_ERROR_NOT_SUPPORTED; }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, CUstream st) { (void)d; (void)s; (void)n; (void)st; GUARD(); return CUDA_ERROR_NOT_SUPPORTED; }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { (void)d; (void)s; (void)n; (void)st; GUARD(); return CUDA_ERROR_NOT_SUPPORTED; }

/* ---- streams and events: none can be created ----------------------------- */
CUresult cuStreamCreate(CUstream *s, unsigned int f) { (void)s; (void)f; GUARD(); return CUDA_ERROR_NO_DEVICE; }
CUresult cuStreamDestroy_v2(CUstream s) { (void)s; GUARD(); return CUDA_SUCCESS; }
CUresult cuStreamSynchronize(CUstream s) { (void)s; GUARD(); return CUDA_SUCCESS; }
CUresult cuEventCreate(CUevent *e, unsigned int f) { (void)e; (void)f; GUARD(); return CUDA_ERROR_NO_DEVICE; }
CUresult cuEventDestroy_v2(CUevent e) { (void)e; GUARD(); return CUDA_SUCCESS; }
CUresult cuEventRecord(CUevent e, CUstream s) { (void)e; (void)s; GUARD(); return CUDA_ERROR_NO_DEVICE; }
CUresult cuEventQuery(CUevent e) { (void)e; GUARD(); return CUDA_SUCCESS; }
CUresult cuEventSynchronize(CUevent e) { (void)e; GUARD(); return CUDA_SUCCESS; }
CUresult cuLaunchHostFunc(CUstream s, void (*fn)(void *), void *u) { (void)s; (void)fn; (void)u; GUARD(); return CUDA_ERROR_NOT_SUPPORTED; }
