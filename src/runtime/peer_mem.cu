/* Peer memory (peer_mem.h): VMM allocations shared by file descriptor or
 * fabric handle, and legacy CUDA IPC. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>
#include <cuda_runtime.h>

#include "runtime/peer_mem.h"

/* The driver calls, taken once through the runtime (no libcuda link). */
typedef struct fr_drv {
    int state; /* 0 not tried, 1 loaded, -1 missing */
    char why[128];
    CUresult (*getGranularity)(size_t *, const CUmemAllocationProp *,
                               CUmemAllocationGranularity_flags);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                       unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*addrFree)(CUdeviceptr, size_t);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                    unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*setAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*exportTo)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                         unsigned long long);
    CUresult (*importFrom)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
    CUresult (*getName)(CUresult, const char **);
    CUresult (*devGet)(CUdevice *, int);
    CUresult (*devAttr)(int *, CUdevice_attribute, CUdevice);
} fr_drv_t;

static fr_drv_t fr_drv;
static pthread_mutex_t fr_drv_lock = PTHREAD_MUTEX_INITIALIZER;

static const fr_drv_t *fr_drv_get(void)
{
    pthread_mutex_lock(&fr_drv_lock);
    if (fr_drv.state == 0) {
        struct {
            const char *sym;
            void **fn;
        } t[] = {
            {"cuMemGetAllocationGranularity", (void **)&fr_drv.getGranularity},
            {"cuMemCreate", (void **)&fr_drv.create},
            {"cuMemRelease", (void **)&fr_drv.release},
            {"cuMemAddressReserve", (void **)&fr_drv.reserve},
            {"cuMemAddressFree", (void **)&fr_drv.addrFree},
            {"cuMemMap", (void **)&fr_drv.map},
            {"cuMemUnmap", (void **)&fr_drv.unmap},
            {"cuMemSetAccess", (void **)&fr_drv.setAccess},
            {"cuMemExportToShareableHandle", (void **)&fr_drv.exportTo},
            {"cuMemImportFromShareableHandle", (void **)&fr_drv.importFrom},
            {"cuGetErrorName", (void **)&fr_drv.getName},
            {"cuDeviceGet", (void **)&fr_drv.devGet},
            {"cuDeviceGetAttribute", (void **)&fr_drv.devAttr},
        };
        fr_drv.state = 1;
        for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) {
            cudaDriverEntryPointQueryResult q;
            cudaError_t e = cudaGetDriverEntryPointByVersion(t[i].sym, t[i].fn, 12000,
                                                             cudaEnableDefault, &q);
            if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !*t[i].fn) {
                (void)cudaGetLastError();
                snprintf(fr_drv.why, sizeof(fr_drv.why), "the driver has no %s", t[i].sym);
                fr_drv.state = -1;
                break;
            }
        }
    }
    pthread_mutex_unlock(&fr_drv_lock);
    return fr_drv.state == 1 ? &fr_drv : NULL;
}

static int fr_cu_fail(fr_err_t *err, const char *what, CUresult r)
{
    const char *n = NULL;
    if (fr_drv.getName)
        fr_drv.getName(r, &n);
    return FR_ERR(err, r == CUDA_ERROR_OUT_OF_MEMORY ? FERRY_ERR_NOMEM : FERRY_ERR_SYSTEM,
                  "%s: %s (%d)", what, n ? n : "CUDA driver error", (int)r);
}

static int fr_rt_fail(fr_err_t *err, const char *what, cudaError_t e)
{
    (void)cudaGetLastError();
    return FR_ERR(err, e == cudaErrorMemoryAllocation ? FERRY_ERR_NOMEM : FERRY_ERR_SYSTEM,
                  "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

int fr_cuda_device_current(int *device, fr_err_t *err)
{
    cudaError_t e = cudaGetDevice(device);
    return e == cudaSuccess ? FERRY_OK : fr_rt_fail(err, "cudaGetDevice", e);
}

int fr_cuda_device_uuid(int device, uint8_t uuid[16], fr_err_t *err)
{
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess)
        return fr_rt_fail(err, "cudaGetDeviceProperties", e);
    memcpy(uuid, prop.uuid.bytes, 16);
    return FERRY_OK;
}

/* NVML's GPU fabric info, as nvml.h lays it out (not installed with the
 * toolkit everywhere, so declared here; NVML_GPU_FABRIC_UUID_LEN 16). */
typedef struct fr_nvml_fabric {
    unsigned char cluster[16];
    int status;               /* nvmlReturn_t of the registration */
    unsigned int clique;
    unsigned char state;      /* 0 not supported, 1 not started, 2 in progress,
                                 3 completed */
} fr_nvml_fabric_t;

/* NVML's answer per device, asked once per process (nvmlInit takes long). */
#define FR_NVL_DEVS 64
static struct {
    int done, res;
    uint8_t cluster[16];
    unsigned clique;
    char why[160];
} fr_nvl_cache[FR_NVL_DEVS];
static pthread_mutex_t fr_nvl_lock = PTHREAD_MUTEX_INITIALIZER;

static int fr_nvl_query(int device, uint8_t cluster[16], unsigned *clique, char *why,
                        size_t whylen);

int fr_cuda_nvlink_domain(int device, uint8_t cluster[16], unsigned *clique, char *why,
                          size_t whylen)
{
    if (device < 0 || device >= FR_NVL_DEVS)
        return fr_nvl_query(device, cluster, clique, why, whylen);
    pthread_mutex_lock(&fr_nvl_lock);
    if (!fr_nvl_cache[device].done) {
        fr_nvl_cache[device].res =
            fr_nvl_query(device, fr_nvl_cache[device].cluster, &fr_nvl_cache[device].clique,
                         fr_nvl_cache[device].why, sizeof(fr_nvl_cache[device].why));
        fr_nvl_cache[device].done = 1;
    }
    int res = fr_nvl_cache[device].res;
    memcpy(cluster, fr_nvl_cache[device].cluster, 16);
    *clique = fr_nvl_cache[device].clique;
    if (why && whylen)
        snprintf(why, whylen, "%s", fr_nvl_cache[device].why);
    pthread_mutex_unlock(&fr_nvl_lock);
    return res;
}

static int fr_nvl_query(int device, uint8_t cluster[16], unsigned *clique, char *why,
                        size_t whylen)
{
    typedef int (*init_t)(void);
    typedef int (*byid_t)(const char *, void **);
    typedef int (*info_t)(void *, fr_nvml_fabric_t *);
    typedef const char *(*str_t)(int);
    static const char *states[] = {"not supported", "not started", "in progress", "completed"};
    memset(cluster, 0, 16);
    *clique = 0;
    char w[160] = "";
    int res = -1;
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    init_t init = lib ? (init_t)dlsym(lib, "nvmlInit_v2") : NULL;
    init_t fini = lib ? (init_t)dlsym(lib, "nvmlShutdown") : NULL;
    byid_t byid = lib ? (byid_t)dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2") : NULL;
    info_t info = lib ? (info_t)dlsym(lib, "nvmlDeviceGetGpuFabricInfo") : NULL;
    str_t str = lib ? (str_t)dlsym(lib, "nvmlErrorString") : NULL;
    char bus[32];
    void *h = NULL;
    fr_nvml_fabric_t f;
    memset(&f, 0, sizeof(f));
    int r;
    if (!lib || !init || !fini || !byid || !info || !str) {
        snprintf(w, sizeof(w), "NVML: %s", lib ? "no nvmlDeviceGetGpuFabricInfo"
                                                : "libnvidia-ml.so.1 not loadable");
    } else if ((r = init()) != 0) {
        snprintf(w, sizeof(w), "NVML: nvmlInit: %s", str(r));
    } else {
        if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess) {
            (void)cudaGetLastError();
            snprintf(w, sizeof(w), "cudaDeviceGetPCIBusId failed for device %d", device);
        } else if ((r = byid(bus, &h)) != 0) {
            snprintf(w, sizeof(w), "NVML: nvmlDeviceGetHandleByPciBusId(%s): %s", bus, str(r));
        } else if ((r = info(h, &f)) != 0) {
            snprintf(w, sizeof(w), "NVML: nvmlDeviceGetGpuFabricInfo: %s", str(r));
        } else if (f.state != 3 || f.status != 0) {
            res = 0;
            snprintf(w, sizeof(w), "fabric state: %s%s%s", f.state < 4 ? states[f.state] : "?",
                     f.state == 3 ? ", registration: " : "", f.state == 3 ? str(f.status) : "");
        } else {
            static const unsigned char zero[16] = {0};
            if (memcmp(f.cluster, zero, 16) == 0) { /* a lone NVSwitch box */
                res = 0;
                snprintf(w, sizeof(w), "fabric registered with an all-zero cluster UUID");
            } else {
                res = 1;
                memcpy(cluster, f.cluster, 16);
                *clique = f.clique;
            }
        }
        fini();
    }
    if (lib)
        dlclose(lib);
    if (why && whylen)
        snprintf(why, whylen, "%s", w);
    return res;
}

/* A device attribute through the driver (the runtime's enum lacks the
 * VMM ones); 0 when it cannot be read. */
static int fr_drv_attr(const fr_drv_t *d, int device, CUdevice_attribute a)
{
    CUdevice dev;
    int v = 0;
    if (!d || d->devGet(&dev, device) != CUDA_SUCCESS || d->devAttr(&v, a, dev) != CUDA_SUCCESS)
        return 0;
    return v;
}

static CUmemAllocationHandleType fr_pmem_htype(int kind)
{
    return kind == FR_PMEM_FABRIC ? CU_MEM_HANDLE_TYPE_FABRIC
                                  : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

int fr_pmem_kinds(int device, char *why, size_t whylen)
{
    int k = FR_PMEM_LEGACY;
    char w[256] = "";
    const fr_drv_t *d = fr_drv_get();
    if (!d) {
        snprintf(w, sizeof(w), "vmm, fabric: %s", fr_drv.why);
    } else if (!fr_drv_attr(d, device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)) {
        snprintf(w, sizeof(w),
                 "vmm, fabric: CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0 on "
                 "device %d", device);
    } else {
        if (fr_drv_attr(d, device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED))
            k |= FR_PMEM_VMM;
        else
            snprintf(w, sizeof(w),
                     "vmm: CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0 "
                     "on device %d", device);
        if (fr_drv_attr(d, device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED))
            k |= FR_PMEM_FABRIC;
        else
            snprintf(w + strlen(w), sizeof(w) - strlen(w),
                     "%sfabric: CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0 on "
                     "device %d", w[0] ? "; " : "", device);
    }
    if (why && whylen)
        snprintf(why, whylen, "%s", w);
    return k;
}

static void fr_pmem_prop(int kind, int device, CUmemAllocationProp *p)
{
    memset(p, 0, sizeof(*p));
    p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p->location.id = device;
    p->requestedHandleTypes = fr_pmem_htype(kind);
    /* a NIC may register it, where the device allows */
    p->allocFlags.gpuDirectRDMACapable =
        fr_drv_attr(&fr_drv, device, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)
            ? 1 : 0;
}

/* Reserve, map and open `h` for `device`: *ptr. */
static int fr_pmem_map(const fr_drv_t *d, CUmemGenericAllocationHandle h, int device,
                       size_t size, size_t align, void **ptr, fr_err_t *err)
{
    CUdeviceptr va = 0;
    CUresult r = d->reserve(&va, size, align, 0, 0);
    if (r != CUDA_SUCCESS)
        return fr_cu_fail(err, "cuMemAddressReserve", r);
    if ((r = d->map(va, size, 0, h, 0)) != CUDA_SUCCESS) {
        d->addrFree(va, size);
        return fr_cu_fail(err, "cuMemMap", r);
    }
    CUmemAccessDesc a;
    memset(&a, 0, sizeof(a));
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = device;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if ((r = d->setAccess(va, size, &a, 1)) != CUDA_SUCCESS) {
        d->unmap(va, size);
        d->addrFree(va, size);
        return fr_cu_fail(err, "cuMemSetAccess", r);
    }
    *ptr = (void *)va;
    return FERRY_OK;
}

int fr_pmem_alloc(int kind, int device, size_t bytes, fr_pmem_t *m, fr_err_t *err)
{
    memset(m, 0, sizeof(*m));
    cudaError_t e;
    if (kind == FR_PMEM_LEGACY) {
        void *p = NULL;
        if ((e = cudaMalloc(&p, bytes)) != cudaSuccess)
            return fr_rt_fail(err, "cudaMalloc", e);
        if ((e = cudaMemset(p, 0, bytes)) != cudaSuccess) {
            cudaFree(p);
            return fr_rt_fail(err, "cudaMemset", e);
        }
        m->kind = kind;
        m->own = 1;
        m->device = device;
        m->ptr = p;
        m->size = bytes;
        return FERRY_OK;
    }
    const fr_drv_t *d = fr_drv_get();
    if (!d)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "peer memory %s: %s", fr_pmem_name(kind),
                      fr_drv.why);
    CUmemAllocationProp p;
    fr_pmem_prop(kind, device, &p);
    size_t g = 0;
    CUresult r = d->getGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (r != CUDA_SUCCESS || g == 0)
        return fr_cu_fail(err, "cuMemGetAllocationGranularity", r);
    size_t size = (bytes + g - 1) / g * g;
    CUmemGenericAllocationHandle h;
    if ((r = d->create(&h, size, &p, 0)) != CUDA_SUCCESS && p.allocFlags.gpuDirectRDMACapable &&
        (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_NOT_SUPPORTED)) {
        p.allocFlags.gpuDirectRDMACapable = 0; /* refused with the flag: as cudaMalloc's */
        r = d->create(&h, size, &p, 0);
    }
    if (r != CUDA_SUCCESS)
        return fr_cu_fail(err, kind == FR_PMEM_FABRIC ? "cuMemCreate (fabric handle)"
                                                      : "cuMemCreate (POSIX file descriptor)",
                          r);
    void *ptr = NULL;
    int rc = fr_pmem_map(d, h, device, size, g, &ptr, err);
    if (rc != FERRY_OK) {
        d->release(h);
        return rc;
    }
    m->kind = kind;
    m->own = 1;
    m->device = device;
    m->ptr = ptr;
    m->size = size;
    m->h = h;
    if ((e = cudaMemset(ptr, 0, size)) != cudaSuccess) {
        fr_pmem_close(m);
        return fr_rt_fail(err, "cudaMemset", e);
    }
    return FERRY_OK;
}

/* A trial's outcome per (kind, device), once per process. */
static struct {
    int done, rc;
    char msg[200];
} fr_try_cache[3][FR_NVL_DEVS];
static pthread_mutex_t fr_try_lock = PTHREAD_MUTEX_INITIALIZER;

static int fr_pmem_try_once(int kind, int device, fr_err_t *err);

int fr_pmem_try(int kind, int device, fr_err_t *err)
{
    int k = kind == FR_PMEM_LEGACY ? 0 : kind == FR_PMEM_VMM ? 1 : 2;
    if (device < 0 || device >= FR_NVL_DEVS)
        return fr_pmem_try_once(kind, device, err);
    pthread_mutex_lock(&fr_try_lock);
    if (!fr_try_cache[k][device].done) {
        fr_err_t e = {{0}};
        fr_try_cache[k][device].rc = fr_pmem_try_once(kind, device, &e);
        snprintf(fr_try_cache[k][device].msg, sizeof(fr_try_cache[k][device].msg), "%s",
                 e.msg);
        fr_try_cache[k][device].done = 1;
    }
    int rc = fr_try_cache[k][device].rc;
    if (rc != FERRY_OK)
        FR_ERR(err, rc, "%s", fr_try_cache[k][device].msg);
    pthread_mutex_unlock(&fr_try_lock);
    return rc;
}

static int fr_pmem_try_once(int kind, int device, fr_err_t *err)
{
    fr_pmem_t m;
    uint8_t blob[FR_PMEM_BLOB];
    int fd = -1, rc = fr_pmem_alloc(kind, device, 1, &m, err);
    if (rc == FERRY_OK)
        rc = fr_pmem_export(&m, blob, &fd, err);
    if (fd >= 0)
        close(fd);
    fr_pmem_close(&m);
    return rc;
}

int fr_pmem_usable(int kind, int device, char *why, size_t whylen)
{
    char w[256] = "";
    fr_err_t e;
    int ok = (fr_pmem_kinds(device, w, sizeof(w)) & kind) != 0;
    if (ok && kind != FR_PMEM_LEGACY && fr_pmem_try(kind, device, &e) != FERRY_OK) {
        ok = 0;
        snprintf(w, sizeof(w), "%s: trial allocation: %.200s", fr_pmem_name(kind), e.msg);
    }
    if (why && whylen)
        snprintf(why, whylen, "%s", ok ? "" : w);
    return ok;
}

int fr_pmem_export(const fr_pmem_t *m, uint8_t blob[FR_PMEM_BLOB], int *fd, fr_err_t *err)
{
    memset(blob, 0, FR_PMEM_BLOB);
    *fd = -1;
    if (m->kind == FR_PMEM_LEGACY) {
        cudaIpcMemHandle_t h;
        cudaError_t e = cudaIpcGetMemHandle(&h, m->ptr);
        if (e != cudaSuccess)
            return fr_rt_fail(err, "cudaIpcGetMemHandle", e);
        memcpy(blob, &h, sizeof(h) < FR_PMEM_BLOB ? sizeof(h) : FR_PMEM_BLOB);
        return FERRY_OK;
    }
    const fr_drv_t *d = fr_drv_get();
    if (!d)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "peer memory: %s", fr_drv.why);
    CUresult r;
    if (m->kind == FR_PMEM_FABRIC) {
        CUmemFabricHandle fh;
        if ((r = d->exportTo(&fh, m->h, CU_MEM_HANDLE_TYPE_FABRIC, 0)) != CUDA_SUCCESS)
            return fr_cu_fail(err, "cuMemExportToShareableHandle (fabric)", r);
        memcpy(blob, &fh, sizeof(fh) < FR_PMEM_BLOB ? sizeof(fh) : FR_PMEM_BLOB);
        return FERRY_OK;
    }
    int f = -1;
    if ((r = d->exportTo(&f, m->h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) !=
        CUDA_SUCCESS)
        return fr_cu_fail(err, "cuMemExportToShareableHandle (POSIX file descriptor)", r);
    *fd = f;
    return FERRY_OK;
}

int fr_pmem_open(int kind, int device, const uint8_t *blob, int fd, size_t size, fr_pmem_t *m,
                 fr_err_t *err)
{
    memset(m, 0, sizeof(*m));
    if (kind == FR_PMEM_LEGACY) {
        cudaIpcMemHandle_t h;
        memcpy(&h, blob, sizeof(h));
        void *p = NULL;
        cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess)
            return fr_rt_fail(err, "cudaIpcOpenMemHandle", e);
        m->kind = kind;
        m->device = device;
        m->ptr = p;
        m->size = size;
        return FERRY_OK;
    }
    const fr_drv_t *d = fr_drv_get();
    if (!d) {
        if (fd >= 0)
            close(fd);
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "peer memory: %s", fr_drv.why);
    }
    CUmemGenericAllocationHandle h;
    CUresult r;
    if (kind == FR_PMEM_FABRIC) {
        CUmemFabricHandle fh;
        memcpy(&fh, blob, sizeof(fh));
        r = d->importFrom(&h, &fh, CU_MEM_HANDLE_TYPE_FABRIC);
    } else {
        r = d->importFrom(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        close(fd); /* the handle holds the memory now */
    }
    if (r != CUDA_SUCCESS)
        return fr_cu_fail(err, "cuMemImportFromShareableHandle", r);
    CUmemAllocationProp p;
    fr_pmem_prop(kind, device, &p);
    size_t g = 0;
    if ((r = d->getGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) != CUDA_SUCCESS ||
        !g) {
        d->release(h);
        return fr_cu_fail(err, "cuMemGetAllocationGranularity", r);
    }
    void *ptr = NULL;
    int rc = fr_pmem_map(d, h, device, size, g, &ptr, err);
    if (rc != FERRY_OK) {
        d->release(h);
        return rc;
    }
    m->kind = kind;
    m->device = device;
    m->ptr = ptr;
    m->size = size;
    m->h = h;
    return FERRY_OK;
}

void fr_pmem_close(fr_pmem_t *m)
{
    if (!m || !m->kind || !m->ptr || m->own < 0) {
        if (m)
            memset(m, 0, sizeof(*m));
        return;
    }
    if (m->kind == FR_PMEM_LEGACY) {
        if (m->own)
            cudaFree(m->ptr);
        else
            cudaIpcCloseMemHandle(m->ptr);
    } else if (fr_drv.state == 1) {
        fr_drv.unmap((CUdeviceptr)m->ptr, m->size);
        fr_drv.addrFree((CUdeviceptr)m->ptr, m->size);
        fr_drv.release(m->h);
    }
    (void)cudaGetLastError();
    memset(m, 0, sizeof(*m));
}
