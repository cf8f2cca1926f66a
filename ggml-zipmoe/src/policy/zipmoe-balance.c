// SMoE's CPU-load balancer (Algorithm 2 of the SMoE paper, section 5.4): which of the experts a
// device lacks are copied to it and which the CPU computes where they are held. Pure: the cache
// (zipmoe-residency.c) gives it the batches and the measured costs.

#include "ggml-zipmoe-policy.h"

#include <math.h>

static void sort_by_batch(const int32_t * batch, int32_t * order, int32_t n) {
    // insertion sort: n is one pass's missing experts (a few dozen at most), and no global state
    for (int32_t i = 1; i < n; i++) {
        const int32_t v = order[i];
        int32_t j = i;
        while (j > 0 && (batch[order[j - 1]] < batch[v] || (batch[order[j - 1]] == batch[v] && order[j - 1] > v))) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = v;
    }
}

int32_t ggml_zipmoe_balance_cpu_load(const int32_t * batch, int32_t n, double t_load, double t_cpu, int32_t max_cpu,
                                     int32_t * work, uint8_t * on_cpu) {
    if (n < 0 || (n > 0 && (batch == NULL || work == NULL || on_cpu == NULL)) || !isfinite(t_load) ||
        !isfinite(t_cpu) || t_load < 0 || t_cpu < 0) {
        return -1;
    }
    for (int32_t i = 0; i < n; i++) {
        if (batch[i] < 0) {
            return -1;
        }
        work[i]   = i;
        on_cpu[i] = 0;
    }
    sort_by_batch(batch, work, n);
    double  c_load = 0, c_cpu = 0;
    int32_t l = 0, r = n - 1, n_cpu = 0;
    while (l <= r) {
        if (c_load <= c_cpu || n_cpu >= max_cpu) {
            c_load += t_load;
            l++;
        } else {
            c_cpu += (double) batch[work[r]] * t_cpu;
            on_cpu[work[r]] = 1;
            n_cpu++;
            r--;
        }
    }
    return n_cpu;
}
