// Expert cache, fetch pipeline: shards into slots outside host memory.
//
// CUDA slots (c->gpu, zipmoe-gpu.h): a shard's exponents are decoded into the thread's pinned staging
// (codec ghuf: on the GPU) and recovered there by a kernel. A caller's device (slot_write, any other
// ggml backend: an rpc-server's, Vulkan, Metal): the shard is decoded and recovered into the thread's
// host staging, the same routine as host slots, and handed to slot_write. Either way a shard whose
// SM-chunk is not read yet is parked (its exponents kept: in the slot's device bytes for CUDA, in host
// memory for a caller's device), because the staging rings must not wait on the SM reads (the I/O
// thread frees a ring buffer only once its shards are decoded).

#include "cache/zipmoe-cache-impl.h"
#include "codec/zipmoe-ghuf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int zipmoe_device_init(struct ggml_zipmoe_cache * c, const struct ggml_zipmoe_cache_params * p, char * msg,
                       size_t msg_size) {
    // staging for the largest shard of any served tensor
    for (int t = 0; t < c->file->n_tensors; t++) {
        for (int k = 0; k < c->file->n_shards; k++) {
            uint64_t first, count;
            zipmoe_shard_range(c->file->tensors[t].n, c->file->n_shards, k, &first, &count);
            c->slots.max_shard = count > c->slots.max_shard ? count : c->slots.max_shard;
        }
    }
    if (p->slot_memory == GGML_ZIPMOE_SLOTS_DEVICE) {
        c->slots.write = p->slot_write;
        c->slots.sync  = p->slot_sync;
    } else if (p->slot_memory == GGML_ZIPMOE_SLOTS_CUDA) {
        c->gpu = zipmoe_gpu_new(c->slots.data[0], (size_t) (c->slots.max_shard > 0 ? c->slots.max_shard : 1), msg,
                                msg_size);
        return c->gpu != NULL ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_ARG;
    }
    return GGML_ZIPMOE_OK;
}

static void fail_gpu(struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int k, const char * why) {
    zipmoe_fetch_fail_why(c, t, k, "recovery on the GPU failed", why);
}

static void fail_nomem(struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int k) {
    int ok = GGML_ZIPMOE_OK;
    if (atomic_compare_exchange_strong(&c->status, &ok, GGML_ZIPMOE_ERR_NOMEM)) {
        snprintf(c->error, sizeof(c->error), "%s: tensor %s, expert %d, shard %d: out of host memory for its "
                 "staging", c->file->path, c->file->tensors[t->tensor].name, t->expert, k);
    }
}

// CUDA: shard k (1..K) decoded into the thread's pinned staging, and with its SM plane beside it
// copied to the GPU and recovered there; if the SM-chunk is not read yet, the exponents are parked
// in the slot's device bytes instead
static int gpu_shard(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, struct zipmoe_worker * w, int ith,
                     uint64_t * decode_ns, uint64_t * recover_ns) {
    const struct zipmoe_chunk * ch = zipmoe_file_chunk(c->file, t->tensor, t->expert, k);
    uint64_t first, count;
    zipmoe_shard_range(c->file->tensors[t->tensor].n, c->file->n_shards, k - 1, &first, &count);
    char why[512];
    uint8_t * stage = zipmoe_gpu_staging(c->gpu, ith, why, sizeof(why));
    if (stage == NULL) {
        fail_gpu(c, t, k, why);
        return 0;
    }
    uint16_t * dst = zipmoe_slot_tensor(c, t) + first;
    const uint8_t * chunk = zipmoe_task_e_chunk(c, t, k);
    struct zipmoe_ghuf_stream gs;
    if (ch->codec == GGML_ZIPMOE_CODEC_GHUF && zipmoe_ghuf_parse(chunk, ch->size, &gs) == 0 &&
        gs.mode == ZIPMOE_GHUF_HUF && gs.n == count) {
        // phase 2: the compressed E-chunk crosses to the GPU and is decoded there (a chunk that does not
        // parse is left to the CPU's decoder below, which names it as corrupt)
        const int parked = !zipmoe_sm_checked(c, t, recover_ns);
        const int32_t tag[3] = { t->tensor, t->expert, k };
        const uint64_t t0 = zipmoe_now_ns();
        if (!parked) {
            memcpy(stage, zipmoe_task_sm(c, t) + first, count);
        }
        if (zipmoe_gpu_decode(c->gpu, ith, &gs, chunk, ch->size, count, dst, parked ? (uint8_t *) dst + count : NULL,
                              tag, why, sizeof(why)) != 0) {
            fail_gpu(c, t, k, why);
            return 0;
        }
        *recover_ns += zipmoe_now_ns() - t0;
        zipmoe_shard_decoded(c, t); // its bytes are in the pinned staging now
        if (parked) {
            return 2;
        }
        zipmoe_shard_recovered(c, t);
        return 1;
    }
    const uint64_t t0 = zipmoe_now_ns();
    const int status = ggml_zipmoe_decompress(w->decoder, ch->codec, chunk, ch->size, stage + count, count);
    const uint64_t t1 = zipmoe_now_ns();
    *decode_ns += t1 - t0;
    if (status != GGML_ZIPMOE_OK) {
        zipmoe_fetch_fail(c, status, t, k, 0);
        return 0;
    }
    zipmoe_shard_decoded(c, t);
    if (!zipmoe_sm_checked(c, t, recover_ns)) {
        if (zipmoe_gpu_park(c->gpu, ith, count, (uint8_t *) dst + count, why, sizeof(why)) != 0) {
            fail_gpu(c, t, k, why);
            return 0;
        }
        *recover_ns += zipmoe_now_ns() - t1;
        return 2;
    }
    memcpy(stage, zipmoe_task_sm(c, t) + first, count);
    if (zipmoe_gpu_recover(c->gpu, ith, count, dst, why, sizeof(why)) != 0) {
        fail_gpu(c, t, k, why);
        return 0;
    }
    *recover_ns += zipmoe_now_ns() - t1;
    zipmoe_shard_recovered(c, t);
    return 1;
}

static int gpu_recover_parked(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, int ith,
                              uint64_t * recover_ns) {
    uint64_t first, count;
    zipmoe_shard_range(c->file->tensors[t->tensor].n, c->file->n_shards, k - 1, &first, &count);
    char why[512];
    const uint64_t t0 = zipmoe_now_ns();
    uint8_t * stage = zipmoe_gpu_staging(c->gpu, ith, why, sizeof(why));
    uint16_t * dst = zipmoe_slot_tensor(c, t) + first;
    if (stage != NULL) {
        memcpy(stage, zipmoe_task_sm(c, t) + first, count);
    }
    if (stage == NULL || zipmoe_gpu_recover_parked(c->gpu, ith, count, (const uint8_t *) dst + count, dst, why,
                                                   sizeof(why)) != 0) {
        fail_gpu(c, t, k, why);
        return 0;
    }
    *recover_ns += zipmoe_now_ns() - t0;
    zipmoe_shard_recovered(c, t);
    return 1;
}

int zipmoe_device_write(struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, size_t offset, const void * data,
                        size_t size) {
    char why[512] = "";
    const uint64_t t0 = zipmoe_now_ns();
    if (c->slots.write(c->slots.fill_data, t->kind, t->tensor, t->slot, offset, data, size, why, sizeof(why)) != 0) {
        zipmoe_fetch_fail_why(c, t, 0, "writing its slot failed", why[0] != '\0' ? why : "no reason given");
        return 0;
    }
    atomic_fetch_add(&c->stats.device_ns, zipmoe_now_ns() - t0);
    atomic_fetch_add(&c->stats.slot_write_bytes, size);
    return 1;
}

// the thread's host staging for one shard's BF16 values, made on first use
static uint16_t * device_staging(struct ggml_zipmoe_cache * c, struct zipmoe_worker * w) {
    if (w->staging == NULL) {
        w->staging = (uint16_t *) malloc(2 * (size_t) (c->slots.max_shard > 0 ? c->slots.max_shard : 1));
    }
    return w->staging;
}

// shard k's values in the staging (exponents at bytes [count, 2 * count), recovered in place, as a
// host slot's shard is) written to the slot
static int device_recover(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, const uint8_t * exponents,
                          uint16_t * stage) {
    uint64_t first, count;
    zipmoe_shard_range(c->file->tensors[t->tensor].n, c->file->n_shards, k - 1, &first, &count);
    ggml_zipmoe_recover_bf16(exponents, zipmoe_task_sm(c, t) + first, count, stage);
    if (!zipmoe_device_write(c, t, 2 * first, stage, 2 * count)) {
        return 0;
    }
    zipmoe_shard_recovered(c, t);
    return 1;
}

// a caller's device: decoded into the staging, or into parked host memory until the SM-chunk is read
static int remote_shard(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, int op, struct zipmoe_worker * w,
                        uint64_t * decode_ns, uint64_t * recover_ns) {
    const struct zipmoe_chunk * ch = zipmoe_file_chunk(c->file, t->tensor, t->expert, k);
    uint64_t first, count;
    zipmoe_shard_range(c->file->tensors[t->tensor].n, c->file->n_shards, k - 1, &first, &count);
    uint16_t * stage = device_staging(c, w);
    const int parked = !zipmoe_sm_checked(c, t, recover_ns);
    uint8_t * exponents = parked ? (uint8_t *) malloc(count > 0 ? count : 1) : (uint8_t *) stage + count;
    if (stage == NULL || exponents == NULL) {
        fail_nomem(c, t, k);
        return 0;
    }
    const uint64_t t0 = zipmoe_now_ns();
    const int status = ggml_zipmoe_decompress(w->decoder, ch->codec, zipmoe_task_e_chunk(c, t, k), ch->size, exponents,
                                              count);
    const uint64_t t1 = zipmoe_now_ns();
    *decode_ns += t1 - t0;
    if (status != GGML_ZIPMOE_OK) {
        if (parked) {
            free(exponents);
        }
        zipmoe_fetch_fail(c, status, t, k, 0);
        return 0;
    }
    zipmoe_shard_decoded(c, t);
    if (parked) {
        c->pipe.parked[op] = exponents;
        return 2;
    }
    const int went = device_recover(c, t, k, exponents, stage);
    *recover_ns += zipmoe_now_ns() - t1;
    return went;
}

int zipmoe_device_shard(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, int op, struct zipmoe_worker * w,
                        int ith, uint64_t * decode_ns, uint64_t * recover_ns) {
    if (c->gpu == NULL) {
        return remote_shard(c, t, k, op, w, decode_ns, recover_ns); // zipmoe_device_write times the writes
    }
    // CUDA: the copies and kernels, the CPU's decoding aside (a CPU slot's would decode as well)
    const uint64_t t0 = zipmoe_now_ns(), decoded0 = *decode_ns;
    const int went = gpu_shard(c, t, k, w, ith, decode_ns, recover_ns);
    const uint64_t spent = zipmoe_now_ns() - t0, decoding = *decode_ns - decoded0;
    atomic_fetch_add(&c->stats.device_ns, spent > decoding ? spent - decoding : 0);
    return went;
}

int zipmoe_device_recover_parked(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, int op,
                                 struct zipmoe_worker * w, int ith, uint64_t * recover_ns) {
    if (c->gpu != NULL) {
        const uint64_t t0 = zipmoe_now_ns();
        const int went = gpu_recover_parked(c, t, k, ith, recover_ns);
        atomic_fetch_add(&c->stats.device_ns, zipmoe_now_ns() - t0);
        return went;
    }
    uint16_t * stage = device_staging(c, w);
    if (stage == NULL) {
        fail_nomem(c, t, k);
        return 0;
    }
    const uint64_t t0 = zipmoe_now_ns();
    uint8_t * exponents = c->pipe.parked[op];
    c->pipe.parked[op] = NULL;
    const int went = device_recover(c, t, k, exponents, stage);
    free(exponents);
    *recover_ns += zipmoe_now_ns() - t0;
    return went;
}

void zipmoe_device_sync(struct ggml_zipmoe_cache * c, int ith) {
    char why[512] = "";
    int failed = 0;
    const uint64_t t0 = zipmoe_now_ns();
    if (c->gpu != NULL) {
        failed = zipmoe_gpu_sync(c->gpu, ith, why, sizeof(why)) != 0;
    } else if (c->slots.sync != NULL) {
        failed = c->slots.sync(c->slots.fill_data, why, sizeof(why)) != 0;
    }
    if (c->gpu != NULL || c->slots.sync != NULL) {
        atomic_fetch_add(&c->stats.device_ns, zipmoe_now_ns() - t0);
    }
    int ok = GGML_ZIPMOE_OK;
    if (failed && atomic_compare_exchange_strong(&c->status, &ok, GGML_ZIPMOE_ERR_ARG)) {
        snprintf(c->error, sizeof(c->error), "%s: %s failed: %s", c->file->path,
                 c->gpu != NULL ? "recovery on the GPU" : "writing the slots", why[0] != '\0' ? why : "no reason given");
    }
}

void zipmoe_device_forget_parked(struct ggml_zipmoe_cache * c) {
    for (int j = 0; j < c->plan.n_dec && c->slots.write != NULL; j++) {
        free(c->pipe.parked[j]);
        c->pipe.parked[j] = NULL;
    }
}
