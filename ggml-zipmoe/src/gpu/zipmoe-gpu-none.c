// zipmoe-gpu.h in a build without CUDA: slots can only be host memory.

#include "ggml-zipmoe.h"
#include "gpu/zipmoe-gpu.h"

#include <stdio.h>

struct zipmoe_gpu * zipmoe_gpu_new(const void * slot_base, size_t max_count, char * err, size_t err_size) {
    (void) slot_base;
    (void) max_count;
    snprintf(err, err_size, "slots in GPU memory need a ZipMoE build with CUDA (ZIPMOE_CUDA=ON)");
    return NULL;
}

void zipmoe_gpu_free(struct zipmoe_gpu * gpu) {
    (void) gpu;
}

uint8_t * zipmoe_gpu_staging(struct zipmoe_gpu * gpu, int ith, char * err, size_t err_size) {
    (void) gpu;
    (void) ith;
    snprintf(err, err_size, "built without CUDA");
    return NULL;
}

int zipmoe_gpu_recover(struct zipmoe_gpu * gpu, int ith, size_t count, uint16_t * dst, char * err, size_t err_size) {
    (void) gpu;
    (void) ith;
    (void) count;
    (void) dst;
    snprintf(err, err_size, "built without CUDA");
    return -1;
}

int zipmoe_gpu_park(struct zipmoe_gpu * gpu, int ith, size_t count, uint8_t * park, char * err, size_t err_size) {
    (void) gpu;
    (void) ith;
    (void) count;
    (void) park;
    snprintf(err, err_size, "built without CUDA");
    return -1;
}

int zipmoe_gpu_recover_parked(struct zipmoe_gpu * gpu, int ith, size_t count, const uint8_t * park, uint16_t * dst,
                              char * err, size_t err_size) {
    (void) gpu;
    (void) ith;
    (void) count;
    (void) park;
    (void) dst;
    snprintf(err, err_size, "built without CUDA");
    return -1;
}

int zipmoe_gpu_decode(struct zipmoe_gpu * gpu, int ith, const struct zipmoe_ghuf_stream * s, const uint8_t * chunk,
                      size_t size, size_t count, uint16_t * dst, uint8_t * park, const int32_t tag[3], char * err,
                      size_t err_size) {
    (void) gpu;
    (void) ith;
    (void) s;
    (void) chunk;
    (void) size;
    (void) count;
    (void) dst;
    (void) park;
    (void) tag;
    snprintf(err, err_size, "built without CUDA");
    return -1;
}

int zipmoe_gpu_sync(struct zipmoe_gpu * gpu, int ith, char * err, size_t err_size) {
    (void) gpu;
    (void) ith;
    (void) err;
    (void) err_size;
    return 0;
}

uint64_t zipmoe_gpu_h2d_bytes(const struct zipmoe_gpu * gpu) {
    (void) gpu;
    return 0;
}

void zipmoe_gpu_set_h2d_bytes(struct zipmoe_gpu * gpu, uint64_t bytes) {
    (void) gpu;
    (void) bytes;
}

int ggml_zipmoe_cuda_devices(void) {
    return 0;
}
