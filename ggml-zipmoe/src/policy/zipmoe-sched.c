// Cache-affinity scheduler: Algorithm 1 of the ZipMoE paper (Appendix A). Blocks are built by
// trial: each candidate position of a task is simulated with the prefix of the schedule in the
// runtime's execution model (ggml-zipmoe-policy.h), so that "no additional idle period" and
// "compute-dominant" are judged on the timeline the threads will actually follow.

#include "policy/zipmoe-sched.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

static bool reads_sm(int32_t state) {
    return state == GGML_ZIPMOE_STATE_M || state == GGML_ZIPMOE_STATE_E;
}

static bool reads_e(int32_t state) {
    return state == GGML_ZIPMOE_STATE_M || state == GGML_ZIPMOE_STATE_S;
}

static void heap_push(int32_t * heap, int32_t * n, int32_t v) {
    int32_t i = (*n)++;
    while (i > 0 && heap[(i - 1) / 2] > v) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i] = v;
}

static int32_t heap_pop(int32_t * heap, int32_t * n) {
    const int32_t top = heap[0];
    const int32_t v   = heap[--(*n)];
    int32_t i = 0;
    for (;;) {
        int32_t k = 2 * i + 1;
        if (k >= *n) {
            break;
        }
        if (k + 1 < *n && heap[k + 1] < heap[k]) {
            k++;
        }
        if (v <= heap[k]) {
            break;
        }
        heap[i] = heap[k];
        i = k;
    }
    heap[i] = v;
    return top;
}

void zipmoe_sched_simulate(const struct zipmoe_sched_model * m,
                           const struct ggml_zipmoe_sched_op * io, int32_t n_io,
                           const struct ggml_zipmoe_sched_op * dec, int32_t n_dec,
                           struct zipmoe_sched_timing * out) {
    const int32_t K = m->n_shards;
    const int32_t L = m->n_threads;

    // releases in time order: cached E-chunks at 0, then the E-chunk reads as the I/O thread ends them
    int32_t n_rel = 0;
    for (int32_t d = 0; d < n_dec; d++) {
        m->dec_index[dec[d].task * K + dec[d].chunk - 1] = d;
        if (!reads_e(m->tasks[dec[d].task].state)) {
            m->ready[d] = 0.0;
            m->release[n_rel++] = d;
        }
    }
    double t = 0.0;
    for (int32_t i = 0; i < n_io; i++) {
        t += io[i].chunk == 0 ? m->t_sm : m->t_e;
        if (io[i].chunk > 0) {
            const int32_t d = m->dec_index[io[i].task * K + io[i].chunk - 1];
            m->ready[d] = t;
            m->release[n_rel++] = d;
        }
    }

    for (int32_t l = 0; l < L; l++) {
        m->worker_end[l] = 0.0;
    }
    double  idle   = 0.0;
    int32_t next   = 0;
    int32_t n_heap = 0;
    for (int32_t k = 0; k < n_dec; k++) {
        int32_t w = 0;
        for (int32_t l = 1; l < L; l++) {
            if (m->worker_end[l] < m->worker_end[w]) {
                w = l;
            }
        }
        double now = m->worker_end[w];
        while (next < n_rel && m->ready[m->release[next]] <= now) {
            heap_push(m->heap, &n_heap, m->release[next++]);
        }
        if (n_heap == 0) {
            if (next == n_rel) {
                break; // a decompression whose read is missing: not a valid prefix
            }
            now = m->ready[m->release[next]];
            while (next < n_rel && m->ready[m->release[next]] <= now) {
                heap_push(m->heap, &n_heap, m->release[next++]);
            }
        }
        heap_pop(m->heap, &n_heap);
        idle += now - m->worker_end[w];
        m->worker_end[w] = now + m->t_dec;
    }

    for (int32_t l = 1; l < L; l++) {
        const double v = m->worker_end[l];
        int32_t i = l;
        for (; i > 0 && m->worker_end[i - 1] > v; i--) {
            m->worker_end[i] = m->worker_end[i - 1];
        }
        m->worker_end[i] = v;
    }

    // Definition A.1 as §3.3 states it: the l-th earliest worker lags the I/O thread by l E-chunk
    // reads, so each of the next block's first min(L, K) E-chunks finds its worker still busy
    bool dominant = true;
    const int32_t lmax = L < K ? L : K;
    for (int32_t l = 1; l <= lmax && dominant; l++) {
        dominant = m->worker_end[l - 1] - t >= l * m->t_e - m->tol;
    }

    out->io_end   = t;
    out->idle     = idle;
    out->dominant = dominant;
}

// the ops of a block: E-chunks before SM-chunks so that decompression overlaps the SM reads
static void emit_block(const struct ggml_zipmoe_sched_task * tasks, int32_t K, const int32_t * blk, int32_t len,
                       struct ggml_zipmoe_sched_op * io, int32_t * n_io,
                       struct ggml_zipmoe_sched_op * dec, int32_t * n_dec) {
    for (int32_t i = 0; i < len; i++) {
        if (reads_e(tasks[blk[i]].state)) {
            for (int32_t s = 0; s < K; s++) {
                io[(*n_io)++] = (struct ggml_zipmoe_sched_op) { blk[i], 1 + s };
            }
        }
    }
    for (int32_t i = 0; i < len; i++) {
        if (reads_sm(tasks[blk[i]].state)) {
            io[(*n_io)++] = (struct ggml_zipmoe_sched_op) { blk[i], 0 };
        }
    }
    for (int32_t i = 0; i < len; i++) {
        for (int32_t s = 0; s < K; s++) {
            dec[(*n_dec)++] = (struct ggml_zipmoe_sched_op) { blk[i], 1 + s };
        }
    }
}

// simulates the committed blocks (n_io reads, n_dec decompressions) followed by block blk
static void eval_block(const struct zipmoe_sched_model * m, const int32_t * blk, int32_t len,
                       struct ggml_zipmoe_sched_op * io, int32_t n_io,
                       struct ggml_zipmoe_sched_op * dec, int32_t n_dec,
                       struct zipmoe_sched_timing * out) {
    int32_t ni = n_io;
    int32_t nd = n_dec;
    emit_block(m->tasks, m->n_shards, blk, len, io, &ni, dec, &nd);
    zipmoe_sched_simulate(m, io, ni, dec, nd, out);
}

static void insert_at(int32_t * dst, const int32_t * blk, int32_t len, int32_t pos, int32_t j) {
    memcpy(dst, blk, (size_t) pos * sizeof(int32_t));
    dst[pos] = j;
    memcpy(dst + pos + 1, blk + pos, (size_t) (len - pos) * sizeof(int32_t));
}

// non-increasing p, an expert's tasks adjacent (ties on p broken by expert id), then task index
static bool sched_before(const struct ggml_zipmoe_sched_task * tasks, int32_t a, int32_t b) {
    if (tasks[a].p != tasks[b].p) {
        return tasks[a].p > tasks[b].p;
    }
    if (tasks[a].expert != tasks[b].expert) {
        return tasks[a].expert < tasks[b].expert;
    }
    return a < b;
}

static void sort_tasks(const struct ggml_zipmoe_sched_task * tasks, int32_t * idx, int32_t n) {
    for (int32_t i = 1; i < n; i++) {
        const int32_t v = idx[i];
        int32_t k = i;
        for (; k > 0 && sched_before(tasks, v, idx[k - 1]); k--) {
            idx[k] = idx[k - 1];
        }
        idx[k] = v;
    }
}

// lines 15-19: after the block's Type-II tasks of at least j's p, else after its Type-I tasks of
// at least j's p, else first (j has the largest p of the block)
static int32_t fallback_pos(const struct ggml_zipmoe_sched_task * tasks, const int32_t * blk, int32_t len, int32_t j) {
    int32_t last_1 = -1;
    int32_t last_2 = -1;
    for (int32_t i = 0; i < len; i++) {
        if (tasks[blk[i]].p >= tasks[j].p) {
            if (reads_sm(tasks[blk[i]].state)) {
                last_1 = i;
            } else {
                last_2 = i;
            }
        }
    }
    return (last_2 >= 0 ? last_2 : last_1) + 1;
}

static bool valid_time(double x) {
    return isfinite(x) && x >= 0.0;
}

static int check_args(const struct ggml_zipmoe_sched_task * tasks, int32_t n_tasks,
                      const struct ggml_zipmoe_sched_params * params, const void * work,
                      const struct ggml_zipmoe_sched_result * r) {
    if (!params || !r || n_tasks < 0 || params->n_shards < 1 || params->n_threads < 1) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (!valid_time(params->u) || !valid_time(params->rho) || !valid_time(params->c)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (n_tasks == 0) {
        return GGML_ZIPMOE_OK;
    }
    if (!tasks || !work || !r->io || !r->dec ||
        (int64_t) n_tasks * ((int64_t) params->n_shards + 1) > INT32_MAX ||
        (uintptr_t) work % _Alignof(double) != 0) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    for (int32_t i = 0; i < n_tasks; i++) {
        if (tasks[i].state < GGML_ZIPMOE_STATE_M || tasks[i].state > GGML_ZIPMOE_STATE_F || !valid_time(tasks[i].p)) {
            return GGML_ZIPMOE_ERR_ARG;
        }
        for (int32_t k = 0; k < i; k++) {
            if (tasks[k].expert == tasks[i].expert) {
                if (tasks[k].p != tasks[i].p) {
                    return GGML_ZIPMOE_ERR_ARG;
                }
                break;
            }
        }
    }
    return GGML_ZIPMOE_OK;
}

// sigma_I and sigma_II (the Type-I and Type-II tasks by priority) and how far each is placed
struct sched_queues {
    int32_t * sigma_1;
    int32_t * sigma_2;
    int32_t   n_1, n_2;
    int32_t   i_1, i_2;
};

static bool queues_left(const struct sched_queues * q) {
    return q->i_1 < q->n_1 || q->i_2 < q->n_2;
}

// the model of params' costs for tasks, its arrays in work; the queues' and blocks' arrays after them
static struct zipmoe_sched_model sched_model(const struct ggml_zipmoe_sched_task * tasks, int32_t n_tasks,
                                             const struct ggml_zipmoe_sched_params * params, void * work,
                                             struct sched_queues * q, int32_t ** blk, int32_t ** trial) {
    const int32_t K  = params->n_shards;
    const int32_t L  = params->n_threads;
    const size_t  nk = (size_t) n_tasks * (size_t) K;
    struct zipmoe_sched_model m = {
        .tasks     = tasks,
        .n_shards  = K,
        .n_threads = L,
        .t_sm      = params->u,
        .t_e       = params->rho * params->u / K,
        .t_dec     = params->c,
        // relative to the total work, which bounds every simulated time
        .tol       = 1e-9 * n_tasks * ((1.0 + params->rho) * params->u + K * params->c),
    };
    double * wd  = work;
    m.ready      = wd;
    m.worker_end = wd + nk;
    int32_t * wi = (int32_t *) (wd + nk + L);
    m.dec_index  = wi;
    m.release    = wi + nk;
    m.heap       = wi + 2 * nk;
    q->sigma_1   = wi + 3 * nk;
    q->sigma_2   = q->sigma_1 + n_tasks;
    *blk         = q->sigma_2 + n_tasks;
    *trial       = *blk + n_tasks;
    return m;
}

// the tasks to place (not F) into sigma_I (those that read their SM-chunks) and sigma_II, each by priority;
// no task in a block yet
static void sched_queues_fill(const struct ggml_zipmoe_sched_task * tasks, int32_t n_tasks,
                              struct ggml_zipmoe_sched_result * result, struct sched_queues * q) {
    q->n_1 = q->n_2 = q->i_1 = q->i_2 = 0;
    for (int32_t j = 0; j < n_tasks; j++) {
        if (result->task_block != NULL) {
            result->task_block[j] = -1;
        }
        if (tasks[j].state == GGML_ZIPMOE_STATE_F) {
            continue;
        }
        if (reads_sm(tasks[j].state)) {
            q->sigma_1[q->n_1++] = j;
        } else {
            q->sigma_2[q->n_2++] = j;
        }
    }
    sort_tasks(tasks, q->sigma_1, q->n_1);
    sort_tasks(tasks, q->sigma_2, q->n_2);
}

// task j into the block (blk, len) after the committed ones: at the first position that adds no idle time
// over cur, else at fallback_pos; the block with j into trial, its timing into *cur
static void place_task(const struct zipmoe_sched_model * m, const int32_t * blk, int32_t len, int32_t j,
                       int32_t * trial, struct ggml_zipmoe_sched_result * result, struct zipmoe_sched_timing * cur) {
    for (int32_t pos = 0; pos <= len; pos++) {
        struct zipmoe_sched_timing t;
        insert_at(trial, blk, len, pos, j);
        eval_block(m, trial, len + 1, result->io, result->n_io, result->dec, result->n_dec, &t);
        if (t.idle <= cur->idle + m->tol) {
            *cur = t;
            return;
        }
    }
    insert_at(trial, blk, len, fallback_pos(m->tasks, blk, len, j), j);
    eval_block(m, trial, len + 1, result->io, result->n_io, result->dec, result->n_dec, cur);
}

// the next block: the head of sigma_I (else of sigma_II), grown with U = (sigma_II, sigma_I)'s head
// while it is not compute-dominant; its length
static int32_t next_block(const struct zipmoe_sched_model * m, struct sched_queues * q, int32_t * blk,
                          int32_t * trial, struct ggml_zipmoe_sched_result * result) {
    int32_t len = 0;
    blk[len++] = q->i_1 < q->n_1 ? q->sigma_1[q->i_1++] : q->sigma_2[q->i_2++];
    struct zipmoe_sched_timing cur;
    eval_block(m, blk, len, result->io, result->n_io, result->dec, result->n_dec, &cur);
    while (queues_left(q) && !cur.dominant) {
        const int32_t j = q->i_2 < q->n_2 ? q->sigma_2[q->i_2++] : q->sigma_1[q->i_1++];
        place_task(m, blk, len, j, trial, result, &cur);
        len++;
        memcpy(blk, trial, (size_t) len * sizeof(int32_t));
    }
    return len;
}

// the block committed: its reads and decompressions, and the blocks for callers that want them (the
// fetch reads only io and dec)
static void commit_block(const struct ggml_zipmoe_sched_task * tasks, int32_t K, const int32_t * blk, int32_t len,
                         struct ggml_zipmoe_sched_result * result) {
    emit_block(tasks, K, blk, len, result->io, &result->n_io, result->dec, &result->n_dec);
    for (int32_t i = 0; i < len; i++) {
        if (result->task_block != NULL) {
            result->task_block[blk[i]] = result->n_blocks;
        }
        if (result->order != NULL) {
            result->order[result->n_order] = blk[i];
        }
        result->n_order++;
    }
    result->n_blocks++;
    if (result->block_start != NULL) {
        result->block_start[result->n_blocks] = result->n_order;
    }
}

int ggml_zipmoe_schedule(const struct ggml_zipmoe_sched_task * tasks, int32_t n_tasks,
                         const struct ggml_zipmoe_sched_params * params,
                         void * work, size_t work_size,
                         struct ggml_zipmoe_sched_result * result) {
    const int status = check_args(tasks, n_tasks, params, work, result);
    if (status != GGML_ZIPMOE_OK) {
        return status;
    }
    if (work_size < GGML_ZIPMOE_SCHED_WORK_SIZE(n_tasks, params->n_shards, params->n_threads)) {
        return GGML_ZIPMOE_ERR_CAPACITY;
    }
    result->n_io = result->n_dec = result->n_order = result->n_blocks = 0;
    if (result->block_start != NULL) {
        result->block_start[0] = 0;
    }
    if (n_tasks == 0) {
        return GGML_ZIPMOE_OK;
    }
    struct sched_queues q;
    int32_t * blk;
    int32_t * trial;
    const struct zipmoe_sched_model m = sched_model(tasks, n_tasks, params, work, &q, &blk, &trial);
    sched_queues_fill(tasks, n_tasks, result, &q);
    // Algorithm 1 loops while Type-I tasks remain, which would leave Type-II tasks unscheduled
    // when a compute-dominant last Type-I block stops early or there is no Type-I task: those
    // then form blocks of their own, based on the Type-II task of largest p
    while (queues_left(&q)) {
        const int32_t len = next_block(&m, &q, blk, trial, result);
        commit_block(tasks, params->n_shards, blk, len, result);
    }
    return GGML_ZIPMOE_OK;
}
