// Expert cache, the I/O thread: the staging rings and the reads of a fetch's schedule, in order,
// each chunk checked before its bytes are published; its idle work (the prefetch's reads, which
// zipmoe-prefetch.c registers) when no fetch has any left; a task's chunks in the rings, and their
// buffers freed once its shards are decoded and recovered. The lowest of the cache's files: it
// calls none of the others. The decoding side of the pipeline is zipmoe-fetch.c.

#include "cache/zipmoe-cache-impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// a waiter sleeps after a short spin: the thread it waits for may need its core (three threads
// share two cores here)
void zipmoe_pause_waiting(unsigned spins) {
    if (spins < 1024) {
        ZIPMOE_PAUSE();
    } else {
        const struct timespec pause = { 0, 20000 };
        nanosleep(&pause, NULL);
    }
}

// the fetch's first failure: its status, and a message naming the chunk at fault
void zipmoe_fetch_fail(struct ggml_zipmoe_cache * c, int status, const struct zipmoe_task * t, int chunk, int sys_errno) {
    int ok = GGML_ZIPMOE_OK;
    if (atomic_compare_exchange_strong(&c->status, &ok, status)) {
        char what[768];
        zipmoe_describe_failure(c->file, status, t->tensor, t->expert, chunk, sys_errno, what, sizeof(what));
        snprintf(c->error, sizeof(c->error), "%s: %s", c->file->path, what);
    }
}

// stored E bytes of one expert tensor (its K E-chunks back to back)
uint64_t zipmoe_cache_e_bytes(const struct ggml_zipmoe_cache * c, int tensor, int expert) {
    uint64_t total = 0;
    for (int k = 1; k <= c->file->n_shards; k++) {
        total += zipmoe_file_chunk(c->file, tensor, expert, k)->size;
    }
    return total;
}

// bytes of one E-chunk's region of an E staging buffer: the largest E-chunk, whole blocks (what an
// O_DIRECT read of it transfers); the SM-chunks, far larger, have a ring of their own
size_t zipmoe_cache_e_region_bytes(const struct ggml_zipmoe_cache * c) {
    uint64_t largest = 1;
    for (int l = 0; l < c->layout.n_layer; l++) {
        for (int kind = 0; kind < 3 && zipmoe_layer_served(c, l); kind++) {
            for (int32_t e = 0; e < c->layout.layer_n_expert[l]; e++) {
                for (int k = 1; k <= c->file->n_shards; k++) {
                    const uint64_t size = zipmoe_file_chunk(c->file, c->layout.layer_tensor[l * 3 + kind], e, k)->size;
                    largest = size > largest ? size : largest;
                }
            }
        }
    }
    return (size_t) zipmoe_align_up(largest, GGML_ZIPMOE_CHUNK_ALIGNMENT);
}

// the staging memory, made once (thread 0, before the I/O thread or a worker looks at it)
int zipmoe_cache_ensure_staging(struct ggml_zipmoe_cache * c) {
    if (c->pipe.sm_ring[0].mem != NULL) {
        return GGML_ZIPMOE_OK;
    }
    c->pipe.sm_region = (size_t) zipmoe_align_up(c->file->max_sm_size, GGML_ZIPMOE_CHUNK_ALIGNMENT);
    c->pipe.e_region  = zipmoe_cache_e_region_bytes(c);
    for (int i = 0; i < ZIPMOE_N_STAGING; i++) {
        void * sm = NULL, * e = NULL;
        if (posix_memalign(&sm, GGML_ZIPMOE_CHUNK_ALIGNMENT, c->pipe.sm_region) != 0 ||
            posix_memalign(&e, GGML_ZIPMOE_CHUNK_ALIGNMENT, (size_t) c->file->n_shards * c->pipe.e_region) != 0) {
            free(sm);
            snprintf(c->error, sizeof(c->error), "%s: out of memory for staging buffers", c->file->path);
            return GGML_ZIPMOE_ERR_NOMEM;
        }
        c->pipe.sm_ring[i].mem = (uint8_t *) sm;
        c->pipe.e_ring[i].mem  = (uint8_t *) e;
        atomic_store(&c->pipe.sm_ring[i].state, STAGE_FREE);
        atomic_store(&c->pipe.e_ring[i].state, STAGE_FREE);
    }
    return GGML_ZIPMOE_OK;
}

// I/O thread: a free buffer of a ring, or -1 when the fetch failed meanwhile
static int acquire_buffer(struct ggml_zipmoe_cache * c, struct zipmoe_staging * ring) {
    for (unsigned spins = 0;; spins++) {
        for (int i = 0; i < ZIPMOE_N_STAGING; i++) {
            int expected = STAGE_FREE;
            if (atomic_compare_exchange_strong(&ring[i].state, &expected, STAGE_BUSY)) {
                return i;
            }
        }
        if (atomic_load(&c->status) != GGML_ZIPMOE_OK) {
            return -1;
        }
        zipmoe_pause_waiting(spins);
    }
}

// I/O thread: read and check chunks first..last (0: the SM-chunk, 1..K: the E-chunks) of an expert
// tensor into mem (region bytes per chunk). A tensor's E-chunks are stored next to each other (each
// 4096-aligned: docs/FORMAT.md), so one read of their span replaces K small ones (then *base is the
// file offset at mem, else UINT64_MAX); chunks placed otherwise are read one by one. Alg. 1's model
// releases each shard as its own E-chunk arrives; K reads that did so measured 5-10% slower per
// token on the bench model (the latency of each O_DIRECT read outweighed the earlier start of
// decoding), so a task's shards are released together, when its span is in. With check, each
// chunk's checksum is checked here (else by its user: enum zipmoe_check). On failure *bad is the
// chunk at fault.
int zipmoe_read_chunks(struct ggml_zipmoe_cache * c, int32_t tensor, int32_t expert, int first, int last, uint8_t * mem,
                       size_t region, int check, uint64_t * base, int * bad, int * sys_errno) {
    const struct ggml_zipmoe_file * f = c->file;
    uint64_t lo = UINT64_MAX, hi = 0, stored = 0;
    int packed = 1;
    for (int k = first; k <= last; k++) {
        const struct zipmoe_chunk * ch = zipmoe_file_chunk(f, tensor, expert, k);
        packed = packed && (k == first || ch->offset == zipmoe_align_up(hi, GGML_ZIPMOE_CHUNK_ALIGNMENT));
        lo = ch->offset < lo ? ch->offset : lo;
        hi = ch->offset + ch->size > hi ? ch->offset + ch->size : hi;
        stored += ch->size;
    }
    const size_t capacity = region * (size_t) (last - first + 1);
    const uint64_t t0 = zipmoe_now_ns();
    int status = GGML_ZIPMOE_OK;
    *bad = first;
    *sys_errno = 0;
    *base = UINT64_MAX;
    if (packed && lo % GGML_ZIPMOE_CHUNK_ALIGNMENT == 0 && zipmoe_align_up(hi - lo, GGML_ZIPMOE_CHUNK_ALIGNMENT) <= capacity) {
        const struct zipmoe_chunk span = { lo, hi - lo, 0, 0 };
        status = zipmoe_read_chunk_unchecked(f, &span, mem, capacity, sys_errno);
        *base = lo;
    } else {
        for (int k = first; k <= last && status == GGML_ZIPMOE_OK; k++) {
            *bad = k;
            status = zipmoe_read_chunk_unchecked(f, zipmoe_file_chunk(f, tensor, expert, k),
                                                 mem + (size_t) (k - first) * region, region, sys_errno);
        }
    }
    atomic_fetch_add(&c->stats.io_ns, zipmoe_now_ns() - t0);
    if (status != GGML_ZIPMOE_OK) {
        return status;
    }
    atomic_fetch_add(&c->stats.bytes_read, stored);
    for (int k = first; k <= last && check; k++) {
        const struct zipmoe_chunk * ch = zipmoe_file_chunk(f, tensor, expert, k);
        const uint8_t * p = *base != UINT64_MAX ? mem + (ch->offset - *base) : mem + (size_t) (k - first) * region;
        if (ggml_zipmoe_checksum(p, ch->size) != ch->checksum) {
            *bad = k;
            return GGML_ZIPMOE_ERR_CHECKSUM;
        }
    }
    return GGML_ZIPMOE_OK;
}

static int read_chunks(struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int first, int last,
                       struct zipmoe_staging * s, size_t region) {
    int bad = first, sys_errno = 0;
    const int status = zipmoe_read_chunks(c, t->tensor, t->expert, first, last, s->mem, region, 0, &s->base, &bad,
                                          &sys_errno);
    if (status != GGML_ZIPMOE_OK) {
        zipmoe_fetch_fail(c, status, t, bad, sys_errno);
    }
    return status;
}

static atomic_uint g_sm_read_delay_us; // ggml_zipmoe_set_sm_read_delay_us

void ggml_zipmoe_set_sm_read_delay_us(unsigned us) {
    atomic_store(&g_sm_read_delay_us, us);
}

// I/O thread: the schedule's reads in order. A task's E-chunks are read together at the first of
// them (the scheduler lists them back to back), so its shards become ready together.
static void read_all(struct ggml_zipmoe_cache * c) {
    const int K = c->file->n_shards;
    for (int j = 0; j < c->plan.n_io && atomic_load(&c->status) == GGML_ZIPMOE_OK; j++) {
        struct zipmoe_task * t = &c->plan.tasks[c->plan.io[j].task];
        const int sm = c->plan.io[j].chunk == 0;
        if (!sm && atomic_load(&t->e_buf) >= 0) {
            continue;
        }
        const unsigned delay_us = sm ? atomic_load(&g_sm_read_delay_us) : 0;
        if (delay_us > 0) {
            const struct timespec pause = { (time_t) (delay_us / 1000000), (long) (delay_us % 1000000) * 1000 };
            nanosleep(&pause, NULL);
        }
        struct zipmoe_staging * ring = sm ? c->pipe.sm_ring : c->pipe.e_ring;
        const int b = acquire_buffer(c, ring);
        if (b < 0) {
            break;
        }
        if (read_chunks(c, t, sm ? 0 : 1, sm ? 0 : K, &ring[b], sm ? c->pipe.sm_region : c->pipe.e_region) != GGML_ZIPMOE_OK) {
            atomic_store(&ring[b].state, STAGE_FREE);
            break;
        }
        atomic_store(sm ? &t->sm_buf : &t->e_buf, b); // publishes the buffer's bytes
    }
}

// the I/O thread: a fetch's reads first, its idle work (a prefetch's reads) when no fetch has reads left
static void * io_thread_main(void * arg) {
    struct ggml_zipmoe_cache * c = (struct ggml_zipmoe_cache *) arg;
    uint64_t done = 0;
    for (;;) {
        pthread_mutex_lock(&c->pipe.io_lock);
        while (!c->pipe.io_quit && atomic_load(&c->pipe.io_job) == done &&
               !(c->pipe.has_idle_work != NULL && c->pipe.has_idle_work(c))) {
            pthread_cond_wait(&c->pipe.io_wake, &c->pipe.io_lock);
        }
        const int      quit = c->pipe.io_quit;
        const uint64_t job  = atomic_load(&c->pipe.io_job);
        if (quit) {
            pthread_mutex_unlock(&c->pipe.io_lock);
            return NULL;
        }
        if (job == done) {
            c->pipe.idle_work(c);
            pthread_mutex_unlock(&c->pipe.io_lock);
            continue;
        }
        pthread_mutex_unlock(&c->pipe.io_lock);
        // the task list is fixed until end has seen io_done reach this job
        read_all(c);
        done = job;
        atomic_store(&c->pipe.io_done, done);
    }
}

int zipmoe_cache_start_io(struct ggml_zipmoe_cache * c) {
    if (c->pipe.io_started) {
        return GGML_ZIPMOE_OK;
    }
    if (pthread_create(&c->pipe.io_thread, NULL, io_thread_main, c) != 0) {
        snprintf(c->error, sizeof(c->error), "%s: cannot start the cache's I/O thread", c->file->path);
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    c->pipe.io_started = 1;
    return GGML_ZIPMOE_OK;
}

// the fetch's first failure, naming the tensor, expert and shard (k = 0: the whole expert)
void zipmoe_fetch_fail_why(struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int k, const char * what,
                           const char * why) {
    int ok = GGML_ZIPMOE_OK;
    if (atomic_compare_exchange_strong(&c->status, &ok, GGML_ZIPMOE_ERR_ARG)) {
        char shard[32] = "";
        if (k > 0) {
            snprintf(shard, sizeof(shard), ", shard %d", k);
        }
        snprintf(c->error, sizeof(c->error), "%s: tensor %s, expert %d%s: %s: %s", c->file->path,
                 c->file->tensors[t->tensor].name, t->expert, shard, what, why);
    }
}

// E-chunk k (1..K) of a task, read or kept
const uint8_t * zipmoe_task_e_chunk(const struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int k) {
    if (t->e_src != NULL) {
        const uint8_t * p = t->e_src;
        for (int j = 1; j < k; j++) {
            p += zipmoe_file_chunk(c->file, t->tensor, t->expert, j)->size;
        }
        return p;
    }
    const struct zipmoe_staging * s = &c->pipe.e_ring[atomic_load(&t->e_buf)];
    if (s->base != UINT64_MAX) {
        return s->mem + (zipmoe_file_chunk(c->file, t->tensor, t->expert, k)->offset - s->base);
    }
    return s->mem + (size_t) (k - 1) * c->pipe.e_region;
}

const uint8_t * zipmoe_task_sm(const struct ggml_zipmoe_cache * c, const struct zipmoe_task * t) {
    return t->sm_src != NULL ? t->sm_src : c->pipe.sm_ring[atomic_load(&t->sm_buf)].mem;
}

// chunk k's bytes (at p) against the file's checksum; a mismatch fails the fetch, naming the chunk
static int check_chunk(struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int k, const uint8_t * p, uint64_t * ns) {
    const struct zipmoe_chunk * ch = zipmoe_file_chunk(c->file, t->tensor, t->expert, k);
    const uint64_t t0 = zipmoe_now_ns();
    const int ok = ggml_zipmoe_checksum(p, ch->size) == ch->checksum;
    *ns += zipmoe_now_ns() - t0;
    if (!ok) {
        zipmoe_fetch_fail(c, GGML_ZIPMOE_ERR_CHECKSUM, t, k, 0);
    }
    return ok;
}

int zipmoe_sm_checked(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, uint64_t * ns) {
    if (t->sm_src != NULL) {
        return 1;
    }
    if (atomic_load(&t->sm_buf) < 0) {
        return 0;
    }
    if (atomic_load(&t->sm_check) == CHECK_DONE) {
        return 1;
    }
    int todo = CHECK_TODO;
    if (!atomic_compare_exchange_strong(&t->sm_check, &todo, CHECK_CLAIMED)) {
        return 0; // another thread checks it
    }
    if (!check_chunk(c, t, 0, zipmoe_task_sm(c, t), ns)) {
        return 0; // left claimed: the fetch has failed
    }
    atomic_store(&t->sm_check, CHECK_DONE); // publishes the check
    return 1;
}

int zipmoe_e_chunk_checked(struct ggml_zipmoe_cache * c, const struct zipmoe_task * t, int k, uint64_t * ns) {
    return t->e_src != NULL || check_chunk(c, t, k, zipmoe_task_e_chunk(c, t, k), ns);
}

// a shard of t was recovered: when the tensor is full, keep its SM-chunk if dispatched to C or S
// and free its staging buffer
void zipmoe_shard_recovered(struct ggml_zipmoe_cache * c, struct zipmoe_task * t) {
    if (atomic_fetch_add(&t->n_recovered, 1) == c->file->n_shards - 1) {
        if (t->sm_dst != NULL) {
            memcpy(t->sm_dst, zipmoe_task_sm(c, t), c->file->tensors[t->tensor].sm_size);
        }
        if (t->sm_src == NULL) {
            atomic_store(&c->pipe.sm_ring[atomic_load(&t->sm_buf)].state, STAGE_FREE);
        }
    }
    atomic_fetch_add(&c->pipe.ops_done, 1);
}

// a shard of t was decoded: when every E-chunk is, keep them if dispatched to C or E and free
// their staging buffer
void zipmoe_shard_decoded(struct ggml_zipmoe_cache * c, struct zipmoe_task * t) {
    const int K = c->file->n_shards;
    if (atomic_fetch_add(&t->n_decoded, 1) == K - 1) {
        if (t->e_dst != NULL) {
            uint8_t * dst = t->e_dst;
            for (int j = 1; j <= K; j++) {
                const uint64_t size = zipmoe_file_chunk(c->file, t->tensor, t->expert, j)->size;
                memcpy(dst, zipmoe_task_e_chunk(c, t, j), size);
                dst += size;
            }
        }
        if (t->e_src == NULL) {
            atomic_store(&c->pipe.e_ring[atomic_load(&t->e_buf)].state, STAGE_FREE);
        }
    }
}
