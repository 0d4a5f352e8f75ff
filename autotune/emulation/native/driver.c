/* A stand-in libcuda.so.1 for the emulated card (autotune/emulation/), found first on LD_LIBRARY_PATH.
 *
 * torch's NVRTC stub (libcaffe2_nvrtc.so) links libcuda.so.1, and the autograd engine asks it whether
 * the device's primary context is active before it runs backward on the device's streams: here it
 * always is. Device queries answer from the card (card.h); every other driver entry point torch's
 * libraries import is a stub generated at build time that logs its name on first call and fails.
 */
#include <cuda.h>

#include "card.h"

#define AT_DRIVER_ENTRY(name)                                                       \
    static int at_state = -1;                                                       \
    static int at_logged = 0;                                                       \
    int at_now = __atomic_load_n(&at_state, __ATOMIC_RELAXED);                      \
    if (at_now < 0) {                                                               \
        at_now = at_disabled(name);                                                 \
        __atomic_store_n(&at_state, at_now, __ATOMIC_RELAXED);                      \
    }                                                                               \
    if (at_now) {                                                                   \
        at_not_emulated_once(name, &at_logged);                                     \
        return CUDA_ERROR_NOT_SUPPORTED;                                            \
    }

#define AT_DRIVER_DEVICE(device)                                                    \
    if (!at_card()->ok) return CUDA_ERROR_NOT_INITIALIZED;                          \
    if ((device) != 0) return CUDA_ERROR_INVALID_DEVICE;

/* A context handle that is never dereferenced: one per process, like the primary context. */
static CUcontext at_primary_context = (CUcontext)0x1000;
static __thread CUcontext at_current_context = NULL;

CUresult cuInit(unsigned int flags) {
    AT_DRIVER_ENTRY("cuInit")
    (void)flags;
    return at_card()->ok ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult cuDriverGetVersion(int *version) {
    AT_DRIVER_ENTRY("cuDriverGetVersion")
    if (!at_card()->ok) return CUDA_ERROR_NOT_INITIALIZED;
    *version = (int)at_card()->driver_version;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    AT_DRIVER_ENTRY("cuDeviceGetCount")
    *count = at_card()->ok ? 1 : 0;
    return at_card()->ok ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    AT_DRIVER_ENTRY("cuDeviceGet")
    AT_DRIVER_DEVICE(ordinal)
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int length, CUdevice device) {
    AT_DRIVER_ENTRY("cuDeviceGetName")
    AT_DRIVER_DEVICE(device)
    snprintf(name, (size_t)length, "%s", at_card()->name);
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem(size_t *bytes, CUdevice device) {
    AT_DRIVER_ENTRY("cuDeviceTotalMem")
    AT_DRIVER_DEVICE(device)
    *bytes = (size_t)at_card()->total_bytes;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
    AT_DRIVER_ENTRY("cuDeviceGetAttribute")
    AT_DRIVER_DEVICE(device)
    const struct at_card *card = at_card();
    switch (attribute) {
        case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = (int)card->major; break;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = (int)card->minor; break;
        case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = (int)card->sm_count; break;
        case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = (int)card->max_threads_per_block; break;
        case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = (int)card->warp_size; break;
        case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *value = (int)card->l2_bytes; break;
        case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *value = (int)card->bus_width_bits; break;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *value = (int)card->shared_per_block; break;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = (int)card->shared_per_block_optin; break;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *value = (int)card->shared_per_sm; break;
        case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *value = (int)card->max_threads_per_sm; break;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: *value = (int)card->max_blocks_per_sm; break;
        case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: *value = (int)card->registers_per_sm; break;
        case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *value = (int)card->registers_per_block; break;
        case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *value = 1; break;
        default: {
            static unsigned char said[1024];
            unsigned index = (unsigned)attribute < sizeof(said) ? (unsigned)attribute : 0;
            if (!__atomic_exchange_n(&said[index], 1, __ATOMIC_RELAXED))
                at_log("cuDeviceGetAttribute(attribute %d) is not emulated: it was called and failed", (int)attribute);
            return CUDA_ERROR_NOT_SUPPORTED;
        }
    }
    return CUDA_SUCCESS;
}

/* What the autograd engine asks before it stashes the device's streams: the context is active. */
CUresult cuDevicePrimaryCtxGetState(CUdevice device, unsigned int *flags, int *active) {
    AT_DRIVER_ENTRY("cuDevicePrimaryCtxGetState")
    AT_DRIVER_DEVICE(device)
    *flags = 0;
    *active = 1;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) {
    AT_DRIVER_ENTRY("cuDevicePrimaryCtxRetain")
    AT_DRIVER_DEVICE(device)
    *context = at_primary_context;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *context) {
    AT_DRIVER_ENTRY("cuCtxGetCurrent")
    *context = at_current_context != NULL ? at_current_context : at_primary_context;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext context) {
    AT_DRIVER_ENTRY("cuCtxSetCurrent")
    at_current_context = context;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **text) {
    switch (error) {
        case CUDA_SUCCESS: *text = "no error"; break;
        case CUDA_ERROR_NOT_INITIALIZED: *text = "the emulated card is not described (see the autotune-emulation line)"; break;
        case CUDA_ERROR_INVALID_DEVICE: *text = "invalid device ordinal (an emulated card is device 0 only)"; break;
        case CUDA_ERROR_NOT_SUPPORTED: *text = "operation not supported by the CUDA emulation (see the autotune-emulation line)"; break;
        default: *text = "unknown error (CUDA emulation)"; break;
    }
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **text) {
    switch (error) {
        case CUDA_SUCCESS: *text = "CUDA_SUCCESS"; break;
        case CUDA_ERROR_NOT_INITIALIZED: *text = "CUDA_ERROR_NOT_INITIALIZED"; break;
        case CUDA_ERROR_INVALID_DEVICE: *text = "CUDA_ERROR_INVALID_DEVICE"; break;
        case CUDA_ERROR_NOT_SUPPORTED: *text = "CUDA_ERROR_NOT_SUPPORTED"; break;
        default: *text = "CUDA_ERROR_UNKNOWN"; break;
    }
    return CUDA_SUCCESS;
}
