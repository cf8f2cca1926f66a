// Cache-affinity scheduler (zipmoe-sched.c): the timing model Algorithm 1 uses to place tasks.
// Not part of the public API; ggml_zipmoe_schedule (ggml-zipmoe-policy.h) documents the execution model.

#pragma once

#include "ggml-zipmoe-policy.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// the problem and the scratch one simulation needs (n_tasks tasks of K shards, L workers)
struct zipmoe_sched_model {
    const struct ggml_zipmoe_sched_task * tasks;
    int32_t   n_shards;    // K
    int32_t   n_threads;   // L
    double    t_sm;        // u: read of an SM-chunk
    double    t_e;         // rho*u/K: read of an E-chunk
    double    t_dec;       // c: decompression (and recovery) of a shard
    double    tol;         // slack of time comparisons, against rounding in sums of durations

    double  * ready;       // [n_tasks*K] by position in the decompression list: its E-chunk is in memory
    double  * worker_end;  // [L] after a simulation: the workers' completion times, ascending (0: unused)
    int32_t * dec_index;   // [n_tasks*K] by task*K + shard: position in the decompression list
    int32_t * release;     // [n_tasks*K] decompression positions in order of release
    int32_t * heap;        // [n_tasks*K] released decompressions not started yet, by position
};

struct zipmoe_sched_timing {
    double io_end;         // completion of the I/O thread
    double idle;           // total idle time of the workers before their last decompression (eq. (2))
    bool   dominant;       // compute-dominant (Definition A.1, read as in §3.3)
};

// executes a schedule prefix from time 0 in the runtime's model: the reads io[0..n_io) back to
// back, the decompressions dec[0..n_dec) list-scheduled on L workers (a free worker takes the
// first decompression whose E-chunk is in memory; the longest-free worker picks first).
// dec must hold every shard of the tasks it names, io every read those tasks need.
void zipmoe_sched_simulate(const struct zipmoe_sched_model * m,
                           const struct ggml_zipmoe_sched_op * io, int32_t n_io,
                           const struct ggml_zipmoe_sched_op * dec, int32_t n_dec,
                           struct zipmoe_sched_timing * out);

#ifdef __cplusplus
}
#endif
