// zipmoe-gpu.h with CUDA: per decoding thread, a stream, two pinned staging buffers and two device
// buffers used in turn, and the recovery kernel (its index arithmetic: zipmoe-recover-grid.h).
//
// Why the fetch is not a CUDA op: ggml's CUDA backend refuses GGML_OP_CUSTOM, so the fetch stays a
// CPU custom op of the graph (scheduled on the CPU backend, its slot ids copied to the GPU as an
// input of the products). The slot tensors are weights in a CUDA buffer that the op writes beside
// the graph, on its own streams, and it returns only when the copies and kernels are done. The
// scheduler has drained the GPU's stream before the op runs (it copied the router's output from
// it), so no product of an earlier layer still reads a slot being written. docs/CUDA.md.

#include "ggml-zipmoe.h"
#include "codec/zipmoe-ghuf.h"
#include "gpu/zipmoe-gpu.h"
#include "codec/zipmoe-recover-grid.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#define ZIPMOE_GPU_MAX_THREADS 256

struct zipmoe_gpu_worker {
    bool         ready = false;
    cudaStream_t stream = nullptr;
    uint8_t *    host[2] = { nullptr, nullptr }; // pinned: [SM plane | exponent plane]
    uint8_t *    dev[2]  = { nullptr, nullptr };
    cudaEvent_t  done[2] = { nullptr, nullptr }; // the copy from host[b] and the kernel reading dev[b]
    bool         used[2] = { false, false };
    int          cur = 0;
    bool         pending = false;                // work queued since the last sync
    int *        corrupt = nullptr;              // mapped pinned [2]: a ghuf decode from buffer b failed
    int32_t      tag[2][3] = {};                 // the caller's (tensor, expert, shard) of that decode
};

struct zipmoe_gpu {
    int                   device = 0;
    size_t                max_count = 0;
    bool                  zero_copy = false; // an integrated GPU (Jetson): kernels read the pinned staging in place
    std::atomic<uint64_t> h2d_bytes { 0 };
    zipmoe_gpu_worker     workers[ZIPMOE_GPU_MAX_THREADS];
};

// one thread per segment of a ghuf stream; each block builds the decoding table in shared memory
__global__ void zipmoe_ghuf_kernel(const zipmoe_ghuf_code code, const uint8_t * offsets, uint32_t n_seg,
                                   const uint8_t * area, uint64_t area_size, uint64_t n, uint8_t * dst, int * corrupt) {
    __shared__ uint16_t table[ZIPMOE_GHUF_TABLE];
    for (uint32_t j = threadIdx.x; j < ZIPMOE_GHUF_TABLE; j += blockDim.x) {
        table[j] = zipmoe_ghuf_entry(&code, j);
    }
    __syncthreads();
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_seg) {
        return;
    }
    const uint64_t first = (uint64_t) i * ZIPMOE_GHUF_SEGMENT;
    const uint32_t count = (uint32_t) (n - first < ZIPMOE_GHUF_SEGMENT ? n - first : ZIPMOE_GHUF_SEGMENT);
    const uint32_t bytes = zipmoe_ghuf_segment_bytes(offsets, i, n_seg, area_size);
    if (zipmoe_ghuf_decode_segment(table, area + zipmoe_ghuf_offset(offsets, i), bytes, dst + first, count) != 0) {
        *corrupt = 1;
    }
}

__global__ void zipmoe_recover_kernel(const uint8_t * exp, const uint8_t * sm, uint64_t n, uint16_t * dst) {
    const uint64_t i = (uint64_t) blockIdx.x * blockDim.x + threadIdx.x;
    zipmoe_grid_thread(i, exp, sm, n, dst);
}

static bool check(cudaError_t e, const char * what, char * err, size_t err_size) {
    if (e == cudaSuccess) {
        return true;
    }
    snprintf(err, err_size, "CUDA error in %s: %s", what, cudaGetErrorString(e));
    return false;
}

static zipmoe_gpu_worker * worker(zipmoe_gpu * gpu, int ith, char * err, size_t err_size) {
    if (ith < 0 || ith >= ZIPMOE_GPU_MAX_THREADS) {
        snprintf(err, err_size, "decoding thread %d is beyond the %d the GPU path supports", ith, ZIPMOE_GPU_MAX_THREADS);
        return nullptr;
    }
    // a graph thread may start on another device than the slots'
    if (!check(cudaSetDevice(gpu->device), "cudaSetDevice", err, err_size)) {
        return nullptr;
    }
    zipmoe_gpu_worker * w = &gpu->workers[ith];
    if (w->ready) {
        return w;
    }
    // [SM plane | exponent plane | compressed E-chunk (phase 2)]
    const size_t bytes = 3 * gpu->max_count + 64;
    if (!check(cudaStreamCreateWithFlags(&w->stream, cudaStreamNonBlocking), "cudaStreamCreate", err, err_size)) {
        return nullptr;
    }
    for (int b = 0; b < 2; b++) {
        // zero-copy: the device buffer is the pinned staging itself, mapped into the GPU's address space
        if (!check(cudaHostAlloc((void **) &w->host[b], bytes, gpu->zero_copy ? cudaHostAllocMapped : 0),
                   "cudaHostAlloc (staging)", err, err_size) ||
            !(gpu->zero_copy ? check(cudaHostGetDevicePointer((void **) &w->dev[b], w->host[b], 0),
                                     "cudaHostGetDevicePointer (staging)", err, err_size)
                             : check(cudaMalloc((void **) &w->dev[b], bytes), "cudaMalloc (staging)", err, err_size)) ||
            !check(cudaEventCreateWithFlags(&w->done[b], cudaEventDisableTiming), "cudaEventCreate", err, err_size)) {
            return nullptr; // what was made is freed by zipmoe_gpu_free
        }
    }
    if (!check(cudaHostAlloc((void **) &w->corrupt, 2 * sizeof(int), cudaHostAllocMapped), "cudaHostAlloc (flags)",
               err, err_size)) {
        return nullptr;
    }
    w->corrupt[0] = w->corrupt[1] = 0;
    w->ready = true;
    return w;
}

extern "C" struct zipmoe_gpu * zipmoe_gpu_new(const void * slot_base, size_t max_count, char * err, size_t err_size) {
    cudaPointerAttributes attr = {};
    if (!check(cudaPointerGetAttributes(&attr, slot_base), "cudaPointerGetAttributes (slots)", err, err_size)) {
        return nullptr;
    }
    if (attr.type != cudaMemoryTypeDevice) {
        snprintf(err, err_size, "the slot memory is not CUDA device memory");
        return nullptr;
    }
    zipmoe_gpu * gpu = new (std::nothrow) zipmoe_gpu();
    if (gpu == nullptr) {
        snprintf(err, err_size, "out of memory for the GPU state");
        return nullptr;
    }
    gpu->device    = attr.device;
    gpu->max_count = max_count > 0 ? max_count : 1;
    int integrated = 0, can_map = 0;
    cudaDeviceGetAttribute(&integrated, cudaDevAttrIntegrated, gpu->device);
    cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, gpu->device);
    gpu->zero_copy = integrated && can_map;
    return gpu;
}

extern "C" void zipmoe_gpu_free(struct zipmoe_gpu * gpu) {
    if (gpu == nullptr) {
        return;
    }
    cudaSetDevice(gpu->device);
    for (zipmoe_gpu_worker & w : gpu->workers) {
        if (w.stream != nullptr) {
            cudaStreamSynchronize(w.stream);
        }
        for (int b = 0; b < 2; b++) {
            if (w.host[b] != nullptr) {
                cudaFreeHost(w.host[b]);
            }
            if (w.dev[b] != nullptr && !gpu->zero_copy) {
                cudaFree(w.dev[b]);
            }
            if (w.done[b] != nullptr) {
                cudaEventDestroy(w.done[b]);
            }
        }
        if (w.stream != nullptr) {
            cudaStreamDestroy(w.stream);
        }
        if (w.corrupt != nullptr) {
            cudaFreeHost(w.corrupt);
        }
    }
    delete gpu;
}

// a ghuf decode from buffer b (finished) found its stream corrupt: says which, and clears the flag
static bool corrupt_decode(zipmoe_gpu_worker * w, int b, char * err, size_t err_size) {
    if (w->corrupt == nullptr || !w->corrupt[b]) {
        return false;
    }
    w->corrupt[b] = 0;
    snprintf(err, err_size, "tensor %d, expert %d, shard %d: its E-chunk (ghuf) is corrupt: decoding it on the GPU "
             "failed", w->tag[b][0], w->tag[b][1], w->tag[b][2]);
    return true;
}

extern "C" uint8_t * zipmoe_gpu_staging(struct zipmoe_gpu * gpu, int ith, char * err, size_t err_size) {
    zipmoe_gpu_worker * w = worker(gpu, ith, err, err_size);
    if (w == nullptr) {
        return nullptr;
    }
    const int b = w->cur;
    if (w->used[b] && !check(cudaEventSynchronize(w->done[b]), "cudaEventSynchronize (staging)", err, err_size)) {
        return nullptr;
    }
    w->used[b] = false;
    return corrupt_decode(w, b, err, err_size) ? nullptr : w->host[b];
}

// staging bytes [off, off + size) of buffer b to its device buffer: a copy, or nothing when the
// device buffer is the staging itself (zero-copy); counted as bytes to the GPU either way
static bool stage_to_device(zipmoe_gpu * gpu, zipmoe_gpu_worker * w, int b, size_t off, size_t size, const char * what,
                            char * err, size_t err_size) {
    return gpu->zero_copy ||
           check(cudaMemcpyAsync(w->dev[b] + off, w->host[b] + off, size, cudaMemcpyHostToDevice, w->stream), what, err,
                 err_size);
}

// the staging buffer just filled is used: its copies are queued, the next call takes the other
static void used(zipmoe_gpu * gpu, zipmoe_gpu_worker * w, size_t h2d) {
    w->used[w->cur] = true;
    w->cur ^= 1;
    w->pending = true;
    gpu->h2d_bytes.fetch_add(h2d, std::memory_order_relaxed);
}

// thread ith's worker, if a shard of count values fits its staging; nullptr with err otherwise
static zipmoe_gpu_worker * worker_for(zipmoe_gpu * gpu, int ith, size_t count, char * err, size_t err_size) {
    if (count > gpu->max_count) {
        snprintf(err, err_size, "a shard of %zu values is larger than the GPU staging's %zu", count, gpu->max_count);
        return nullptr;
    }
    return worker(gpu, ith, err, err_size);
}

// the recovery kernel on the planes in device staging buffer b, into dst; the buffer is then used
static int launch_recovery(zipmoe_gpu * gpu, zipmoe_gpu_worker * w, size_t count, uint16_t * dst, size_t h2d,
                           char * err, size_t err_size) {
    const int b = w->cur;
    zipmoe_recover_kernel<<<(unsigned) zipmoe_grid_blocks(count), ZIPMOE_GRID_BLOCK, 0, w->stream>>>(
        w->dev[b] + count, w->dev[b], count, dst);
    if (!check(cudaGetLastError(), "the recovery kernel's launch", err, err_size) ||
        !check(cudaEventRecord(w->done[b], w->stream), "cudaEventRecord", err, err_size)) {
        return -1;
    }
    used(gpu, w, h2d);
    return 0;
}

extern "C" int zipmoe_gpu_recover(struct zipmoe_gpu * gpu, int ith, size_t count, uint16_t * dst, char * err,
                                  size_t err_size) {
    zipmoe_gpu_worker * w = worker_for(gpu, ith, count, err, err_size);
    if (w == nullptr || count == 0) {
        return w == nullptr ? -1 : 0;
    }
    const int b = w->cur;
    if (!stage_to_device(gpu, w, b, 0, 2 * count, "cudaMemcpyAsync (planes to the GPU)", err, err_size)) {
        return -1;
    }
    return launch_recovery(gpu, w, count, dst, 2 * count, err, err_size);
}

extern "C" int zipmoe_gpu_park(struct zipmoe_gpu * gpu, int ith, size_t count, uint8_t * park, char * err,
                               size_t err_size) {
    zipmoe_gpu_worker * w = worker_for(gpu, ith, count, err, err_size);
    if (w == nullptr) {
        return -1;
    }
    const int b = w->cur;
    if (!check(cudaMemcpyAsync(park, w->host[b] + count, count, cudaMemcpyHostToDevice, w->stream),
               "cudaMemcpyAsync (parked exponents)", err, err_size) ||
        !check(cudaEventRecord(w->done[b], w->stream), "cudaEventRecord", err, err_size) ||
        // another thread's stream may recover it: it must be in place before the shard is marked decoded
        !check(cudaStreamSynchronize(w->stream), "cudaStreamSynchronize (parked exponents)", err, err_size)) {
        return -1;
    }
    used(gpu, w, count);
    return 0;
}

extern "C" int zipmoe_gpu_recover_parked(struct zipmoe_gpu * gpu, int ith, size_t count, const uint8_t * park,
                                         uint16_t * dst, char * err, size_t err_size) {
    zipmoe_gpu_worker * w = worker_for(gpu, ith, count, err, err_size);
    if (w == nullptr || count == 0) {
        return w == nullptr ? -1 : 0;
    }
    const int b = w->cur;
    // the kernel writes over the parked bytes: it reads them from a copy
    if (!check(cudaMemcpyAsync(w->dev[b] + count, park, count, cudaMemcpyDefault, w->stream),
               "cudaMemcpyAsync (parked exponents to staging)", err, err_size) ||
        !stage_to_device(gpu, w, b, 0, count, "cudaMemcpyAsync (SM plane to the GPU)", err, err_size)) {
        return -1;
    }
    return launch_recovery(gpu, w, count, dst, count, err, err_size);
}

extern "C" int zipmoe_gpu_decode(struct zipmoe_gpu * gpu, int ith, const struct zipmoe_ghuf_stream * s,
                                 const uint8_t * chunk, size_t size, size_t count, uint16_t * dst, uint8_t * park,
                                 const int32_t tag[3], char * err, size_t err_size) {
    zipmoe_gpu_worker * w = worker_for(gpu, ith, count, err, err_size);
    if (w == nullptr) {
        return -1;
    }
    if (s->mode != ZIPMOE_GHUF_HUF || s->n != count || size > gpu->max_count + 64) {
        snprintf(err, err_size, "a ghuf E-chunk of %zu bytes for %zu values cannot be decoded on the GPU", size, count);
        return -1;
    }
    const int b = w->cur;
    uint8_t * host_chunk = w->host[b] + 2 * count;
    uint8_t * dev_chunk  = w->dev[b] + 2 * count;
    memcpy(host_chunk, chunk, size);
    if (!stage_to_device(gpu, w, b, 2 * count, size, "cudaMemcpyAsync (E-chunk to the GPU)", err, err_size) ||
        (park == nullptr && !stage_to_device(gpu, w, b, 0, count, "cudaMemcpyAsync (SM plane to the GPU)", err, err_size))) {
        return -1;
    }
    int * flag = nullptr;
    if (!check(cudaHostGetDevicePointer((void **) &flag, w->corrupt + b, 0), "cudaHostGetDevicePointer", err, err_size)) {
        return -1;
    }
    memcpy(w->tag[b], tag, sizeof(w->tag[b]));
    const unsigned blocks = (s->n_seg + ZIPMOE_GRID_BLOCK - 1) / ZIPMOE_GRID_BLOCK;
    zipmoe_ghuf_kernel<<<blocks, ZIPMOE_GRID_BLOCK, 0, w->stream>>>(
        s->code, dev_chunk + (s->offsets - chunk), s->n_seg, dev_chunk + (s->area - chunk), s->area_size, s->n,
        park != nullptr ? park : w->dev[b] + count, flag);
    if (!check(cudaGetLastError(), "the ghuf decoding kernel's launch", err, err_size)) {
        return -1;
    }
    if (park == nullptr) {
        return launch_recovery(gpu, w, count, dst, count + size, err, err_size);
    }
    if (!check(cudaEventRecord(w->done[b], w->stream), "cudaEventRecord", err, err_size) ||
        !check(cudaStreamSynchronize(w->stream), "cudaStreamSynchronize (parked exponents)", err, err_size) ||
        corrupt_decode(w, b, err, err_size)) {
        return -1;
    }
    used(gpu, w, size);
    return 0;
}

extern "C" int zipmoe_gpu_sync(struct zipmoe_gpu * gpu, int ith, char * err, size_t err_size) {
    if (gpu == nullptr || ith < 0 || ith >= ZIPMOE_GPU_MAX_THREADS || !gpu->workers[ith].pending) {
        return 0;
    }
    zipmoe_gpu_worker & w = gpu->workers[ith];
    w.pending = false;
    if (!check(cudaSetDevice(gpu->device), "cudaSetDevice", err, err_size) ||
        !check(cudaStreamSynchronize(w.stream), "cudaStreamSynchronize (recovery)", err, err_size) ||
        corrupt_decode(&w, 0, err, err_size) || corrupt_decode(&w, 1, err, err_size)) {
        return -1;
    }
    return 0;
}

extern "C" uint64_t zipmoe_gpu_h2d_bytes(const struct zipmoe_gpu * gpu) {
    return gpu != nullptr ? gpu->h2d_bytes.load(std::memory_order_relaxed) : 0;
}

extern "C" void zipmoe_gpu_set_h2d_bytes(struct zipmoe_gpu * gpu, uint64_t bytes) {
    if (gpu != nullptr) {
        gpu->h2d_bytes.store(bytes, std::memory_order_relaxed);
    }
}

extern "C" int ggml_zipmoe_cuda_devices(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
