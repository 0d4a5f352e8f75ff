/* The CUDA runtime of an emulated card, preloaded (LD_PRELOAD) into a CUDA build of torch on a host
 * with no GPU and no driver, for fake-tensor trials (autotune/emulation/).
 *
 * One device, whose properties are the card's (card.h). What torch asks of a device that computes
 * nothing is answered: device count, current device, properties and attributes, versions, stream
 * priorities, capture queries, and streams and events as handles that do nothing. Allocation is
 * refused, loudly, with a line naming the call and its size: a fake trial that allocates real memory
 * is a bug, never a silent fallback. Every other entry point of libcudart is a stub generated at build
 * time (autotune/emulation/build.py) that logs its name on first call and fails.
 */
#include <cuda_runtime_api.h>

#include "card.h"

#define AT_ENTRY(name)                                                              \
    static int at_state = -1;                                                       \
    static int at_logged = 0;                                                       \
    int at_now = __atomic_load_n(&at_state, __ATOMIC_RELAXED);                      \
    if (at_now < 0) {                                                               \
        at_now = at_disabled(name);                                                 \
        __atomic_store_n(&at_state, at_now, __ATOMIC_RELAXED);                      \
    }                                                                               \
    if (at_now) {                                                                   \
        at_not_emulated_once(name, &at_logged);                                     \
        return cudaErrorNotSupported;                                               \
    }

#define AT_DEVICE(device)                                                           \
    if (!at_card()->ok) return cudaErrorInitializationError;                        \
    if ((device) != 0) return cudaErrorInvalidDevice;

static __thread int at_current_device = 0;
static unsigned long long at_next_handle = 0x1000;

static void *at_handle(void) {
    return (void *)__atomic_add_fetch(&at_next_handle, 16, __ATOMIC_RELAXED);
}

/* ---- devices ------------------------------------------------------------------------------------ */

cudaError_t cudaGetDeviceCount(int *count) {
    AT_ENTRY("cudaGetDeviceCount")
    if (!at_card()->ok) {
        *count = 0;
        return cudaErrorInitializationError;
    }
    *count = 1;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
    AT_ENTRY("cudaGetDevice")
    *device = at_current_device;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    AT_ENTRY("cudaSetDevice")
    AT_DEVICE(device)
    at_current_device = device;
    return cudaSuccess;
}

cudaError_t cudaInitDevice(int device, unsigned int device_flags, unsigned int flags) {
    AT_ENTRY("cudaInitDevice")
    (void)device_flags;
    (void)flags;
    AT_DEVICE(device)
    return cudaSuccess;
}

cudaError_t cudaGetDeviceFlags(unsigned int *flags) {
    AT_ENTRY("cudaGetDeviceFlags")
    *flags = cudaDeviceScheduleAuto;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
    AT_ENTRY("cudaDeviceSynchronize")
    return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int *can_access, int device, int peer) {
    AT_ENTRY("cudaDeviceCanAccessPeer")
    (void)peer;
    AT_DEVICE(device)
    *can_access = 0;  /* one device: no peer */
    return cudaSuccess;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    AT_ENTRY("cudaDeviceGetStreamPriorityRange")
    /* What every card from compute capability 7.0 on reports. */
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char *bus_id, int length, int device) {
    AT_ENTRY("cudaDeviceGetPCIBusId")
    AT_DEVICE(device)
    snprintf(bus_id, (size_t)length, "00000000:00:00.0");
    return cudaSuccess;
}

static void at_fill_properties(struct cudaDeviceProp *prop) {
    const struct at_card *card = at_card();
    memset(prop, 0, sizeof(*prop));
    snprintf(prop->name, sizeof(prop->name), "%s", card->name);
    /* A fixed UUID whose first bytes say "autotune": an emulated device is never mistaken for a card. */
    memcpy(prop->uuid.bytes, "autotune-emulate", 16);
    prop->totalGlobalMem = (size_t)card->total_bytes;
    prop->sharedMemPerBlock = (size_t)card->shared_per_block;
    prop->regsPerBlock = (int)card->registers_per_block;
    prop->warpSize = (int)card->warp_size;
    prop->memPitch = 2147483647;
    prop->maxThreadsPerBlock = (int)card->max_threads_per_block;
    prop->maxThreadsDim[0] = 1024;
    prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 2147483647;
    prop->maxGridSize[1] = 65535;
    prop->maxGridSize[2] = 65535;
    prop->totalConstMem = (size_t)card->constant_bytes;
    prop->major = (int)card->major;
    prop->minor = (int)card->minor;
    prop->textureAlignment = 512;
    prop->texturePitchAlignment = 32;
    prop->multiProcessorCount = (int)card->sm_count;
    prop->concurrentKernels = 1;
    prop->ECCEnabled = 1;
    prop->asyncEngineCount = 2;
    prop->unifiedAddressing = 1;
    prop->memoryBusWidth = (int)card->bus_width_bits;
    prop->l2CacheSize = (int)card->l2_bytes;
    prop->maxThreadsPerMultiProcessor = (int)card->max_threads_per_sm;
    prop->streamPrioritiesSupported = 1;
    prop->globalL1CacheSupported = 1;
    prop->localL1CacheSupported = 1;
    prop->sharedMemPerMultiprocessor = (size_t)card->shared_per_sm;
    prop->regsPerMultiprocessor = (int)card->registers_per_sm;
    prop->managedMemory = 1;
    prop->concurrentManagedAccess = 1;
    prop->computePreemptionSupported = 1;
    prop->cooperativeLaunch = 1;
    prop->sharedMemPerBlockOptin = (size_t)card->shared_per_block_optin;
    prop->maxBlocksPerMultiProcessor = (int)card->max_blocks_per_sm;
    prop->reservedSharedMemPerBlock = (size_t)card->shared_reserved_per_block;
    prop->hostRegisterSupported = 1;
    prop->memoryPoolsSupported = 1;
    prop->clusterLaunch = card->major >= 9;
    prop->deviceNumaId = -1;
    prop->hostNumaId = -1;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
    AT_ENTRY("cudaGetDeviceProperties")
    AT_DEVICE(device)
    at_fill_properties(prop);
    return cudaSuccess;
}

/* The attributes answer from the same properties, so that the two ways torch asks always agree. */
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attribute, int device) {
    AT_ENTRY("cudaDeviceGetAttribute")
    AT_DEVICE(device)
    struct cudaDeviceProp prop;
    at_fill_properties(&prop);
    switch (attribute) {
        case cudaDevAttrMaxThreadsPerBlock: *value = prop.maxThreadsPerBlock; break;
        case cudaDevAttrMaxBlockDimX: *value = prop.maxThreadsDim[0]; break;
        case cudaDevAttrMaxBlockDimY: *value = prop.maxThreadsDim[1]; break;
        case cudaDevAttrMaxBlockDimZ: *value = prop.maxThreadsDim[2]; break;
        case cudaDevAttrMaxGridDimX: *value = prop.maxGridSize[0]; break;
        case cudaDevAttrMaxGridDimY: *value = prop.maxGridSize[1]; break;
        case cudaDevAttrMaxGridDimZ: *value = prop.maxGridSize[2]; break;
        case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)prop.sharedMemPerBlock; break;
        case cudaDevAttrTotalConstantMemory: *value = (int)prop.totalConstMem; break;
        case cudaDevAttrWarpSize: *value = prop.warpSize; break;
        case cudaDevAttrMaxRegistersPerBlock: *value = prop.regsPerBlock; break;
        case cudaDevAttrMultiProcessorCount: *value = prop.multiProcessorCount; break;
        case cudaDevAttrIntegrated: *value = prop.integrated; break;
        case cudaDevAttrConcurrentKernels: *value = prop.concurrentKernels; break;
        case cudaDevAttrEccEnabled: *value = prop.ECCEnabled; break;
        case cudaDevAttrPciBusId: *value = prop.pciBusID; break;
        case cudaDevAttrPciDeviceId: *value = prop.pciDeviceID; break;
        case cudaDevAttrPciDomainId: *value = prop.pciDomainID; break;
        case cudaDevAttrAsyncEngineCount: *value = prop.asyncEngineCount; break;
        case cudaDevAttrUnifiedAddressing: *value = prop.unifiedAddressing; break;
        case cudaDevAttrGlobalMemoryBusWidth: *value = prop.memoryBusWidth; break;
        case cudaDevAttrL2CacheSize: *value = prop.l2CacheSize; break;
        case cudaDevAttrMaxThreadsPerMultiProcessor: *value = prop.maxThreadsPerMultiProcessor; break;
        case cudaDevAttrComputeCapabilityMajor: *value = prop.major; break;
        case cudaDevAttrComputeCapabilityMinor: *value = prop.minor; break;
        case cudaDevAttrStreamPrioritiesSupported: *value = prop.streamPrioritiesSupported; break;
        case cudaDevAttrGlobalL1CacheSupported: *value = prop.globalL1CacheSupported; break;
        case cudaDevAttrLocalL1CacheSupported: *value = prop.localL1CacheSupported; break;
        case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = (int)prop.sharedMemPerMultiprocessor; break;
        case cudaDevAttrMaxRegistersPerMultiprocessor: *value = prop.regsPerMultiprocessor; break;
        case cudaDevAttrManagedMemory: *value = prop.managedMemory; break;
        case cudaDevAttrIsMultiGpuBoard: *value = prop.isMultiGpuBoard; break;
        case cudaDevAttrConcurrentManagedAccess: *value = prop.concurrentManagedAccess; break;
        case cudaDevAttrComputePreemptionSupported: *value = prop.computePreemptionSupported; break;
        case cudaDevAttrCooperativeLaunch: *value = prop.cooperativeLaunch; break;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)prop.sharedMemPerBlockOptin; break;
        case cudaDevAttrMaxBlocksPerMultiprocessor: *value = prop.maxBlocksPerMultiProcessor; break;
        case cudaDevAttrReservedSharedMemoryPerBlock: *value = (int)prop.reservedSharedMemPerBlock; break;
        case cudaDevAttrHostRegisterSupported: *value = prop.hostRegisterSupported; break;
        case cudaDevAttrMemoryPoolsSupported: *value = prop.memoryPoolsSupported; break;
        case cudaDevAttrClusterLaunch: *value = prop.clusterLaunch; break;
        case cudaDevAttrNumaId: *value = prop.deviceNumaId; break;
        case cudaDevAttrHostNumaId: *value = prop.hostNumaId; break;
        case cudaDevAttrCanUseHostPointerForRegisteredMem: *value = 1; break;
        case cudaDevAttrPageableMemoryAccess: *value = 0; break;
        case cudaDevAttrGPUDirectRDMASupported: *value = 0; break;
        default: {
            /* An attribute the card does not describe: said once per attribute, and refused. */
            static unsigned char said[1024];
            unsigned index = (unsigned)attribute < sizeof(said) ? (unsigned)attribute : 0;
            if (!__atomic_exchange_n(&said[index], 1, __ATOMIC_RELAXED))
                at_log("cudaDeviceGetAttribute(attribute %d) is not emulated: it was called and failed", (int)attribute);
            return cudaErrorNotSupported;
        }
    }
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    AT_ENTRY("cudaMemGetInfo")
    if (!at_card()->ok) return cudaErrorInitializationError;
    /* Nothing is ever allocated on an emulated card. */
    *free_bytes = (size_t)at_card()->total_bytes;
    *total_bytes = (size_t)at_card()->total_bytes;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetLimit(size_t *value, enum cudaLimit limit) {
    AT_ENTRY("cudaDeviceGetLimit")
    switch (limit) {
        case cudaLimitStackSize: *value = 1024; break;
        case cudaLimitPrintfFifoSize: *value = 1 << 20; break;
        case cudaLimitMallocHeapSize: *value = 8 << 20; break;
        default: *value = 0; break;
    }
    return cudaSuccess;
}

/* ---- versions and errors ------------------------------------------------------------------------ */

cudaError_t cudaDriverGetVersion(int *version) {
    AT_ENTRY("cudaDriverGetVersion")
    if (!at_card()->ok) return cudaErrorInitializationError;
    *version = (int)at_card()->driver_version;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *version) {
    AT_ENTRY("cudaRuntimeGetVersion")
    *version = CUDART_VERSION;
    return cudaSuccess;
}

/* No call leaves an error behind: each reports its own. */
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }

const char *cudaGetErrorName(cudaError_t error) {
    switch (error) {
        case cudaSuccess: return "cudaSuccess";
        case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
        case cudaErrorInitializationError: return "cudaErrorInitializationError";
        case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
        case cudaErrorNoDevice: return "cudaErrorNoDevice";
        case cudaErrorNotSupported: return "cudaErrorNotSupported";
        default: return "cudaErrorUnknown";
    }
}

const char *cudaGetErrorString(cudaError_t error) {
    switch (error) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorInitializationError: return "the emulated card is not described (see the autotune-emulation line)";
        case cudaErrorInvalidDevice: return "invalid device ordinal (an emulated card is device 0 only)";
        case cudaErrorNotSupported:
            return "operation not supported by the CUDA emulation (see the autotune-emulation line)";
        default: return "unknown error (CUDA emulation)";
    }
}

/* ---- streams, events, graphs: handles that do nothing ------------------------------------------- */

cudaError_t cudaStreamCreate(cudaStream_t *stream) {
    AT_ENTRY("cudaStreamCreate")
    *stream = (cudaStream_t)at_handle();
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
    AT_ENTRY("cudaStreamCreateWithFlags")
    (void)flags;
    *stream = (cudaStream_t)at_handle();
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t *stream, unsigned int flags, int priority) {
    AT_ENTRY("cudaStreamCreateWithPriority")
    (void)flags;
    (void)priority;
    *stream = (cudaStream_t)at_handle();
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    AT_ENTRY("cudaStreamDestroy")
    (void)stream;
    return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
    AT_ENTRY("cudaStreamQuery")
    (void)stream;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    AT_ENTRY("cudaStreamSynchronize")
    (void)stream;
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    AT_ENTRY("cudaStreamWaitEvent")
    (void)stream;
    (void)event;
    (void)flags;
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status) {
    AT_ENTRY("cudaStreamIsCapturing")
    (void)stream;
    *status = cudaStreamCaptureStatusNone;
    return cudaSuccess;
}

cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, enum cudaStreamCaptureStatus *status,
                                     unsigned long long *id, cudaGraph_t *graph,
                                     const cudaGraphNode_t **dependencies, const cudaGraphEdgeData **edges,
                                     size_t *count) {
    AT_ENTRY("cudaStreamGetCaptureInfo")
    (void)stream;
    *status = cudaStreamCaptureStatusNone;
    if (id) *id = 0;
    if (graph) *graph = NULL;
    if (dependencies) *dependencies = NULL;
    if (edges) *edges = NULL;
    if (count) *count = 0;
    return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
    AT_ENTRY("cudaThreadExchangeStreamCaptureMode")
    (void)mode;
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *event) {
    AT_ENTRY("cudaEventCreate")
    *event = (cudaEvent_t)at_handle();
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
    AT_ENTRY("cudaEventCreateWithFlags")
    (void)flags;
    *event = (cudaEvent_t)at_handle();
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    AT_ENTRY("cudaEventDestroy")
    (void)event;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    AT_ENTRY("cudaEventRecord")
    (void)event;
    (void)stream;
    return cudaSuccess;
}

cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
    AT_ENTRY("cudaEventRecordWithFlags")
    (void)event;
    (void)stream;
    (void)flags;
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
    AT_ENTRY("cudaEventQuery")
    (void)event;
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    AT_ENTRY("cudaEventSynchronize")
    (void)event;
    return cudaSuccess;
}

/* ---- memory: refused ---------------------------------------------------------------------------- */

static cudaError_t at_refuse(const char *call, size_t bytes) {
    at_log("%s of %zu bytes refused: an emulated card has no memory, and a fake trial must not allocate", call,
           bytes);
    return cudaErrorNotSupported;  /* not cudaErrorMemoryAllocation: this is no out-of-memory */
}

cudaError_t cudaMalloc(void **pointer, size_t bytes) {
    *pointer = NULL;
    return at_refuse("cudaMalloc", bytes);
}

cudaError_t cudaMallocAsync(void **pointer, size_t bytes, cudaStream_t stream) {
    (void)stream;
    *pointer = NULL;
    return at_refuse("cudaMallocAsync", bytes);
}

cudaError_t cudaMallocFromPoolAsync(void **pointer, size_t bytes, cudaMemPool_t pool, cudaStream_t stream) {
    (void)pool;
    (void)stream;
    *pointer = NULL;
    return at_refuse("cudaMallocFromPoolAsync", bytes);
}

cudaError_t cudaMallocManaged(void **pointer, size_t bytes, unsigned int flags) {
    (void)flags;
    *pointer = NULL;
    return at_refuse("cudaMallocManaged", bytes);
}

cudaError_t cudaMallocHost(void **pointer, size_t bytes) {
    *pointer = NULL;
    return at_refuse("cudaMallocHost", bytes);
}

cudaError_t cudaHostAlloc(void **pointer, size_t bytes, unsigned int flags) {
    (void)flags;
    *pointer = NULL;
    return at_refuse("cudaHostAlloc", bytes);
}

cudaError_t cudaMallocPitch(void **pointer, size_t *pitch, size_t width, size_t height) {
    *pointer = NULL;
    if (pitch) *pitch = 0;
    return at_refuse("cudaMallocPitch", width * height);
}

/* cudaFree(NULL) is how libraries make sure a context exists; nothing else can be freed. */
cudaError_t cudaFree(void *pointer) {
    if (pointer == NULL) return cudaSuccess;
    at_log("cudaFree(%p) refused: an emulated card never allocated it", pointer);
    return cudaErrorNotSupported;
}

/* A host pointer is never pinned here (nothing is registered with an emulated card). */
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *pointer) {
    AT_ENTRY("cudaPointerGetAttributes")
    memset(attributes, 0, sizeof(*attributes));
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = -1;
    attributes->hostPointer = (void *)pointer;
    return cudaSuccess;
}
