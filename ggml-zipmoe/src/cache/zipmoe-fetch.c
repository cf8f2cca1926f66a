// Expert cache, fetch pipeline: the tasks of a planned pass made full in their slots.
//
// Begin (thread 0, under the lock) plans the pass (zipmoe-residency.c), orders the reads and
// decompressions with the cache-affinity scheduler (Algorithm 1, ggml_zipmoe_schedule, on the
// cost model's rates) and hands the reads to the cache's I/O thread, which reads and checks the
// chunks into two staging rings (SM-chunks; a task's K E-chunks, one span read when they lie
// back to back). End (every graph thread) is work-conserving: a thread takes the first
// decompression of the priority list whose E-chunks are in memory and runs the library's one
// decode + recover routine (zipmoe-codec.c) on the slot's own bytes; recovery waits for the
// tensor's SM-chunk if it is not in memory yet. Thread 0 waits for the I/O thread and unlocks.

#define _GNU_SOURCE // sched_yield on older libcs

#include "cache/zipmoe-cache-impl.h"
#include "codec/zipmoe-ghuf.h"

#include <sched.h>
#include <stdio.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <string.h>

static void barrier(struct ggml_zipmoe_cache * c, int nth) {
    if (nth <= 1) {
        return;
    }
    // the generation cannot move before this thread arrives, so reading it first is safe
    const int gen = atomic_load(&c->pipe.barrier_generation);
    if (atomic_fetch_add(&c->pipe.barrier_count, 1) == nth - 1) {
        atomic_store(&c->pipe.barrier_count, 0);
        atomic_fetch_add(&c->pipe.barrier_generation, 1);
        return;
    }
    for (unsigned spins = 0; atomic_load(&c->pipe.barrier_generation) == gen; spins++) {
        if (spins < 2048) {
            ZIPMOE_PAUSE();
        } else {
            sched_yield(); // a waiting thread must not take the core a reading/decoding thread needs
        }
    }
}

static int reads_sm(int32_t state) {
    return state == GGML_ZIPMOE_STATE_M || state == GGML_ZIPMOE_STATE_E;
}

static int reads_e(int32_t state) {
    return state == GGML_ZIPMOE_STATE_M || state == GGML_ZIPMOE_STATE_S;
}

// the order of the reads and decompressions: Algorithm 1 (ggml_zipmoe_schedule) on the cost model
// of this machine; the tasks in plan order if the scheduler cannot run
void zipmoe_cache_schedule_tasks(struct ggml_zipmoe_cache * c) {
    const int32_t K = c->file->n_shards;
    const int32_t L = c->plan.sched_threads;
    for (int i = 0; i < c->plan.n_tasks; i++) {
        const struct zipmoe_task * t = &c->plan.tasks[i];
        c->plan.sched_tasks[i].expert = t->expert;
        c->plan.sched_tasks[i].state  = t->state;
        // an expert's products read its three tensors once per token that chose it
        c->plan.sched_tasks[i].p = (double) c->plan.tokens[t->expert] * (double) c->layout.expert_bytes / c->plan.rate_compute;
    }
    const double n0 = (double) c->layout.kind_n[0];
    const struct ggml_zipmoe_sched_params sp = {
        .u = n0 / c->plan.rate_read, .rho = c->layout.rho, .c = 2.0 * n0 / (double) K / c->plan.rate_decode,
        .n_shards = K, .n_threads = L,
    };
    const size_t need = GGML_ZIPMOE_SCHED_WORK_SIZE(c->plan.n_tasks, K, L);
    if (need > c->plan.sched_work_size) {
        free(c->plan.sched_work);
        c->plan.sched_work = malloc(need);
        c->plan.sched_work_size = c->plan.sched_work != NULL ? need : 0;
    }
    struct ggml_zipmoe_sched_result r = { c->plan.io, c->plan.dec, NULL, NULL, NULL, 0, 0, 0, 0 };
    if (c->plan.sched_work != NULL &&
        ggml_zipmoe_schedule(c->plan.sched_tasks, c->plan.n_tasks, &sp, c->plan.sched_work, c->plan.sched_work_size, &r) == GGML_ZIPMOE_OK) {
        c->plan.n_io  = r.n_io;
        c->plan.n_dec = r.n_dec;
        return;
    }
    c->plan.n_io = c->plan.n_dec = 0;
    for (int i = 0; i < c->plan.n_tasks; i++) {
        for (int k = 1; k <= K && reads_e(c->plan.tasks[i].state); k++) {
            c->plan.io[c->plan.n_io++] = (struct ggml_zipmoe_sched_op) { i, k };
        }
        if (reads_sm(c->plan.tasks[i].state)) {
            c->plan.io[c->plan.n_io++] = (struct ggml_zipmoe_sched_op) { i, 0 };
        }
        for (int k = 1; k <= K; k++) {
            c->plan.dec[c->plan.n_dec++] = (struct ggml_zipmoe_sched_op) { i, k };
        }
    }
}

static struct zipmoe_worker * worker_of(struct ggml_zipmoe_cache * c, int ith) {
    struct zipmoe_worker * w = &c->pipe.workers[ith];
    if (w->decoder == NULL) {
        w->decoder = ggml_zipmoe_decoder_new();
    }
    return w->decoder != NULL ? w : NULL;
}

static int e_ready(const struct zipmoe_task * t) {
    return t->e_src != NULL || atomic_load(&t->e_buf) >= 0;
}

// a raw (non-BF16) expert's share k (1..K) of its bytes, in the SM-chunk's place, into its slot: copied
// (through slot_write for a caller's device), or the whole expert through the caller's slot_fill at
// k = 1 (a backend lays it out its own way)
static int fill_raw(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k) {
    const int      K    = c->file->n_shards;
    const uint64_t size = c->file->tensors[t->tensor].sm_size;
    const uint64_t lo = size * (uint64_t) (k - 1) / (uint64_t) K, hi = size * (uint64_t) k / (uint64_t) K;
    if (!t->on_cpu && c->slots.fill == NULL && c->slots.write != NULL) {
        return zipmoe_device_write(c, t, lo, zipmoe_task_sm(c, t) + lo, hi - lo);
    }
    if (t->on_cpu || c->slots.fill == NULL) { // a CPU slot is plain host memory
        memcpy((uint8_t *) zipmoe_slot_tensor(c, t) + lo, zipmoe_task_sm(c, t) + lo, hi - lo);
        return 1;
    }
    char why[512] = "";
    if (k == 1 && c->slots.fill(c->slots.fill_data, t->kind, t->tensor, t->slot, zipmoe_task_sm(c, t), size, why,
                                sizeof(why)) != 0) {
        zipmoe_fetch_fail_why(c, t, 0, "filling its slot failed", why);
        return 0;
    }
    return 1;
}

// 1 if shard k of t went into its slot (0: a failure, in c->status)
static int recover_shard(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, uint64_t * recover_ns) {
    const uint64_t t0 = zipmoe_now_ns();
    if (c->file->tensors[t->tensor].raw) {
        if (!fill_raw(c, t, k)) {
            return 0;
        }
    } else {
        zipmoe_shard_recover(zipmoe_task_sm(c, t), c->file->tensors[t->tensor].n, c->file->n_shards, k - 1, zipmoe_slot_tensor(c, t));
    }
    *recover_ns += zipmoe_now_ns() - t0;
    zipmoe_shard_recovered(c, t);
    return 1;
}

// shard k (1..K) of a task: decode its E-chunk into the slot; 1 if it decoded (0: a failure). A raw
// tensor's E-chunks are empty: nothing to decode.
static int decode_shard(struct ggml_zipmoe_cache * c, struct zipmoe_task * t, int k, struct zipmoe_worker * w,
                        uint64_t * decode_ns) {
    if (c->file->tensors[t->tensor].raw) {
        zipmoe_shard_decoded(c, t);
        return 1;
    }
    const int K = c->file->n_shards;
    const struct zipmoe_chunk * ch = zipmoe_file_chunk(c->file, t->tensor, t->expert, k);
    const uint64_t t0 = zipmoe_now_ns();
    const int status = zipmoe_shard_decode(w->decoder, ch->codec, zipmoe_task_e_chunk(c, t, k), ch->size,
                                           c->file->tensors[t->tensor].n, K, k - 1, zipmoe_slot_tensor(c, t));
    *decode_ns += zipmoe_now_ns() - t0;
    if (status != GGML_ZIPMOE_OK) {
        zipmoe_fetch_fail(c, status, t, k, 0);
        return 0;
    }
    zipmoe_shard_decoded(c, t);
    return 1;
}

// shards outside host memory: CUDA slots, or a caller's device (a raw tensor there is only copied,
// through fill_raw); not an expert the CPU computes, recovered in its CPU slot
static int on_device(const struct ggml_zipmoe_cache * c, const struct zipmoe_task * t) {
    return !t->on_cpu && (c->gpu != NULL || (c->slots.write != NULL && !c->file->tensors[t->tensor].raw));
}

// minor page faults of the calling thread so far (0 where the OS does not count them per thread)
static uint64_t thread_minor_faults(void) {
#ifdef RUSAGE_THREAD
    struct rusage ru;
    return getrusage(RUSAGE_THREAD, &ru) == 0 ? (uint64_t) ru.ru_minflt : 0;
#else
    return 0;
#endif
}

// what one operation's step came to: it ran, another thread had claimed it, or it failed (the
// failure in c->status)
enum { STEP_SKIPPED = 0, STEP_RAN = 1, STEP_FAILED = -1 };

// claim operation j (shard k of t, its E-chunks in memory) and decompress it, recovering it too
// where t's SM-chunk is in memory; the thread's decoder is made on its first operation
static inline int run_decode(struct ggml_zipmoe_cache * c, int ith, int j, struct zipmoe_task * t, int k,
                             struct zipmoe_worker ** w, uint64_t * decode_ns, uint64_t * recover_ns) {
    int expected = OP_TODO;
    if (!atomic_compare_exchange_strong(&c->pipe.op_state[j], &expected, OP_CLAIMED)) {
        return STEP_SKIPPED;
    }
    if (!zipmoe_e_chunk_checked(c, t, k, decode_ns)) {
        return STEP_FAILED;
    }
    if (*w == NULL && (*w = worker_of(c, ith)) == NULL) {
        int ok = GGML_ZIPMOE_OK;
        if (atomic_compare_exchange_strong(&c->status, &ok, GGML_ZIPMOE_ERR_NOMEM)) {
            snprintf(c->error, sizeof(c->error), "%s: out of memory for a decoder", c->file->path);
        }
        return STEP_FAILED;
    }
    if (on_device(c, t)) {
        const int went = zipmoe_device_shard(c, t, k, j, *w, ith, decode_ns, recover_ns);
        if (went == 0) {
            return STEP_FAILED;
        }
        atomic_store(&c->pipe.op_state[j], went == 1 ? OP_DONE : OP_DECODED);
    } else if (!decode_shard(c, t, k, *w, decode_ns)) {
        return STEP_FAILED;
    } else if (zipmoe_sm_checked(c, t, recover_ns)) {
        if (!recover_shard(c, t, k, recover_ns)) {
            return STEP_FAILED;
        }
        atomic_store(&c->pipe.op_state[j], OP_DONE);
    } else {
        atomic_store(&c->pipe.op_state[j], OP_DECODED);
    }
    return STEP_RAN;
}

// claim operation j (shard k of t, decompressed, its SM-chunk now in memory) and recover it
static inline int run_recover(struct ggml_zipmoe_cache * c, int ith, int j, struct zipmoe_task * t, int k,
                              uint64_t * recover_ns) {
    int expected = OP_DECODED;
    if (!atomic_compare_exchange_strong(&c->pipe.op_state[j], &expected, OP_CLAIMED)) {
        return STEP_SKIPPED;
    }
    if (on_device(c, t)) {
        if (!zipmoe_device_recover_parked(c, t, k, j, &c->pipe.workers[ith], ith, recover_ns)) {
            return STEP_FAILED;
        }
    } else if (!recover_shard(c, t, k, recover_ns)) {
        return STEP_FAILED;
    }
    atomic_store(&c->pipe.op_state[j], OP_DONE);
    return STEP_RAN;
}

// a decoding thread: the first operation of the priority list that can run (a decompression whose
// E-chunks are in memory, or a recovery whose SM-chunk is), until every shard is recovered. Returns
// the time it spent with nothing to run (waiting for reads), measured on thread 0 only.
static uint64_t work_tasks(struct ggml_zipmoe_cache * c, int ith) {
    const int total = c->plan.n_tasks * c->file->n_shards;
    struct zipmoe_worker * w = NULL;
    uint64_t decode_ns = 0, recover_ns = 0, waited_ns = 0, idle_since = 0;
    const uint64_t faults = total > 0 ? thread_minor_faults() : 0; // a pass of hits costs no system call
    unsigned idle = 0;
    while (atomic_load(&c->pipe.ops_done) < total && atomic_load(&c->status) == GGML_ZIPMOE_OK) {
        int worked = 0;
        for (int j = atomic_load(&c->pipe.first_open); j < c->plan.n_dec && !worked; j++) {
            const int st = atomic_load(&c->pipe.op_state[j]);
            if (st == OP_DONE || st == OP_CLAIMED) {
                if (st == OP_DONE && j == atomic_load(&c->pipe.first_open)) {
                    atomic_compare_exchange_strong(&c->pipe.first_open, &(int) { j }, j + 1);
                }
                continue;
            }
            struct zipmoe_task * t    = &c->plan.tasks[c->plan.dec[j].task];
            const int            k    = c->plan.dec[j].chunk;
            int                  step = STEP_SKIPPED;
            if (st == OP_TODO && e_ready(t)) {
                step = run_decode(c, ith, j, t, k, &w, &decode_ns, &recover_ns);
            } else if (st == OP_DECODED && zipmoe_sm_checked(c, t, &recover_ns)) {
                step = run_recover(c, ith, j, t, k, &recover_ns);
            }
            if (step == STEP_FAILED) {
                break;
            }
            worked = step == STEP_RAN;
        }
        if (ith == 0 && worked != (idle == 0)) { // an idle streak begins or ends
            const uint64_t now = zipmoe_now_ns();
            waited_ns += worked ? now - idle_since : 0;
            idle_since = now;
        }
        idle = worked ? 0 : idle + 1;
        if (!worked) {
            zipmoe_pause_waiting(idle);
        }
    }
    if (ith == 0 && idle > 0) {
        waited_ns += zipmoe_now_ns() - idle_since;
    }
    zipmoe_device_sync(c, ith); // the slots are full only once this thread's copies are done
    atomic_fetch_add(&c->stats.decode_ns, decode_ns);
    atomic_fetch_add(&c->stats.recover_ns, recover_ns);
    if (total > 0) {
        atomic_fetch_add(&c->stats.decode_faults, thread_minor_faults() - faults);
    }
    return waited_ns;
}

// a running average that a new measurement moves by a quarter: one slow read (another process on
// the disk) does not swing the schedule, a lasting change of speed shows within a few fetches
static void update_rate(double * rate, int * measure, double bytes, uint64_t ns) {
    if (*measure == GGML_ZIPMOE_RATE_GIVEN || bytes <= 0 || ns == 0) {
        return;
    }
    const double now = bytes * 1e9 / (double) ns;
    *rate    = *measure == GGML_ZIPMOE_RATE_MEASURED ? 0.75 * *rate + 0.25 * now : now; // the first replaces the default
    *measure = GGML_ZIPMOE_RATE_MEASURED;
}

// the cost model follows this machine (rates the params did not give): read rate from the I/O
// thread's bytes and time, decode rate from the fetch's BF16 output and its threads' decode +
// recovery time. Thread 0 of end; a failed fetch only moves the starting point. A fetch whose
// decoding threads took page faults (slots touched for the first time: new pools) leaves the decode
// rate: with them it fell from 4.4-5.3 to 0.3-0.6 GB/s after a re-plan made F pools (four Qwen1.5-MoE
// sequences), and the re-plans after it planned with that.
static void calibrate(struct ggml_zipmoe_cache * c, int succeeded) {
    const uint64_t bytes  = atomic_load(&c->stats.bytes_read), io_ns = atomic_load(&c->stats.io_ns);
    const uint64_t dec_ns = atomic_load(&c->stats.decode_ns) + atomic_load(&c->stats.recover_ns);
    const uint64_t faults = atomic_load(&c->stats.decode_faults);
    const int      clean  = faults == c->plan.seen_decode_faults;
    if (!succeeded || bytes < c->plan.seen_bytes_read || io_ns < c->plan.seen_io_ns ||
        dec_ns < c->plan.seen_decode_ns || faults < c->plan.seen_decode_faults) {
        // a failure's partial reads, or statistics reset: measure from here
        c->plan.seen_bytes_read = bytes, c->plan.seen_io_ns = io_ns, c->plan.seen_decode_ns = dec_ns;
        c->plan.seen_decode_faults = faults;
        return;
    }
    update_rate(&c->plan.rate_read, &c->plan.measure_read, (double) (bytes - c->plan.seen_bytes_read),
                io_ns - c->plan.seen_io_ns);
    if (c->plan.measure_decode != GGML_ZIPMOE_RATE_GIVEN && clean) {
        double out = 0;
        for (int i = 0; i < c->plan.n_tasks; i++) {
            out += (double) c->file->tensors[c->plan.tasks[i].tensor].bytes;
        }
        update_rate(&c->plan.rate_decode, &c->plan.measure_decode, out, dec_ns - c->plan.seen_decode_ns);
    }
    c->plan.seen_bytes_read = bytes, c->plan.seen_io_ns = io_ns, c->plan.seen_decode_ns = dec_ns;
    c->plan.seen_decode_faults = faults;
}

// thread 0 of end, once every task is done (or the fetch failed): wait for the I/O thread, clean up,
// unlock; returns the time it ends at (what fetch_ns counts up to)
static uint64_t finish_fetch(struct ggml_zipmoe_cache * c, uint64_t t_end) {
    if (c->plan.n_io > 0) {
        const struct timespec pause = { 0, 20000 };
        while (atomic_load(&c->pipe.io_done) != atomic_load(&c->pipe.io_job)) {
            nanosleep(&pause, NULL);
        }
    }
    calibrate(c, atomic_load(&c->status) == GGML_ZIPMOE_OK);
    zipmoe_prefetch_release(c);
    if (atomic_load(&c->status) != GGML_ZIPMOE_OK) {
        zipmoe_device_forget_parked(c);
        zipmoe_cache_forget_tasks(c);
        for (int i = 0; i < ZIPMOE_N_STAGING && c->pipe.sm_ring[0].mem != NULL; i++) {
            atomic_store(&c->pipe.sm_ring[i].state, STAGE_FREE);
            atomic_store(&c->pipe.e_ring[i].state, STAGE_FREE);
        }
    }
    const uint64_t t_done = zipmoe_now_ns();
    atomic_fetch_add(&c->stats.fetch_calls, 1);
    atomic_fetch_add(&c->stats.fetch_ns, t_done - t_end);
    c->fetch_open = 0;
    pthread_mutex_unlock(&c->lock);
    return t_done;
}

// a graph stopped between a fetch's begin and end (an abort callback): stop the I/O thread's
// reads and forget the slots and entries they were for
void zipmoe_cache_abandon_fetch(struct ggml_zipmoe_cache * c) {
    int ok = GGML_ZIPMOE_OK;
    atomic_compare_exchange_strong(&c->status, &ok, GGML_ZIPMOE_ERR_ARG);
    const uint64_t t0 = zipmoe_now_ns();
    atomic_fetch_add(&c->stats.finish_wait_ns, finish_fetch(c, t0) - t0);
}

int ggml_zipmoe_cache_fetch_begin(struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids,
                                  int64_t n_used, int64_t n_tokens, int64_t ids_stride, int32_t * slot_ids) {
    return ggml_zipmoe_cache_fetch_begin_cpu(c, layer, pass, ids, n_used, n_tokens, ids_stride, slot_ids, NULL);
}

int ggml_zipmoe_cache_fetch_begin_cpu(struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids,
                                      int64_t n_used, int64_t n_tokens, int64_t ids_stride, int32_t * slot_ids,
                                      int32_t * cpu_ids) {
    if (c == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (c->fetch_open && pthread_equal(c->fetch_owner, pthread_self())) {
        zipmoe_cache_abandon_fetch(c);
    }
    const uint64_t t0 = zipmoe_now_ns();
    pthread_mutex_lock(&c->lock);
    const uint64_t t_locked = zipmoe_now_ns();
    c->fetch_open  = 1;
    c->fetch_owner = pthread_self();
    c->plan.n_tasks     = 0;
    c->plan.n_io        = 0;
    c->plan.n_dec       = 0;
    int status = GGML_ZIPMOE_ERR_ARG;
    if (!zipmoe_layer_served(c, layer) || pass < 0 || ids == NULL || slot_ids == NULL) {
        snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_fetch: layer %d is not served or bad arguments", layer);
    } else if (c->slots_lost) {
        snprintf(c->error, sizeof(c->error), "%s", c->slots_lost_why);
        status = GGML_ZIPMOE_ERR_NOMEM;
    } else {
        c->error[0] = '\0';
        // the I/O thread is this fetch's: a prefetch's reads stop after the one in progress
        zipmoe_prefetch_pause(c, 0);
        zipmoe_prefetch_claim(c, layer);
        status = zipmoe_cache_plan_pass(c, layer, pass, ids, n_used, n_tokens, ids_stride, slot_ids, cpu_ids);
        if (status == GGML_ZIPMOE_OK && c->plan.n_tasks > 0) {
            zipmoe_cache_schedule_tasks(c);
        }
        if (status == GGML_ZIPMOE_OK && c->plan.n_io > 0) {
            status = zipmoe_cache_ensure_staging(c);
        }
        if (status == GGML_ZIPMOE_OK && c->plan.n_io > 0) {
            status = zipmoe_cache_start_io(c);
        }
        if (status == GGML_ZIPMOE_OK) {
            zipmoe_prefetch_next_pass(c, layer, pass); // read after this fetch's own, as it decodes and computes
        }
    }
    if (status != GGML_ZIPMOE_OK) {
        zipmoe_cache_forget_tasks(c);
        c->plan.n_tasks = c->plan.n_io = c->plan.n_dec = 0;
    }
    for (int j = 0; j < c->plan.n_dec; j++) {
        atomic_store(&c->pipe.op_state[j], OP_TODO);
    }
    atomic_store(&c->pipe.ops_done, 0);
    atomic_store(&c->pipe.first_open, 0);
    atomic_store(&c->status, status);
    if (c->plan.n_io > 0 || c->prefetch.capacity > 0) {
        // the fetch's reads, then (or now, if it reads nothing) a prefetch's left
        pthread_mutex_lock(&c->pipe.io_lock);
        if (c->plan.n_io > 0) {
            atomic_fetch_add(&c->pipe.io_job, 1);
        }
        zipmoe_prefetch_resume_locked(c);
        pthread_cond_signal(&c->pipe.io_wake);
        pthread_mutex_unlock(&c->pipe.io_lock);
    }
    const uint64_t t_posted = zipmoe_now_ns();
    atomic_fetch_add(&c->stats.lock_wait_ns, t_locked - t0);
    atomic_fetch_add(&c->stats.plan_ns, t_posted - t_locked);
    atomic_fetch_add(&c->stats.fetch_ns, t_posted - t0);
    return status;
}

int ggml_zipmoe_cache_fetch_end(struct ggml_zipmoe_cache * c, int ith, int nth) {
    if (c == NULL || nth < 1 || ith < 0 || ith >= nth) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    // begin ran before this op; nothing changes fetch_open until every thread is past the barrier
    if (!c->fetch_open) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const uint64_t t0 = ith == 0 ? zipmoe_now_ns() : 0;
    int n_decoders = c->n_decoders > 0 && c->n_decoders < nth ? c->n_decoders : nth;
    n_decoders = n_decoders < ZIPMOE_MAX_THREADS ? n_decoders : ZIPMOE_MAX_THREADS;
    const uint64_t waited = ith < n_decoders ? work_tasks(c, ith) : 0;
    const uint64_t t_worked = ith == 0 ? zipmoe_now_ns() : 0;
    barrier(c, nth);
    const int status = atomic_load(&c->status);
    if (ith == 0) {
        c->plan.sched_threads = n_decoders; // the scheduler's L for the next fetch
        const uint64_t t_done = finish_fetch(c, t0);
        // fetch_ns's end part: thread 0's work, its wait for reads, then for the rest
        atomic_fetch_add(&c->stats.fetch_work_ns, t_worked - t0 - waited);
        atomic_fetch_add(&c->stats.read_wait_ns, waited);
        atomic_fetch_add(&c->stats.finish_wait_ns, t_done - t_worked);
    }
    // the next fetch must not re-plan while another thread still reads this one's state
    barrier(c, nth);
    return status;
}

int ggml_zipmoe_cache_cancel(struct ggml_zipmoe_cache * c) {
    if (c == NULL || !c->fetch_open || !pthread_equal(c->fetch_owner, pthread_self())) {
        return 0;
    }
    zipmoe_cache_abandon_fetch(c);
    return 1;
}

int ggml_zipmoe_cache_fetch(struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids, int64_t n_used,
                            int64_t n_tokens, int64_t ids_stride, int32_t * slot_ids, int ith, int nth) {
    if (c == NULL || nth < 1 || ith < 0 || ith >= nth) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (ith == 0) {
        ggml_zipmoe_cache_fetch_begin(c, layer, pass, ids, n_used, n_tokens, ids_stride, slot_ids);
    }
    barrier(c, nth);
    return ggml_zipmoe_cache_fetch_end(c, ith, nth);
}
