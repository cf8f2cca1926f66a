// Expert slots in CUDA device memory (internal; zipmoe-cuda.cu, or zipmoe-gpu-none.c in a build
// without CUDA). The fetch pipeline (zipmoe-fetch-device.c) still reads on the CPU, and decodes exponents
// there for every codec but ghuf (decoded on the GPU from its stored E-chunk); a decoding thread puts a shard's SM plane and decoded exponent plane side by side in its pinned
// staging buffer, and zipmoe_gpu_recover copies both to the device asynchronously on the thread's
// own stream and interleaves them into BF16 in the slot with the recovery kernel. Each thread has
// two staging buffers used in turn: it decodes the next shard while the last one is copied.

#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct zipmoe_gpu;

// slots at device address slot_base (any pointer into the slot memory: its device is found from
// it); shards of at most max_count values. NULL with a message in err when CUDA is unavailable.
struct zipmoe_gpu * zipmoe_gpu_new(const void * slot_base, size_t max_count, char * err, size_t err_size);
void                zipmoe_gpu_free(struct zipmoe_gpu * gpu);

// thread ith's next staging buffer, once the copy last made from it is done: the SM plane goes
// in bytes [0, count), the exponent plane in [count, 2 * count). NULL on a CUDA failure (err).
uint8_t * zipmoe_gpu_staging(struct zipmoe_gpu * gpu, int ith, char * err, size_t err_size);

// copies the buffer zipmoe_gpu_staging last gave ith to the device and recovers its count values
// into dst (device memory), asynchronously. Returns 0, or -1 with a message in err.
int zipmoe_gpu_recover(struct zipmoe_gpu * gpu, int ith, size_t count, uint16_t * dst, char * err, size_t err_size);

// a shard whose SM-chunk is not read yet: its exponent plane (staging bytes [count, 2 * count)) is
// parked in device memory at park (the second half of the shard's own slot bytes, as the CPU path
// decodes there) and waited for, so that any thread can recover it later: the staging rings must
// not wait on the SM reads (the I/O thread frees a ring buffer only once its shards are decoded).
int zipmoe_gpu_park(struct zipmoe_gpu * gpu, int ith, size_t count, uint8_t * park, char * err, size_t err_size);

// recovers a parked shard into dst: the SM plane in staging bytes [0, count), the exponents at park
int zipmoe_gpu_recover_parked(struct zipmoe_gpu * gpu, int ith, size_t count, const uint8_t * park, uint16_t * dst,
                              char * err, size_t err_size);

// phase 2: an E-chunk in the GPU layout (codec ghuf, huffman mode; parsed into s from its size
// bytes at chunk) is copied to the GPU compressed and decoded there, one thread per segment; its
// exponents are then recovered into dst with the SM plane in staging bytes [0, count), or, with
// park != NULL, left at park and waited for (as zipmoe_gpu_park). A corrupt stream is reported by
// zipmoe_gpu_staging or zipmoe_gpu_sync, naming tag (the caller's tensor, expert, shard).
struct zipmoe_ghuf_stream;
int zipmoe_gpu_decode(struct zipmoe_gpu * gpu, int ith, const struct zipmoe_ghuf_stream * s, const uint8_t * chunk,
                      size_t size, size_t count, uint16_t * dst, uint8_t * park, const int32_t tag[3], char * err,
                      size_t err_size);

// waits until every recovery ith started is in the slots. Returns 0, or -1 with a message in err.
int zipmoe_gpu_sync(struct zipmoe_gpu * gpu, int ith, char * err, size_t err_size);

// bytes copied host to device so far, and setting it (statistics reset, or kept across a preload)
uint64_t zipmoe_gpu_h2d_bytes(const struct zipmoe_gpu * gpu);
void     zipmoe_gpu_set_h2d_bytes(struct zipmoe_gpu * gpu, uint64_t bytes);

#ifdef __cplusplus
}
#endif
