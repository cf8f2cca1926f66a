// Serving (ggml-zipmoe-serving.h): the memory a process may take, the slots to reserve, and the
// slots in use with their pools each time a context is made or freed.

#include "serving/zipmoe-serving-impl.h"
#include "common/zipmoe-impl.h"
#include "ggml-zipmoe-options.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

void zipmoe_serving_log(const struct ggml_zipmoe_serving * s, int level, const char * fmt, ...) {
    if (s->log == NULL) {
        return;
    }
    char text[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    s->log(level, text, s->log_data);
}

// a size in words (ggml_zipmoe_size_text: "1.25 GiB", "18.0 KiB") in one of a few rotating buffers, so
// that a message may hold several
const char * zipmoe_size_text(uint64_t bytes) {
    static _Thread_local char bufs[8][32];
    static _Thread_local int next;
    return ggml_zipmoe_size_text(bytes, bufs[next++ % 8], sizeof(bufs[0]));
}

static int32_t slots_for(const struct ggml_zipmoe_serving * s, uint64_t bytes) {
    const uint64_t n = bytes / s->info.expert_bytes;
    return (int32_t) MIN(n, (uint64_t) INT32_MAX);
}

static const char * budget_name(const struct ggml_zipmoe_serving * s) {
    return s->budget_name;
}

static bool with_pools(const struct ggml_zipmoe_serving * s) {
    return s->p.pools[0] + s->p.pools[1] + s->p.pools[2] + s->p.pools[3] > 0;
}

// resident set of this process (VmRSS), 0 if unknown
static uint64_t resident_bytes(void) {
    FILE * f = fopen("/proc/self/status", "r");
    if (f == NULL) {
        return 0;
    }
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        if (sscanf(line, "VmRSS: %llu kB", &kb) == 1) {
            break;
        }
    }
    fclose(f);
    return (uint64_t) kb * 1024;
}

// what this process may take, measured before the model's weights are mapped
static void measure_memory(struct ggml_zipmoe_serving * s) {
    if (s->p.available != 0) {
        s->available = s->p.available;
        snprintf(s->source, sizeof(s->source), "%s", s->p.available_source ? s->p.available_source : "given");
        return;
    }
    struct ggml_zipmoe_memory mem;
    ggml_zipmoe_memory_available(NULL, &mem);
    s->available = mem.available;
    if (mem.cgroup_version != 0 && mem.cgroup_limit != UINT64_MAX && mem.available < mem.mem_available) {
        snprintf(s->source, sizeof(s->source), "cgroup v%d %.160s: limit %s, %s in use", mem.cgroup_version,
                 mem.cgroup_path, zipmoe_size_text(mem.cgroup_limit), zipmoe_size_text(mem.cgroup_used));
    } else {
        snprintf(s->source, sizeof(s->source), "MemAvailable");
    }
    if (s->p.mem_limit != 0) {
        const uint64_t rss  = resident_bytes();
        const uint64_t left = s->p.mem_limit > rss ? s->p.mem_limit - rss : 0;
        if (left < s->available) {
            s->available = left;
            snprintf(s->source, sizeof(s->source), "zipmoe.mem_limit %s, %s resident", zipmoe_size_text(s->p.mem_limit),
                     zipmoe_size_text(rss));
        }
    }
    if (s->available == UINT64_MAX) {
        s->available = 0; // unknown: the budget then falls back to its minimum, with a warning
        snprintf(s->source, sizeof(s->source), "unknown (no /proc/meminfo, no cgroup limit)");
    }
}

// the slots to reserve; how many are in use is decided per context (resize)
static int choose_capacity(struct ggml_zipmoe_serving * s, char * err, size_t err_size) {
    struct ggml_zipmoe_serving_info * in = &s->info;
    const int32_t * pools = s->p.pools;
    const int32_t all_slots = MAX(1, s->info.n_experts);
    if (in->with_pools) {
        // pools hold experts per MoE layer: more than a layer has is a mistake (a slot count?), and
        // would reserve memory no expert ever uses
        const int64_t held = (int64_t) pools[0] + pools[1] + pools[2] + pools[3];
        if (held > in->max_expert) {
            snprintf(err, err_size, "zipmoe.pool_f/c/s/e (F %d, C %d, S %d, E %d) hold %lld experts per MoE layer, "
                     "more than the %d a layer of %s has", pools[0], pools[1], pools[2], pools[3], (long long) held,
                     in->max_expert, ggml_zipmoe_file_path(s->p.file));
            return GGML_ZIPMOE_ERR_ARG;
        }
        in->capacity = pools[0] * in->n_moe_layers + s->p.work_slots;
    } else if (s->p.budget != 0) {
        if (s->p.budget < in->expert_bytes) {
            // the one check of a budget against the model's experts (Llama's too: it names the option as given)
            snprintf(err, err_size, "%s of %llu bytes cannot hold one expert (%llu bytes: gate + up + down); give "
                     "at least that, better a layer's top-k experts",
                     budget_name(s), (unsigned long long) s->p.budget, (unsigned long long) in->expert_bytes);
            return GGML_ZIPMOE_ERR_ARG;
        }
        in->capacity = MIN(slots_for(s, s->p.budget), all_slots); // more slots than experts would never be used
    } else {
        in->capacity = MAX(MIN(all_slots, slots_for(s, s->available)), MIN(all_slots, s->p.n_expert_used));
    }
    return GGML_ZIPMOE_OK;
}

struct ggml_zipmoe_serving * ggml_zipmoe_serving_new(const struct ggml_zipmoe_serving_params * params, char * err,
                                                     size_t err_size) {
    char scratch[1];
    if (err == NULL || err_size == 0) {
        err = scratch;
        err_size = sizeof(scratch);
    }
    err[0] = '\0';
    if (params == NULL || params->file == NULL || params->layer_tensors == NULL || params->n_layer <= 0) {
        snprintf(err, err_size, "ggml_zipmoe_serving_new: no file or no layer table");
        return NULL;
    }
    struct ggml_zipmoe_serving * s = calloc(1, sizeof(*s));
    int32_t * table = malloc(sizeof(int32_t) * 3 * (size_t) params->n_layer);
    if (s == NULL || table == NULL) {
        free(s);
        free(table);
        snprintf(err, err_size, "ggml_zipmoe_serving_new: out of memory");
        return NULL;
    }
    memcpy(table, params->layer_tensors, sizeof(int32_t) * 3 * (size_t) params->n_layer);
    s->p                  = *params;
    s->p.n_expert_used    = MAX(1, params->n_expert_used);
    s->p.layer_tensors    = table;
    snprintf(s->budget_name, sizeof(s->budget_name), "%s", params->budget_name ? params->budget_name : "zipmoe.budget");
    s->p.budget_name      = s->budget_name;
    s->layer_tensors      = table;
    s->log                = params->log;
    s->log_data           = params->log_data;
    s->info.with_pools    = with_pools(s);
    s->auto_threads       = 1;
    s->n_threads_max      = 1;
    measure_memory(s);
    s->p.available_source = NULL; // read once, above: the caller's string need not outlive the call
    if (zipmoe_serving_measure_experts(s, err, err_size) != GGML_ZIPMOE_OK || choose_capacity(s, err, err_size) != GGML_ZIPMOE_OK) {
        ggml_zipmoe_serving_free(s);
        return NULL;
    }
    s->info.fewest = MIN(s->info.capacity, s->p.n_expert_used);
    const int32_t one_token = MIN(MAX(1, s->info.max_expert), s->p.n_expert_used);
    if (s->p.budget != 0 && !s->info.with_pools && s->info.capacity < one_token) {
        // still exact, but every MoE layer's products then run in passes: easily missed in a share
        zipmoe_serving_log(s, 1, "%s of %s holds %d expert(s), fewer than the %d a token selects in a MoE layer: "
                           "each layer's products run in up to %d passes (exact, slower); give at least %s",
                           budget_name(s), zipmoe_size_text(s->p.budget), s->info.capacity, one_token,
                           (one_token + s->info.capacity - 1) / s->info.capacity,
                           zipmoe_size_text((uint64_t) one_token * s->info.expert_bytes));
    }
    return s;
}

void ggml_zipmoe_serving_free(struct ggml_zipmoe_serving * s) {
    if (s == NULL) {
        return;
    }
    if (s->mapping != NULL) {
        munmap(s->mapping, s->mapping_bytes);
    }
    zipmoe_routing_profile_free(&s->routing);
    free(s->layer_tensors);
    free(s);
}

void ggml_zipmoe_serving_get_info(const struct ggml_zipmoe_serving * s, struct ggml_zipmoe_serving_info * info) {
    *info = s->info;
}

void ggml_zipmoe_serving_set_host_zero_slots(struct ggml_zipmoe_serving * s, int32_t n) {
    s->host_zero_slots = MAX(0, n);
}

int ggml_zipmoe_serving_reserve_host(struct ggml_zipmoe_serving * s, void * data[3], size_t stride[3], char * err,
                                     size_t err_size) {
    struct ggml_zipmoe_serving_info * in = &s->info;
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    for (int k = 0; k < 3; ++k) {
        s->stride[k] = (size_t) in->slot_bytes[k];
    }
    // address space for every slot, committed only where a slot is written (MAP_NORESERVE); where
    // the kernel refuses that much, fewer slots
    size_t section[3];
    for (;;) {
        size_t off = 0;
        for (int k = 0; k < 3; ++k) {
            section[k] = off;
            off += ((size_t) (in->capacity + s->host_zero_slots) * s->stride[k] + page - 1) / page * page;
        }
        s->mapping_bytes = off;
        void * m = mmap(NULL, off, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m != MAP_FAILED) {
            s->mapping = m;
            zipmoe_advise_huge_pages(m, off);
            break;
        }
        if (in->capacity <= MIN(s->p.n_expert_used, in->capacity) || in->capacity <= 1) {
            snprintf(err, err_size, "cannot reserve address space for the ZipMoE expert cache (%d slots, %.1f MiB): %s",
                     in->capacity, off / ZIPMOE_MIB, strerror(errno));
            return GGML_ZIPMOE_ERR_NOMEM;
        }
        in->capacity = MAX(1, in->capacity / 2);
    }
    in->fewest = in->with_pools ? in->capacity : MIN(in->capacity, s->p.n_expert_used);
    for (int k = 0; k < 3; ++k) {
        s->slot_base[k] = (uint8_t *) s->mapping + section[k];
        data[k]   = s->slot_base[k];
        stride[k] = s->stride[k];
    }
    return GGML_ZIPMOE_OK;
}

void ggml_zipmoe_serving_adopt_host(struct ggml_zipmoe_serving * s, void * const data[3]) {
    struct ggml_zipmoe_serving_info * in = &s->info;
    for (int k = 0; k < 3; ++k) {
        s->stride[k]    = (size_t) in->slot_bytes[k];
        s->slot_base[k] = (uint8_t *) data[k];
    }
    in->fewest = in->with_pools ? in->capacity : MIN(in->capacity, s->p.n_expert_used);
}

// snprintf at *used into buf, kept within size
static void append(char * buf, size_t size, size_t * used, const char * fmt, ...) __attribute__((format(printf, 4, 5)));
static void append(char * buf, size_t size, size_t * used, const char * fmt, ...) {
    if (*used >= size) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(buf + *used, size - *used, fmt, ap);
    va_end(ap);
    *used = n < 0 ? size : MIN(size, *used + (size_t) n);
}

// the pools given, per MoE layer as given: their memory against the budget, and a line for the log
static int check_given_pools(struct ggml_zipmoe_serving * s, char * err, size_t err_size) {
    const int32_t L = s->info.n_moe_layers;
    uint64_t total = 0;
    char layout[384] = "", none[16] = "";
    size_t used = 0, n_none = 0;
    for (int p = 0; p < GGML_ZIPMOE_POOL_COUNT; ++p) {
        size_t entry = 0;
        const int n = ggml_zipmoe_cache_pool_entries(s->cache, p, &entry); // over every layer
        if (s->p.pools[p] == 0) {
            append(none, sizeof(none), &n_none, "%s%s", n_none ? ", " : "", ggml_zipmoe_pool_name(p));
            continue;
        }
        total += (uint64_t) n * entry;
        append(layout, sizeof(layout), &used, "%s%s %d per MoE layer x %d layers x %s = %s", used ? ", " : "",
               ggml_zipmoe_pool_name(p), s->p.pools[p], L, zipmoe_size_text(entry), zipmoe_size_text((uint64_t) n * entry));
    }
    const uint64_t work = (uint64_t) s->p.work_slots * s->info.expert_bytes;
    total += work;
    append(layout, sizeof(layout), &used, ", %d working slots x %s = %s", s->p.work_slots,
           zipmoe_size_text(s->info.expert_bytes), zipmoe_size_text(work));
    if (n_none > 0) {
        append(layout, sizeof(layout), &used, " (%s: none)", none);
    }
    if (s->p.budget != 0 && total > s->p.budget) {
        snprintf(err, err_size, "zipmoe.pool_* and zipmoe.work_slots need %s: %s, more than %s's %s; give a budget "
                 "of at least %s, or fewer pool experts or working slots", zipmoe_size_text(total), layout, budget_name(s),
                 zipmoe_size_text(s->p.budget), zipmoe_size_text(total));
        return GGML_ZIPMOE_ERR_ARG;
    }
    zipmoe_serving_log(s, 0, "ZipMoE expert cache pools: %s = %s", layout, zipmoe_size_text(total));
    return GGML_ZIPMOE_OK;
}

int ggml_zipmoe_serving_set_cache(struct ggml_zipmoe_serving * s, struct ggml_zipmoe_cache * cache, int on_gpu,
                                  char * err, size_t err_size) {
    s->cache  = cache;
    s->on_gpu = on_gpu != 0;
    if (s->info.with_pools && check_given_pools(s, err, err_size) != GGML_ZIPMOE_OK) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    // until a context says how much memory is left, the fewest slots: the graphs a context
    // reserves its buffers with then have the most passes
    s->n_slots = s->info.fewest;
    ggml_zipmoe_cache_set_n_slots(cache, s->n_slots);
    struct ggml_zipmoe_serving_plan * pl = &s->plan;
    pl->available     = s->available;
    pl->budget        = s->p.budget;
    pl->expert_bytes  = s->info.expert_bytes;
    pl->n_slots       = s->n_slots;
    pl->slot_capacity = ggml_zipmoe_cache_slot_capacity(cache);
    pl->min_slots     = s->n_slots;
    snprintf(pl->source, sizeof(pl->source), "%s", s->source);
    return GGML_ZIPMOE_OK;
}

int zipmoe_serving_use_slots(struct ggml_zipmoe_serving * s, int32_t n, struct ggml_zipmoe_default_pools * pools) {
    const int32_t old = s->n_slots;
    // experts the new pools send from C or S to F are decoded into their slots, not read again whole
    const int status = pools != NULL ? ggml_zipmoe_cache_set_pools_migrating(s->cache, pools->capacity, n,
                                                                             pools->inclusive, s->auto_threads, NULL)
                                     : ggml_zipmoe_cache_set_n_slots(s->cache, n);
    if (status != GGML_ZIPMOE_OK && status != GGML_ZIPMOE_ERR_NOMEM) {
        return status; // refused before anything changed
    }
    if (status == GGML_ZIPMOE_ERR_NOMEM) {
        // the stores could not be allocated: the cache fell back to one F pool of n slots
        zipmoe_serving_log(s, 1, "ZipMoE pools could not be made (%s): one F pool", ggml_zipmoe_cache_error(s->cache));
        snprintf(pools->why, sizeof(pools->why), "one F pool: the planned stores could not be allocated");
        memset(pools->capacity, 0, sizeof(pools->capacity));
    }
    s->n_slots = n;
    if (n < old && s->slot_base[0] != NULL) {
        // give the memory of the slots given up back to the system (whole pages within them); a change of
        // pools on slots in the serving's own mapping gave it back already, before the stores grew
        for (int k = 0; k < 3; ++k) {
            zipmoe_release_pages(s->slot_base[k] + (size_t) n * s->stride[k], (size_t) (old - n) * s->stride[k]);
        }
    }
    return GGML_ZIPMOE_OK;
}

void ggml_zipmoe_serving_get_plan(const struct ggml_zipmoe_serving * s, struct ggml_zipmoe_serving_plan * plan) {
    *plan = s->plan;
}

int ggml_zipmoe_serving_auto_pools_active(const struct ggml_zipmoe_serving * s) {
    return s->auto_active;
}

// "available ... - ... = fits": the sums of a sizing, for its log lines and errors
// on_device: a device's plan (ggml_zipmoe_serving_get_slots_plan), whose sums are its own
static void describe_sums(const struct ggml_zipmoe_serving_plan * pl, bool on_device, char * buf, size_t size) {
    if (on_device) {
        snprintf(buf, size, "available %s (%s) - its other weights, KV cache and compute buffers, a reserve and "
                 "zero slots %s = %s", zipmoe_size_text(pl->available), pl->source, zipmoe_size_text(pl->non_expert),
                 zipmoe_size_text(pl->fits));
        return;
    }
    snprintf(buf, size, "available %s (%s) - non-expert weights %s - %d context(s) %s - ZipMoE buffers %s - margin %s "
             "= %s", zipmoe_size_text(pl->available), pl->source, zipmoe_size_text(pl->non_expert), pl->n_contexts,
             zipmoe_size_text(pl->contexts), zipmoe_size_text(pl->cache_buffers), zipmoe_size_text(pl->margin), zipmoe_size_text(pl->fits));
}

// what a sizing keeps beside the slots and the contexts: the cache's own buffers for n_threads_max graph
// threads (less the stores, which are sized with the slots unless pools were given) and a margin
static void overheads(const struct ggml_zipmoe_serving * s, int32_t n_threads_max, uint64_t * cache_buffers,
                      uint64_t * margin) {
    uint64_t stores = 0;
    for (int p = GGML_ZIPMOE_POOL_C; p <= GGML_ZIPMOE_POOL_E; ++p) {
        size_t entry = 0;
        stores += (uint64_t) MAX(0, ggml_zipmoe_cache_pool_entries(s->cache, p, &entry)) * entry;
    }
    const uint64_t extra = ggml_zipmoe_cache_extra_bytes(s->cache, n_threads_max);
    *cache_buffers = s->info.with_pools || extra < stores ? extra : extra - stores;
    *margin        = (64ull << 20) + s->available / 32; // heap growth, readahead, allocator slack
}

void ggml_zipmoe_serving_overhead(const struct ggml_zipmoe_serving * s, uint64_t * cache_buffers, uint64_t * margin) {
    *cache_buffers = *margin = 0;
    if (s != NULL && s->cache != NULL) {
        overheads(s, s->n_threads_max, cache_buffers, margin);
    }
}

// the slots that fit beside everything else, into s->plan (its sizing fields) and *n_out; logs when a
// budget is cut or memory is short. ERR_ARG when pools given do not fit while making a context.
static int size_slots(struct ggml_zipmoe_serving * s, const struct ggml_zipmoe_serving_demand * d, int32_t * n_out,
                      char * err, size_t err_size) {
    const bool pools_given = s->info.with_pools;
    struct ggml_zipmoe_serving_plan pl;
    memset(&pl, 0, sizeof(pl));
    pl.available     = s->available;
    pl.non_expert    = d->non_expert;
    pl.contexts      = d->contexts;
    pl.n_contexts    = d->n_contexts;
    overheads(s, s->n_threads_max, &pl.cache_buffers, &pl.margin);
    const uint64_t fixed = d->non_expert + d->contexts + pl.cache_buffers + pl.margin;
    pl.fits          = s->available > fixed ? s->available - fixed : 0;
    pl.budget        = s->p.budget;
    pl.expert_bytes  = s->info.expert_bytes;
    pl.slot_capacity = ggml_zipmoe_cache_slot_capacity(s->cache);
    snprintf(pl.source, sizeof(pl.source), "%s", s->source);
    const int32_t capacity = pl.slot_capacity;
    pl.min_slots = pools_given || s->on_gpu ? capacity : MIN(capacity, s->p.n_expert_used);
    char sums[768];
    describe_sums(&pl, false, sums, sizeof(sums));
    int32_t n = capacity;
    if (s->on_gpu) {
        // the slots take device memory, allocated when the model loaded; the stores' host memory
        // is the cache's own buffers above
    } else if (pools_given) {
        const uint64_t need = (uint64_t) capacity * s->info.expert_bytes;
        if (need > pl.fits && d->making) {
            snprintf(err, err_size, "the ZipMoE pools need %s of slots (%d F experts per layer x %d layers + %d working "
                     "slots) beside %s of stores, but only %s is left: %s. Give smaller zipmoe.pool_* / "
                     "zipmoe.work_slots, a smaller context, or more memory", zipmoe_size_text(need), s->p.pools[0],
                     s->info.n_moe_layers, s->p.work_slots, zipmoe_size_text(pl.cache_buffers), zipmoe_size_text(pl.fits), sums);
            return GGML_ZIPMOE_ERR_ARG;
        }
    } else {
        const int32_t fit = slots_for(s, pl.fits);
        if (s->p.budget != 0) {
            if (capacity > fit) {
                n = MAX(MIN(capacity, pl.min_slots), fit);
                if (d->making) { // a freed context leaves more room, or the same: said once
                    zipmoe_serving_log(s, 1, "%s of %s does not fit: %s; using %d slots (%s)", budget_name(s),
                                       zipmoe_size_text(s->p.budget), sums, n, zipmoe_size_text((uint64_t) n * s->info.expert_bytes));
                }
            }
        } else {
            n = MIN(capacity, MAX(pl.min_slots, fit));
            if (fit < pl.min_slots && d->making) { // a freed context leaves more room, or the same
                zipmoe_serving_log(s, 1, "memory is short for the ZipMoE expert cache: %s; keeping the minimum of %d "
                                   "slots (one token's experts of a layer); weights will be paged from disk (a "
                                   "smaller context, -c or n_ctx, leaves more)", sums, n);
            }
        }
    }
    s->plan = pl;
    *n_out  = n;
    return GGML_ZIPMOE_OK;
}

// the pools for the memory left: compressed experts kept where full ones no longer fit. Returns
// true with *n set to their slots when the default pools apply; false (one F pool) with choice->why
// saying why not.
static bool choose_pools(struct ggml_zipmoe_serving * s, int32_t * n, struct ggml_zipmoe_default_pools * choice) {
    const struct ggml_zipmoe_serving_plan * pl = &s->plan;
    if (s->info.with_pools) {
        snprintf(choice->why, sizeof(choice->why), "the pools given (zipmoe.pool_* or a zipmoe-plan file)");
        return false;
    }
    if (s->info.raw) {
        snprintf(choice->why, sizeof(choice->why), "one F pool: the experts are stored raw (not BF16: nothing to "
                 "decompress, so no compressed pool)");
        return false;
    }
    if (!s->p.auto_pools) {
        snprintf(choice->why, sizeof(choice->why), "one F pool: zipmoe.auto_pools is off");
        return false;
    }
    if (s->p.eviction != GGML_ZIPMOE_EVICT_RANK) {
        snprintf(choice->why, sizeof(choice->why), "one F pool: pools dispatch by rank, and zipmoe.eviction is %s",
                 ggml_zipmoe_eviction_name(s->p.eviction));
        return false;
    }
    if (s->on_gpu) {
        // the device's slots are F and working slots; host memory keeps the other experts compressed beside
        // them from the first sizing on, so that the prompt's reads seed them; a later sizing plans them for
        // the memory then left. No re-plan: the device's pools do not follow the routing
        if (!s->p.device_stores) {
            snprintf(choice->why, sizeof(choice->why), "one F pool: the slots are in a device's memory "
                     "(zipmoe.device_stores keeps compressed experts in host memory beside them)");
            return false;
        }
        if (ggml_zipmoe_cache_device_pools(s->cache, pl->slot_capacity, pl->fits, s->p.work_slots, choice) !=
                GGML_ZIPMOE_OK ||
            choice->capacity[1] + choice->capacity[2] + choice->capacity[3] == 0) {
            return false;
        }
        *n = choice->n_slots;
        return true;
    }
    s->auto_eligible = true;
    // the rates of the first plan (the defaults, or those given): the pools change with the memory
    // left, not with each measurement of the disk
    if (s->plan_rates[0] == 0) {
        s->plan_rates[0] = ggml_zipmoe_cache_rate(s->cache, GGML_ZIPMOE_RATE_READ);
        s->plan_rates[1] = ggml_zipmoe_cache_rate(s->cache, GGML_ZIPMOE_RATE_DECODE);
    }
    s->auto_budget  = s->p.budget != 0 ? MIN(s->p.budget, pl->fits) : pl->fits;
    s->auto_threads = s->p.threads > 0 ? s->p.threads : MAX(1, s->n_threads_max);
    // the profile of the pools in use: the observed one once a re-plan adopted it (one that kept the pools
    // leaves them to change with the memory left only, not with the routing it declined to act on)
    const double * profile = s->routing.adopted && !s->routing.even ? s->routing.observed : NULL;
    // an observed profile sums to the experts its steps selected (the union of parallel sequences')
    const int32_t  k       = profile != NULL ? zipmoe_routing_step_k(s) : s->p.n_expert_used;
    if (ggml_zipmoe_cache_default_pools(s->cache, s->auto_budget, k, s->auto_threads,
                                        s->p.work_slots, s->plan_rates[0], s->plan_rates[1], profile, choice) !=
            GGML_ZIPMOE_OK ||
        choice->capacity[1] + choice->capacity[2] + choice->capacity[3] == 0) {
        return false;
    }
    if (choice->n_slots > pl->slot_capacity || choice->n_slots < pl->min_slots) {
        snprintf(choice->why, sizeof(choice->why), "one F pool: the planned %d slots are outside the %d to %d reserved",
                 choice->n_slots, pl->min_slots, pl->slot_capacity);
        memset(choice->capacity, 0, sizeof(choice->capacity));
        return false;
    }
    *n = choice->n_slots;
    return true;
}

int ggml_zipmoe_serving_resize(struct ggml_zipmoe_serving * s, const struct ggml_zipmoe_serving_demand * d,
                               int * changed_out, char * err, size_t err_size) {
    if (changed_out != NULL) {
        *changed_out = 0;
    }
    if (s->cache == NULL || d == NULL) {
        snprintf(err, err_size, "ggml_zipmoe_serving_resize: no cache");
        return GGML_ZIPMOE_ERR_ARG;
    }
    s->n_threads_max = MAX(s->n_threads_max, d->n_threads_max);
    int32_t n = 0;
    const int status = size_slots(s, d, &n, err, err_size);
    if (status != GGML_ZIPMOE_OK) {
        return status;
    }
    struct ggml_zipmoe_default_pools choice;
    memset(&choice, 0, sizeof(choice));
    bool use_pools = choose_pools(s, &n, &choice);
    if (!d->making && s->auto_active) {
        // a freed context leaves the default pools as they are: a change of pools writes memory at once
        // (experts decoded into new slots) while the context's buffers, detached first, are still
        // allocated. At the shutdown of four DeepSeek-V2-Lite sequences at 20 GiB it took 0.7 GiB within
        // 0.8 s, and the cap's OOM killer ended llama-server in about half the runs. The next context
        // made, or the next re-plan, plans for the memory left.
        use_pools = true;
        choice    = s->auto_choice;
        n         = s->n_slots;
    }
    const bool pools_changed = use_pools != s->auto_active ||
                               (use_pools && memcmp(choice.capacity, s->auto_choice.capacity, sizeof(choice.capacity)) != 0);
    const bool changed = n != s->n_slots || pools_changed;
    if (changed) {
        if (!use_pools) {
            memset(choice.capacity, 0, sizeof(choice.capacity)); // one F pool
        }
        if (zipmoe_serving_use_slots(s, n, pools_changed ? &choice : NULL) != GGML_ZIPMOE_OK) {
            snprintf(err, err_size, "%s", ggml_zipmoe_cache_error(s->cache));
            return GGML_ZIPMOE_ERR_ARG;
        }
        use_pools = choice.capacity[1] + choice.capacity[2] + choice.capacity[3] > 0;
    }
    if (use_pools && (changed || d->making)) {
        zipmoe_serving_log(s, 0, "ZipMoE expert cache pools per MoE layer: F %d, C %d, S %d, E %d, %d working slots: %s",
                           choice.capacity[0], choice.capacity[1], choice.capacity[2], choice.capacity[3],
                           n - choice.capacity[0] * s->info.n_moe_layers, choice.why);
    }
    s->auto_active = use_pools;
    s->auto_choice = choice;
    struct ggml_zipmoe_serving_plan * pl = &s->plan;
    pl->n_slots = n;
    memcpy(pl->pools, s->info.with_pools ? s->p.pools : choice.capacity, sizeof(pl->pools));
    snprintf(pl->pools_why, sizeof(pl->pools_why), "%s", choice.why);
    struct ggml_zipmoe_serving_plan slots_plan;
    ggml_zipmoe_serving_get_slots_plan(s, &slots_plan);
    char sums[768];
    describe_sums(&slots_plan, s->on_gpu, sums, sizeof(sums));
    zipmoe_serving_log(s, 0, "ZipMoE expert cache: %d of %d slots in use, %.1f MiB (%s%s%s)", n, pl->slot_capacity,
                       (double) n * s->info.expert_bytes / ZIPMOE_MIB, s->p.budget != 0 ? budget_name(s) : "",
                       s->p.budget != 0 ? "; " : "", sums);
    if (changed_out != NULL) {
        *changed_out = changed;
    }
    return GGML_ZIPMOE_OK;
}
