// Expert cache, residency: which expert each slot and store entry holds, and the plan of a pass.
//
// Victims by the eviction policy (LRU, FIFO, randomized marking, LFU, RANK, SCORE); RANK dispatches an
// expert after its use by its runtime activation rank in its layer to the first pool whose
// threshold exceeds it (paper 3.4), whose store (zipmoe-stores.c) keeps its stored chunks.
// plan_pass runs on thread 0 under the cache's lock: hits first, then one fill per missing
// expert (a working slot, the tasks that make it full from what is cached, where it goes after).

#include "cache/zipmoe-cache-impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// one F pool of every slot in use: F holds them all, and RANK's share per layer follows the slot count
void zipmoe_cache_share_single_pool(struct ggml_zipmoe_cache * c) {
    const int32_t n_served = c->layout.n_served > 0 ? c->layout.n_served : 1;
    c->pools.threshold[GGML_ZIPMOE_POOL_F] =
        c->policy.eviction == GGML_ZIPMOE_EVICT_RANK ? c->slots.n_used / n_served + c->policy.rank_delta : INT32_MAX;
    c->pools.f_capacity = c->slots.n_used;
}

// marks the distinct valid experts of ids in c->plan.seen and lists them ascending in c->plan.unique;
// returns their count, or -1 if an id is out of range
static int collect_unique(const struct ggml_zipmoe_cache * c, int layer, const int32_t * ids, int64_t n_used,
                          int64_t n_tokens, int64_t ids_stride, uint8_t * seen, int32_t * unique) {
    const int32_t n_expert = c->layout.layer_n_expert[layer];
    memset(seen, 0, (size_t) n_expert);
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            const int32_t e = ids[t * ids_stride + k];
            if (e < 0 || e >= n_expert) {
                return -1;
            }
            seen[e] = 1;
        }
    }
    int n = 0;
    for (int32_t e = 0; e < n_expert; e++) {
        if (seen[e]) {
            unique[n++] = e;
        }
    }
    return n;
}

static uint64_t slot_freq(const struct ggml_zipmoe_cache * c, int32_t s) {
    return c->policy.freq[c->slots.key[s]];
}

// SCORE: the mean gate score of the expert in slot s over its layer's window (0 before any)
static double slot_score(const struct ggml_zipmoe_cache * c, int32_t s) {
    const int64_t  key   = c->slots.key[s];
    const uint64_t iters = c->policy.layer_iter[key / c->layout.max_expert];
    const uint64_t n     = iters < GGML_ZIPMOE_SCORE_WINDOW ? iters : GGML_ZIPMOE_SCORE_WINDOW;
    return n ? c->policy.score_sum[key] / (double) n : 0.0;
}

int ggml_zipmoe_cache_observe_scores(struct ggml_zipmoe_cache * c, int layer, const float * scores, int64_t n_expert,
                                     int64_t n_tokens, int64_t stride) {
    if (c == NULL || !zipmoe_layer_served(c, layer) || scores == NULL || n_tokens < 1 ||
        n_expert != c->layout.layer_n_expert[layer] || stride < n_expert) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (c->policy.eviction != GGML_ZIPMOE_EVICT_SCORE) {
        return GGML_ZIPMOE_OK;
    }
    pthread_mutex_lock(&c->policy.score_lock);
    const uint64_t it   = c->policy.layer_iter[layer]++;
    const size_t   slot = (size_t) (it % GGML_ZIPMOE_SCORE_WINDOW);
    for (int64_t e = 0; e < n_expert; e++) {
        double mean = 0;
        for (int64_t t = 0; t < n_tokens; t++) {
            mean += scores[t * stride + e];
        }
        mean /= (double) n_tokens;
        const int64_t key  = (int64_t) layer * c->layout.max_expert + e;
        float *       ring = c->policy.score_ring + (size_t) key * GGML_ZIPMOE_SCORE_WINDOW;
        // the window's sum: the iteration leaving it out, this one in (a NaN score counts as 0)
        const float v = mean == mean ? (float) mean : 0.0f;
        c->policy.score_sum[key] += (double) v - (it >= GGML_ZIPMOE_SCORE_WINDOW ? ring[slot] : 0.0f);
        ring[slot] = v;
    }
    pthread_mutex_unlock(&c->policy.score_lock);
    return GGML_ZIPMOE_OK;
}

// a slot the current call (serial) does not need, by the eviction policy; one exists, since a pass
// never holds more experts than slots
static int32_t choose_victim(struct ggml_zipmoe_cache * c, uint64_t serial) {
    int32_t victim = -1;
    for (int32_t s = 0; s < c->slots.n_used; s++) {
        if (c->slots.key[s] < 0 && c->slots.pinned[s] != serial) {
            return s; // an empty slot first, whatever the policy
        }
    }
    if (c->policy.eviction == GGML_ZIPMOE_EVICT_MARKING) {
        // randomized marking: a random unmarked slot; when every candidate is marked a new phase starts
        for (int phase = 0; phase < 2 && victim < 0; phase++) {
            int32_t n = 0;
            for (int32_t s = 0; s < c->slots.n_used; s++) {
                n += c->slots.pinned[s] != serial && !c->slots.marked[s];
            }
            if (n == 0) {
                for (int32_t s = 0; s < c->slots.n_used; s++) {
                    c->slots.marked[s] = c->slots.pinned[s] == serial;
                }
                continue;
            }
            c->policy.rng ^= c->policy.rng << 13;
            c->policy.rng ^= c->policy.rng >> 7;
            c->policy.rng ^= c->policy.rng << 17;
            int32_t pick = (int32_t) (c->policy.rng % (uint64_t) n);
            for (int32_t s = 0; s < c->slots.n_used; s++) {
                if (c->slots.pinned[s] != serial && !c->slots.marked[s] && pick-- == 0) {
                    victim = s;
                    break;
                }
            }
        }
        return victim;
    }
    for (int32_t s = 0; s < c->slots.n_used; s++) {
        if (c->slots.pinned[s] == serial) {
            continue;
        }
        if (victim < 0) {
            victim = s;
            continue;
        }
        int better = 0;
        switch (c->policy.eviction) {
            case GGML_ZIPMOE_EVICT_FIFO:
                better = c->slots.inserted[s] < c->slots.inserted[victim];
                break;
            case GGML_ZIPMOE_EVICT_RANK:
                // working slots (experts outside the F pool) go first
                if (c->slots.transient[s] != c->slots.transient[victim]) {
                    better = c->slots.transient[s] > c->slots.transient[victim];
                    break;
                }
                // fall through - LFU among the rest
            case GGML_ZIPMOE_EVICT_LFU: {
                const uint64_t fs = slot_freq(c, s), fv = slot_freq(c, victim);
                better = fs < fv || (fs == fv && c->slots.last_use[s] < c->slots.last_use[victim]);
                break;
            }
            case GGML_ZIPMOE_EVICT_SCORE: {
                pthread_mutex_lock(&c->policy.score_lock);
                const double ss = slot_score(c, s), sv = slot_score(c, victim);
                pthread_mutex_unlock(&c->policy.score_lock);
                better = ss < sv || (ss == sv && c->slots.last_use[s] < c->slots.last_use[victim]);
                break;
            }
            default: // LRU
                better = c->slots.last_use[s] < c->slots.last_use[victim];
                break;
        }
        if (better) {
            victim = s;
        }
    }
    return victim;
}

// F holds at most f_capacity experts: the least frequent F experts beyond it become working slots
static void enforce_f_capacity(struct ggml_zipmoe_cache * c) {
    if (c->pools.f_capacity >= c->slots.n_used) {
        return; // one F pool of every slot
    }
    int32_t n_f = 0;
    for (int32_t s = 0; s < c->slots.n_used; s++) {
        n_f += c->slots.key[s] >= 0 && !c->slots.transient[s];
    }
    for (; n_f > c->pools.f_capacity; n_f--) {
        int32_t victim = -1;
        for (int32_t s = 0; s < c->slots.n_used; s++) {
            if (c->slots.key[s] < 0 || c->slots.transient[s]) {
                continue;
            }
            if (victim < 0 || slot_freq(c, s) < slot_freq(c, victim) ||
                (slot_freq(c, s) == slot_freq(c, victim) && c->slots.last_use[s] < c->slots.last_use[victim])) {
                victim = s;
            }
        }
        c->slots.transient[victim] = 1;
    }
}

static const int32_t pool_state[4] = { GGML_ZIPMOE_STATE_F, GGML_ZIPMOE_STATE_C, GGML_ZIPMOE_STATE_S,
                                       GGML_ZIPMOE_STATE_E };

// the store that keeps expert key's chunks after this use, made ready: *dst_pool and *dst_entry (NO_POOL:
// none is written); returns 1 where its E part went to the new C entry (a trade with C's victim)
static int place_after_use(struct ggml_zipmoe_cache * c, int64_t key, int cur, int32_t cur_entry, int target,
                           uint64_t serial, int * dst_pool, int32_t * dst_entry) {
    // its pool's; with an inclusive C, an F expert's C entry too
    int keep = target > GGML_ZIPMOE_POOL_F                     ? target
             : c->pools.inclusive && target == GGML_ZIPMOE_POOL_F ? GGML_ZIPMOE_POOL_C
                                                                 : NO_POOL;
    // one whose rank falls to a lower store stays in its own until a fill needs the entry: moving now
    // would push another expert out of the lower store and leave this entry empty (on an even router
    // ranks move by noise, and every push was a whole read later). Beyond every threshold it goes, as
    // the paper's dispatch says.
    if (cur != NO_POOL && target != NO_POOL && target > cur) {
        keep = cur;
    }
    *dst_pool  = NO_POOL;
    *dst_entry = -1;
    int traded = 0;
    if (keep != NO_POOL && keep != cur) {
        *dst_pool  = keep;
        *dst_entry = zipmoe_store_victim(c, keep, serial);
        if (*dst_entry >= 0) {
            const int64_t victim_key = c->pools.store[keep].entry_key[*dst_entry];
            zipmoe_store_forget(c, keep, *dst_entry);
            if (keep == GGML_ZIPMOE_POOL_C && cur == GGML_ZIPMOE_POOL_E && victim_key >= 0) {
                zipmoe_store_forget(c, cur, cur_entry);
                zipmoe_store_trade_e_parts(c, key, *dst_entry, cur_entry, victim_key);
                traded = 1;
            }
        } else {
            *dst_pool = NO_POOL; // every entry is read or written by this call
        }
    }
    if (cur != NO_POOL && keep != cur && !traded) {
        zipmoe_store_forget(c, cur, cur_entry); // moves (or is dropped); its bytes stay until this call ends
    }
    if (*dst_pool != NO_POOL) {
        c->pools.store[*dst_pool].entry_key[*dst_entry]      = key;
        c->pools.store[*dst_pool].entry_pinned[*dst_entry]   = serial;
        c->pools.store[*dst_pool].entry_last_use[*dst_entry] = c->policy.tick;
        c->pools.key_pool[key]  = (int8_t) *dst_pool;
        c->pools.key_entry[key] = *dst_entry;
    }
    return traded;
}

static void plan_tasks(struct ggml_zipmoe_cache * c, int layer, int32_t e, int32_t slot, int on_cpu, int target,
                       uint64_t serial);

// plans one expert that is not in a slot: its working slot, the tasks that make it full from what
// is cached, and where it is kept after use
static void plan_fill(struct ggml_zipmoe_cache * c, int layer, int32_t e, int target, uint64_t serial) {
    const int64_t key = (int64_t) layer * c->layout.max_expert + e;
    const int32_t victim = choose_victim(c, serial);
    if (c->slots.key[victim] >= 0) {
        c->slots.of_key[c->slots.key[victim]] = -1;
    }
    c->slots.key[victim]       = key;
    c->slots.of_key[key]          = victim;
    c->slots.pinned[victim]    = serial;
    c->slots.last_use[victim]  = ++c->policy.tick;
    c->slots.inserted[victim]  = c->policy.tick;
    c->slots.marked[victim]    = 1;
    c->slots.transient[victim] = target != GGML_ZIPMOE_POOL_F;
    c->plan.pass_slot[e]           = victim;
    if (c->gpu != NULL || c->slots.write != NULL) {
        atomic_fetch_add(&c->stats.device_experts, 1);
    }
    plan_tasks(c, layer, e, victim, 0, target, serial);
}

// the tasks that make expert e full in slot (a device's, or the CPU's: on_cpu) from what is cached,
// and where it is kept after use
static void plan_tasks(struct ggml_zipmoe_cache * c, int layer, int32_t e, int32_t slot, int on_cpu, int target,
                       uint64_t serial) {
    const int64_t key = (int64_t) layer * c->layout.max_expert + e;
    const int     cur = c->pools.key_pool[key];
    const int32_t cur_entry = c->pools.key_entry[key];
    if (cur != NO_POOL) {
        c->pools.store[cur].entry_pinned[cur_entry]   = serial; // read by this call's tasks
        c->pools.store[cur].entry_last_use[cur_entry] = c->policy.tick;
        atomic_fetch_add(&c->stats.store_hits[cur], 1);
    } else {
        atomic_fetch_add(&c->stats.misses, 1);
    }
    int       dst_pool;
    int32_t   dst_entry;
    const int traded = place_after_use(c, key, cur, cur_entry, target, serial, &dst_pool, &dst_entry);
    int prefetched = 0;
    for (int k = 0; k < 3; k++) {
        struct zipmoe_task * t = &c->plan.tasks[c->plan.n_tasks++];
        t->slot      = slot;
        t->on_cpu    = on_cpu;
        t->kind      = k;
        t->tensor    = c->layout.layer_tensor[layer * 3 + k];
        t->expert    = e;
        t->state     = cur == NO_POOL ? GGML_ZIPMOE_STATE_M : pool_state[cur];
        t->sm_src    = cur != NO_POOL ? zipmoe_store_sm(c, cur, cur_entry, k) : NULL;
        t->e_src     = traded           ? zipmoe_store_e(c, dst_pool, dst_entry, layer, e, k)
                     : cur != NO_POOL ? zipmoe_store_e(c, cur, cur_entry, layer, e, k)
                                      : NULL;
        if (c->file->tensors[t->tensor].raw) {
            // a raw expert's E-chunks are empty: held already, only its bytes (the SM-chunk's place) are read
            static const uint8_t no_e_chunks[1];
            t->state = GGML_ZIPMOE_STATE_E;
            t->e_src = no_e_chunks;
        }
        t->dst_pool  = dst_pool;
        t->dst_entry = dst_entry;
        t->sm_dst    = dst_pool != NO_POOL ? zipmoe_store_sm(c, dst_pool, dst_entry, k) : NULL;
        t->e_dst     = dst_pool != NO_POOL && !traded ? zipmoe_store_e(c, dst_pool, dst_entry, layer, e, k) : NULL;
        atomic_store(&t->sm_buf, -1);
        atomic_store(&t->e_buf, -1);
        atomic_store(&t->n_decoded, 0);
        atomic_store(&t->n_recovered, 0);
        atomic_store(&t->sm_check, CHECK_TODO);
        prefetched |= zipmoe_prefetch_supply(c, t);
    }
    if (prefetched) {
        atomic_fetch_add(&c->prefetch.hits, 1);
    }
}

// the tokens that chose each expert: ranks for the pools (a prompt's one ubatch tells its hot experts
// from those one token chose), and the re-plan's profile, each layer's even and odd tokens apart
static void count_selections(struct ggml_zipmoe_cache * c, int layer, const int32_t * ids, int64_t n_used,
                             int64_t n_tokens, int64_t ids_stride) {
    const int64_t  base   = (int64_t) layer * c->layout.max_expert;
    const size_t   n_keys = zipmoe_cache_n_keys(c);
    const uint64_t first  = atomic_fetch_add(&c->stats.layer_tokens[layer], (uint64_t) n_tokens);
    for (int64_t t = 0; t < n_tokens; t++) {
        atomic_uint_least64_t * half = c->stats.selections + ((first + (uint64_t) t) % 2) * n_keys;
        for (int64_t k = 0; k < n_used; k++) {
            const int64_t key = base + ids[t * ids_stride + k];
            c->policy.selected[key]++;
            atomic_fetch_add_explicit(&half[key], 1, memory_order_relaxed);
        }
    }
}

// the CPU-load balancer (SMoE Alg. 2) over the pass's experts in no slot: c->cpu.cpu_slot[e] gets the CPU
// slot of those it gives to the CPU. The cost of a load is measured (the fetches' device time per expert
// copied); none measured yet: every one is loaded
static void balance_cpu_load(struct ggml_zipmoe_cache * c, int first, int last) {
    const uint64_t loaded = atomic_load(&c->stats.device_experts);
    int32_t n = 0;
    for (int i = first; i < last; i++) {
        const int32_t e = c->plan.unique[i];
        if (c->plan.pass_slot[e] < 0) {
            c->cpu.missing[n] = e;
            c->cpu.batch[n++] = c->plan.tokens[e];
        }
    }
    if (n == 0 || loaded == 0) {
        return;
    }
    const double t_load = (double) atomic_load(&c->stats.device_ns) * 1e-9 / (double) loaded;
    if (ggml_zipmoe_balance_cpu_load(c->cpu.batch, n, t_load, c->cpu.t_cpu, c->cpu.n_slots, c->cpu.work,
                                     c->cpu.on_cpu) <= 0) {
        return;
    }
    int32_t next = 0;
    for (int32_t i = 0; i < n; i++) {
        if (c->cpu.on_cpu[i]) {
            c->cpu.cpu_slot[c->cpu.missing[i]] = next++;
        }
    }
}

// thread 0, under the lock: residency for the experts of this pass, the tasks, their schedule, the slot ids
int zipmoe_cache_plan_pass(struct ggml_zipmoe_cache * c, int layer, int pass, const int32_t * ids, int64_t n_used,
                     int64_t n_tokens, int64_t ids_stride, int32_t * slot_ids, int32_t * cpu_ids) {
    const int n_unique = collect_unique(c, layer, ids, n_used, n_tokens, ids_stride, c->plan.seen, c->plan.unique);
    if (n_unique < 0) {
        snprintf(c->error, sizeof(c->error), "layer %d: the router selected an expert id outside 0..%d", layer,
                 c->layout.layer_n_expert[layer] - 1);
        return GGML_ZIPMOE_ERR_ARG;
    }
    c->plan.n_unique = n_unique;
    const int width = zipmoe_cache_pass_width(c);
    const int first = pass * width;
    const int last  = first + width < n_unique ? first + width : n_unique;
    const uint64_t serial = ++c->policy.call_serial;
    const int64_t base = (int64_t) layer * c->layout.max_expert;
    if (pass == 0 && !c->preloading) {
        for (int i = 0; i < n_unique; i++) {
            atomic_fetch_add(&c->stats.activations[base + c->plan.unique[i]], 1);
            c->policy.freq[base + c->plan.unique[i]]++;
        }
        atomic_fetch_add(&c->stats.layer_ubatches[layer], 1);
        count_selections(c, layer, ids, n_used, n_tokens, ids_stride);
        zipmoe_prefetch_score(c, layer, c->plan.unique, n_unique);
    }
    for (int32_t e = 0; e < c->layout.layer_n_expert[layer]; e++) {
        c->plan.pass_slot[e] = -1;
        c->plan.tokens[e] = 0;
        if (c->cpu.cpu_slot != NULL) {
            c->cpu.cpu_slot[e] = -1;
        }
    }
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            c->plan.tokens[ids[t * ids_stride + k]]++;
        }
    }
    // hits first, so that no fill evicts an expert this pass still needs
    for (int i = first; i < last; i++) {
        const int32_t s = c->slots.of_key[base + c->plan.unique[i]];
        if (s >= 0) {
            c->slots.pinned[s]    = serial;
            c->slots.last_use[s]  = ++c->policy.tick;
            c->slots.marked[s]    = 1;
            // no compressed form of it is in memory: it stays in its slot, first to go if not in F
            c->slots.transient[s] = zipmoe_dispatch_pool(c, layer, c->plan.unique[i]) != GGML_ZIPMOE_POOL_F;
            c->plan.pass_slot[c->plan.unique[i]] = s;
            atomic_fetch_add(&c->stats.hits, 1);
        }
    }
    const int with_cpu = cpu_ids != NULL && c->cpu.n_slots > 0;
    if (with_cpu) {
        balance_cpu_load(c, first, last);
    }
    for (int i = first; i < last; i++) {
        const int32_t e = c->plan.unique[i];
        if (c->plan.pass_slot[e] >= 0) {
            continue;
        }
        if (with_cpu && c->cpu.cpu_slot[e] >= 0) {
            // computed where it is held: no device slot, kept in the stores as a miss would be
            plan_tasks(c, layer, e, c->cpu.cpu_slot[e], 1, zipmoe_dispatch_pool(c, layer, e), serial);
            atomic_fetch_add(&c->stats.cpu_experts, 1);
        } else {
            plan_fill(c, layer, e, zipmoe_dispatch_pool(c, layer, e), serial);
        }
    }
    enforce_f_capacity(c);
    // selections of other passes are skipped by the products (ggml's mul_mat_id leaves the rows of
    // a negative id alone): each pass computes its own rows only, the merge takes them
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            const int32_t e = ids[t * ids_stride + k];
            const int32_t s = c->plan.pass_slot[e];
            slot_ids[t * n_used + k] = s >= 0 ? s : GGML_ZIPMOE_NO_SLOT;
            if (cpu_ids != NULL) {
                cpu_ids[t * n_used + k] = with_cpu && s < 0 && c->cpu.cpu_slot[e] >= 0 ? c->cpu.cpu_slot[e]
                                                                                       : GGML_ZIPMOE_NO_SLOT;
            }
        }
    }
    return GGML_ZIPMOE_OK;
}

// slots and store entries whose fill failed hold garbage: forget what they were meant to hold
void zipmoe_cache_forget_tasks(struct ggml_zipmoe_cache * c) {
    for (int i = 0; i < c->plan.n_tasks; i++) {
        const struct zipmoe_task * t = &c->plan.tasks[i];
        if (!t->on_cpu && c->slots.key[t->slot] >= 0) {
            c->slots.of_key[c->slots.key[t->slot]] = -1;
            c->slots.key[t->slot] = -1;
        }
        if (t->dst_pool != NO_POOL) {
            zipmoe_store_forget(c, t->dst_pool, t->dst_entry);
        }
    }
}

int ggml_zipmoe_cache_set_cpu_slots(struct ggml_zipmoe_cache * c, void * const data[3], const size_t stride[3],
                                    int32_t n_slots, double t_cpu) {
    if (c == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (n_slots < 0 || (n_slots > 0 && (data == NULL || stride == NULL || !isfinite(t_cpu) || t_cpu < 0))) {
        snprintf(c->error, sizeof(c->error), "ggml_zipmoe_cache_set_cpu_slots: bad arguments (%d slots)", n_slots);
        return GGML_ZIPMOE_ERR_ARG;
    }
    if (n_slots > 0 && zipmoe_cache_slots_in_host(c)) {
        snprintf(c->error, sizeof(c->error), "%s: the slots are in host memory: the CPU computes every expert already",
                 c->file->path);
        return GGML_ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&c->lock);
    int status = GGML_ZIPMOE_OK;
    const size_t n = (size_t) (c->layout.max_expert > 0 ? c->layout.max_expert : 1);
    if (n_slots > 0 && c->cpu.cpu_slot == NULL) {
        c->cpu.batch    = (int32_t *) malloc(n * sizeof(int32_t));
        c->cpu.missing  = (int32_t *) malloc(n * sizeof(int32_t));
        c->cpu.work     = (int32_t *) malloc(n * sizeof(int32_t));
        c->cpu.on_cpu   = (uint8_t *) malloc(n);
        c->cpu.cpu_slot = (int32_t *) malloc(n * sizeof(int32_t));
        if (!c->cpu.batch || !c->cpu.missing || !c->cpu.work || !c->cpu.on_cpu || !c->cpu.cpu_slot) {
            zipmoe_cpu_slots_free(c);
            snprintf(c->error, sizeof(c->error), "%s: out of host memory for the CPU-load balancer", c->file->path);
            status = GGML_ZIPMOE_ERR_NOMEM;
        } else {
            for (size_t e = 0; e < n; e++) {
                c->cpu.cpu_slot[e] = -1;
            }
        }
    }
    if (status == GGML_ZIPMOE_OK) {
        for (int k = 0; k < 3; k++) {
            c->cpu.data[k]   = n_slots > 0 ? (uint8_t *) data[k] : NULL;
            c->cpu.stride[k] = n_slots > 0 ? stride[k] : 0;
        }
        c->cpu.n_slots = n_slots;
        c->cpu.t_cpu   = n_slots > 0 ? t_cpu : 0;
    }
    pthread_mutex_unlock(&c->lock);
    return status;
}

void zipmoe_cpu_slots_free(struct ggml_zipmoe_cache * c) {
    free(c->cpu.batch);
    free(c->cpu.missing);
    free(c->cpu.work);
    free(c->cpu.on_cpu);
    free(c->cpu.cpu_slot);
    memset(&c->cpu, 0, sizeof(c->cpu));
}
