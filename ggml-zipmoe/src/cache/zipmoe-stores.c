// Expert cache, the C, S and E stores: where an expert's stored chunks are kept between uses.
//
// Fixed-size entries in one block per store, shared by every served layer; rank dispatch (the
// pool an expert goes to after its use, paper 3.4), the entry a new expert takes, what a store
// keeps when a re-plan resizes it, where the pages of the entries it gives up go, and the pages of a
// grown store faulted in on a helper thread.

#include "cache/zipmoe-cache-impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

// the stored E bytes of one expert (gate + up + down): what its E part holds
static uint64_t expert_e_bytes(const struct ggml_zipmoe_cache * c, int layer, int32_t e) {
    uint64_t bytes = 0;
    for (int k = 0; k < 3; k++) {
        bytes += zipmoe_cache_e_bytes(c, c->layout.layer_tensor[layer * 3 + k], e);
    }
    return bytes;
}

// the largest stored E bytes of one expert (gate + up + down), and rho over the file
uint64_t zipmoe_cache_measure_e_bytes(struct ggml_zipmoe_cache * c) {
    uint64_t max_e = 0, e_total = 0, n_total = 0;
    for (int l = 0; l < c->layout.n_layer; l++) {
        if (!zipmoe_layer_served(c, l)) {
            continue;
        }
        for (int32_t e = 0; e < c->layout.layer_n_expert[l]; e++) {
            const uint64_t bytes = expert_e_bytes(c, l, e);
            n_total += c->layout.sm_bytes; // one value per SM byte
            max_e = bytes > max_e ? bytes : max_e;
            e_total += bytes;
        }
    }
    c->layout.rho = n_total > 0 ? (double) e_total / (double) n_total : 1.0;
    return max_e;
}

// rank of expert e in its layer by the tokens that chose it (0: the most chosen; ties by the ubatches
// that chose it, then id). By ubatches alone a prompt's experts tie, and a re-plan right after it
// dispatched them by id
static int32_t expert_rank(const struct ggml_zipmoe_cache * c, int layer, int32_t e) {
    const int64_t    base = (int64_t) layer * c->layout.max_expert;
    const uint64_t * t = c->policy.selected + base, * f = c->policy.freq + base;
    int32_t rank = 0;
    for (int32_t o = 0; o < c->layout.layer_n_expert[layer]; o++) {
        rank += t[o] > t[e] || (t[o] == t[e] && (f[o] > f[e] || (f[o] == f[e] && o < e)));
    }
    return rank;
}

// the pool an expert goes to after its use: the first active pool whose threshold exceeds its
// rank (paper §3.4, "Pool Dispatching"), NO_POOL beyond every threshold
int zipmoe_dispatch_pool(const struct ggml_zipmoe_cache * c, int layer, int32_t e) {
    const int32_t rank = expert_rank(c, layer, e);
    for (int i = 0; i < c->pools.n_active; i++) {
        if (rank < c->pools.threshold[c->pools.active[i]]) {
            return c->pools.active[i];
        }
    }
    return NO_POOL;
}

static void populate_ahead(struct zipmoe_store * s, int32_t entry);

// an entry of the store of pool p for a new expert: an empty one, else LFU (ties LRU); never one
// the current call reads or writes
int32_t zipmoe_store_victim(struct ggml_zipmoe_cache * c, int p, uint64_t serial) {
    struct zipmoe_store * s = &c->pools.store[p];
    int32_t victim = -1;
    for (int32_t i = 0; i < s->n_entries; i++) {
        if (s->entry_pinned[i] == serial) {
            continue;
        }
        if (s->entry_key[i] < 0) {
            populate_ahead(s, i);
            return i;
        }
        if (victim < 0) {
            victim = i;
            continue;
        }
        const uint64_t fi = c->policy.freq[s->entry_key[i]], fv = c->policy.freq[s->entry_key[victim]];
        if (fi < fv || (fi == fv && s->entry_last_use[i] < s->entry_last_use[victim])) {
            victim = i;
        }
    }
    return victim;
}

// where an entry keeps a tensor's SM-chunk and E-chunks: [SM gate][SM up][SM down][E gate][E up][E down]
// (C), [SM gate][SM up][SM down] (S), [E gate][E up][E down] (E)
uint8_t * zipmoe_store_sm(const struct ggml_zipmoe_cache * c, int p, int32_t entry, int kind) {
    if (p == GGML_ZIPMOE_POOL_E) {
        return NULL;
    }
    uint64_t off = 0;
    for (int k = 0; k < kind; k++) {
        off += c->layout.kind_n[k];
    }
    return c->pools.store[p].mem + (size_t) entry * c->pools.store[p].entry_size + off;
}

uint8_t * zipmoe_store_e(const struct ggml_zipmoe_cache * c, int p, int32_t entry, int layer, int32_t expert, int kind) {
    if (p == GGML_ZIPMOE_POOL_S) {
        return NULL;
    }
    uint64_t off = p == GGML_ZIPMOE_POOL_C ? c->layout.sm_bytes : 0;
    for (int k = 0; k < kind; k++) {
        off += zipmoe_cache_e_bytes(c, c->layout.layer_tensor[layer * 3 + k], expert);
    }
    return c->pools.store[p].mem + (size_t) entry * c->pools.store[p].entry_size + off;
}

void zipmoe_store_forget(struct ggml_zipmoe_cache * c, int p, int32_t entry) {
    const int64_t key = c->pools.store[p].entry_key[entry];
    if (key >= 0) {
        c->pools.key_pool[key]  = NO_POOL;
        c->pools.key_entry[key] = -1;
    }
    c->pools.store[p].entry_key[entry] = -1;
}

// an expert C or S holds and no slot does that is worth decoding into a slot now: one used again. A
// prompt selects most experts once; decoding those into F took most of a change's time (the full
// Qwen1.5-MoE geometry at 20 GiB moved 589 experts for the few a layer its decode steps chose), and one
// not used again never pays for it. Dropped instead, it is read on its next use, if any. S's read their
// E-chunks only (a fifth of a miss's bytes): the 8.1 GB Qwen at 50% changed from S 22 / E 37 to one F
// pool priced at 1.3 s of whole reads, and waited 25 steps for it
static int worth_moving(const struct ggml_zipmoe_cache * c, int64_t key) {
    return zipmoe_store_migrates_from(c->pools.key_pool[key]) && c->slots.of_key[key] < 0 && c->policy.freq[key] > 1;
}

int zipmoe_store_migrates_from(int p) {
    return p == GGML_ZIPMOE_POOL_C || p == GGML_ZIPMOE_POOL_S;
}

int zipmoe_store_migrant(const struct ggml_zipmoe_cache * c, int64_t key) {
    const int     layer = (int) (key / c->layout.max_expert);
    const int32_t e     = (int32_t) (key % c->layout.max_expert);
    return c->pools.migrating && worth_moving(c, key) && zipmoe_dispatch_pool(c, layer, e) == GGML_ZIPMOE_POOL_F;
}

void zipmoe_migrants_by_rank(const struct ggml_zipmoe_cache * c, int32_t * n, int32_t * from_s) {
    memset(n, 0, sizeof(int32_t) * (size_t) c->layout.max_expert);
    memset(from_s, 0, sizeof(int32_t) * (size_t) c->layout.max_expert);
    for (int l = 0; l < c->layout.n_layer; l++) {
        for (int32_t e = 0; zipmoe_layer_served(c, l) && e < c->layout.layer_n_expert[l]; e++) {
            const int64_t key = (int64_t) l * c->layout.max_expert + e;
            if (worth_moving(c, key)) {
                const int32_t rank = expert_rank(c, l, e);
                n[rank]++;
                from_s[rank] += c->pools.key_pool[key] == GGML_ZIPMOE_POOL_S;
            }
        }
    }
}

void zipmoe_sink_open(struct ggml_zipmoe_cache * c, int32_t first, int32_t end) {
    struct zipmoe_page_sink * k = &c->pools.sink;
    const uintptr_t block = ZIPMOE_MOVE_BLOCK;
    size_t blocks = 0;
    for (int j = 0; j < 3; j++) {
        const uintptr_t slot = (uintptr_t) (c->slots.data[j] + (size_t) first * c->slots.stride[j]);
        k->at[j] = (uint8_t *) (uintptr_t) zipmoe_align_up(slot, block);
        blocks += end > first ? (size_t) (end - first) * c->slots.stride[j] / block : 0;
    }
    // each block moved may be a mapping of its own: never near the process's limit on their count
    const int64_t headroom = blocks > 0 ? zipmoe_map_headroom() : -1;
    k->first = first;
    k->end   = end > first && (headroom < 0 || (size_t) headroom >= 2 * blocks + 4096) ? end : 0;
}

void zipmoe_sink_close(struct ggml_zipmoe_cache * c) {
    c->pools.sink.end = 0;
}

// whether kind j has a block left over slots all empty, passing over those on slots written since
// (k->at[j] then on it)
static int next_block(struct ggml_zipmoe_cache * c, int j) {
    struct zipmoe_page_sink * k = &c->pools.sink;
    const uintptr_t block = ZIPMOE_MOVE_BLOCK, base = (uintptr_t) c->slots.data[j], stride = c->slots.stride[j];
    for (;; k->at[j] += block) {
        const uintptr_t at = (uintptr_t) k->at[j];
        if (at + block > base + (uintptr_t) k->end * stride) {
            return 0;
        }
        int empty = 1;
        for (uintptr_t s = (at - base) / stride; s <= (at + block - 1 - base) / stride && empty; s++) {
            empty = c->slots.key[s] < 0;
        }
        if (empty) {
            return 1;
        }
    }
}

// the sink's next block to fill, *dst, in the slots of kind *kind: the kind the run's last block went to
// (*kind, -1: none) while it is at most 4 slots ahead, so that a run's blocks land side by side and make
// one mapping; else the kind furthest behind in slots (a slot's three tensors fill alike). 0 once none
// is left
static int sink_target(struct ggml_zipmoe_cache * c, uint8_t ** dst, int * kind) {
    struct zipmoe_page_sink * k = &c->pools.sink;
    double pos[3];
    int    behind = -1;
    for (int j = 0; j < 3; j++) {
        if (next_block(c, j)) {
            pos[j] = (double) ((uintptr_t) k->at[j] - (uintptr_t) c->slots.data[j]) / (double) c->slots.stride[j];
            behind = behind < 0 || pos[j] < pos[behind] ? j : behind;
        } else {
            pos[j] = -1;
        }
    }
    if (behind < 0) {
        return 0;
    }
    *kind = *kind >= 0 && pos[*kind] >= 0 && pos[*kind] <= pos[behind] + 4 ? *kind : behind;
    *dst  = k->at[*kind];
    return 1;
}

void zipmoe_sink_pages(struct ggml_zipmoe_cache * c, uint8_t * addr, size_t size) {
    const uintptr_t block = ZIPMOE_MOVE_BLOCK, lo = (uintptr_t) addr, hi = lo + size;
    const uintptr_t first = (uintptr_t) zipmoe_align_up(lo, block);
    uintptr_t       at    = first;
    int             kind  = -1;
    // block by block: [first, at) moved or given back; the whole pages around go back after
    for (; c->pools.sink.end > 0 && at + block <= hi; at += block) {
        uint8_t * dst;
        if (!zipmoe_pages_resident((void *) at, block)) {
            zipmoe_release_pages((void *) at, block); // nothing there to move (given back before, or never written)
            continue;
        }
        if (!sink_target(c, &dst, &kind)) {
            break;
        }
        const size_t moved = zipmoe_move_pages((void *) at, dst, block);
        if (moved != block) {
            zipmoe_sink_close(c); // refused (nothing moved): the rest is given back, as without a sink
            if (moved == ZIPMOE_MOVE_LOST) {
                // slot memory gone (the map count or overcommit at its limit): every fetch fails from now on
                c->slots_lost = 1;
                snprintf(c->slots_lost_why, sizeof(c->slots_lost_why), "expert cache: %zu bytes of slot memory at "
                         "%p could not be mapped again after a refused page move (vm.max_map_count or strict "
                         "overcommit at its limit): no expert can be fetched any more", (size_t) block, (void *) dst);
            }
            break;
        }
        c->pools.sink.at[kind] += block;
        atomic_fetch_add(&c->stats.moved_page_bytes, (uint64_t) block);
    }
    if (at == first) {
        zipmoe_release_pages((void *) lo, (size_t) (hi - lo));
        return;
    }
    zipmoe_release_pages((void *) lo, (size_t) (first - lo));
    zipmoe_release_pages((void *) at, (size_t) (hi - at));
}

void zipmoe_store_release(struct ggml_zipmoe_cache * c, int p, int32_t first, int32_t n) {
    const struct zipmoe_store * s = &c->pools.store[p];
    zipmoe_sink_pages(c, s->mem + (size_t) first * s->entry_size, (size_t) n * s->entry_size);
}

// a kept entry's claim to stay when its store shrinks: first the experts a migration decodes from
// C or S into F (zipmoe-migrate.c), then the entries the new pools send there, then the most chosen,
// then the most recently used
struct entry_claim {
    int32_t  entry;
    int      belongs;
    uint64_t freq, last_use;
};

static int by_claim(const void * a, const void * b) {
    const struct entry_claim * x = (const struct entry_claim *) a;
    const struct entry_claim * y = (const struct entry_claim *) b;
    if (x->belongs != y->belongs) {
        return x->belongs > y->belongs ? -1 : 1;
    }
    if (x->freq != y->freq) {
        return x->freq > y->freq ? -1 : 1;
    }
    return x->last_use > y->last_use ? -1 : x->last_use < y->last_use ? 1 : 0;
}

// store p shrinks to n_new entries: the entries with the weakest claims are forgotten, and those
// kept beyond n_new move into the holes below it (a move is a memcpy; a re-read is a disk read)
static int shrink_store(struct ggml_zipmoe_cache * c, int p, int32_t n_new) {
    struct zipmoe_store * s = &c->pools.store[p];
    if (n_new == 0) {
        for (int32_t i = 0; i < s->n_entries; i++) {
            zipmoe_store_forget(c, p, i);
        }
        if (c->pools.sink.end > 0) {
            zipmoe_store_release(c, p, 0, s->n_entries); // to a change's slots; else they go with the store
        }
        return GGML_ZIPMOE_OK;
    }
    struct entry_claim * claims = (struct entry_claim *) malloc(sizeof(*claims) * (size_t) (s->n_entries + 1));
    if (claims == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    int32_t n_held = 0;
    for (int32_t i = 0; i < s->n_entries; i++) {
        const int64_t key = s->entry_key[i];
        if (key >= 0) {
            const int     layer = (int) (key / c->layout.max_expert);
            const int32_t e     = (int32_t) (key % c->layout.max_expert);
            const int belongs = zipmoe_store_migrates_from(p) && zipmoe_store_migrant(c, key) ? 2
                              : zipmoe_dispatch_pool(c, layer, e) == p;
            claims[n_held++] = (struct entry_claim) { i, belongs, c->policy.freq[key], s->entry_last_use[i] };
        }
    }
    qsort(claims, (size_t) n_held, sizeof(*claims), by_claim);
    for (int32_t i = n_new; i < n_held; i++) {
        zipmoe_store_forget(c, p, claims[i].entry);
    }
    free(claims);
    // the tail's pages go as its kept entries are copied out, block by block, to a change's slots first:
    // a hole a migration gave back is faulted in again by its copy, and four DeepSeek-V2-Lite sequences
    // at 20 GiB, holding the whole tail meanwhile, went 2.4 GB over the pools' memory and were killed
    uint8_t * const tail = s->mem + (size_t) n_new * s->entry_size;
    uint8_t *       gone = tail; // [tail, gone): given back
    int32_t         hole = 0;
    for (int32_t i = n_new; i < s->n_entries; i++) {
        const int64_t key = s->entry_key[i];
        if (key >= 0) {
            while (s->entry_key[hole] >= 0) {
                hole++; // fewer than n_new entries are held, so a hole below n_new is found
            }
            memcpy(s->mem + (size_t) hole * s->entry_size, s->mem + (size_t) i * s->entry_size, s->entry_size);
            s->entry_key[hole]      = key;
            s->entry_last_use[hole] = s->entry_last_use[i];
            s->entry_key[i]         = -1;
            c->pools.key_entry[key] = hole;
        }
        const uintptr_t dead = (uintptr_t) (s->mem + (size_t) (i + 1) * s->entry_size) / ZIPMOE_MOVE_BLOCK * ZIPMOE_MOVE_BLOCK;
        if (dead > (uintptr_t) gone) {
            zipmoe_sink_pages(c, gone, (size_t) (dead - (uintptr_t) gone));
            gone = (uint8_t *) dead;
        }
    }
    // the rest of the tail (it goes at the realloc), the pages now
    zipmoe_sink_pages(c, gone, (size_t) (s->mem + (size_t) s->n_entries * s->entry_size - gone));
    return GGML_ZIPMOE_OK;
}

// A store's first touch of a page costs a page fault, about 3 us each on the bench VM: 13 s of a
// DeepSeek prompt filling a 17 GB store, on the decoding threads. A
// helper thread faults a grown store's pages in ahead of the fills, while the model loads and the
// prompt waits for reads. It runs free until the store's first entry is taken (the model loading: a
// prompt on an even router fills every entry faster than the populator keeps up, and without the
// head start its faults fell to the decoding threads, TTFT +20%), then keeps a window ahead of the
// entries taken (fills take the lowest empty entry) rather than faulting the whole store: the full
// Qwen1.5-MoE geometry at 20 GiB, its routing kept to few experts, faulted 16 GB in for 7.6 GB of
// fills, its zeroing on a core the graph needed for most of the first 30 steps.
// The pages are the store's own, counted in the budget already. A resize stops it after its current
// piece and has it go on from there: waiting for the whole store held each resize up (up to ~12 s),
// and starting over raced the decoding threads to the pages they had written.
#if defined(MADV_POPULATE_WRITE)
// the bytes the populator may fault in now (the window past the entries taken), waiting for more while
// it has caught up; 0 once it is halted or done
static size_t populate_next(struct zipmoe_store * s) {
    pthread_mutex_lock(&s->populate_mutex);
    while (!atomic_load(&s->populate_halt) && s->populated_to < s->populate_end &&
           s->populated_to >= s->populate_want) {
        pthread_cond_wait(&s->populate_wake, &s->populate_mutex);
    }
    const size_t want = s->populate_want < s->populate_end ? s->populate_want : s->populate_end;
    const size_t n    = atomic_load(&s->populate_halt) || want <= s->populated_to ? 0 : want - s->populated_to;
    pthread_mutex_unlock(&s->populate_mutex);
    return n;
}

static void * populate_pages(void * arg) {
    struct zipmoe_store * s = (struct zipmoe_store *) arg;
    // in pieces: each call holds the process's memory map, which the threads that map memory wait for
    const size_t piece = 16u << 20, page = 4096;
    for (size_t left; (left = populate_next(s)) > 0;) {
        size_t n = left < piece ? (left + page - 1) / page * page : piece; // whole pages from a page boundary
        n        = n < s->populate_end - s->populated_to ? n : s->populate_end - s->populated_to;
        const uint64_t t0 = zipmoe_now_ns();
        if (madvise(s->mem + s->populated_to, n, MADV_POPULATE_WRITE) != 0) {
            s->populated_to = s->populate_end; // a kernel before 5.14 refuses: the faults stay where written
            break;
        }
        s->populated_to += n;
        atomic_fetch_add(&s->counters->populate_ns, zipmoe_now_ns() - t0);
        atomic_fetch_add(&s->counters->populate_bytes, n);
    }
    return NULL;
}
#endif

// an entry taken: the populator's window moves past it (the first one ends the free run)
static void populate_ahead(struct zipmoe_store * s, int32_t entry) {
#if defined(MADV_POPULATE_WRITE)
    const int first = !s->taken;
    s->taken = 1;
    if (s->populating) {
        const size_t want = ((size_t) entry + 1) * s->entry_size + s->populate_window;
        pthread_mutex_lock(&s->populate_mutex);
        if (first || want > s->populate_want) {
            s->populate_want = want;
            pthread_cond_signal(&s->populate_wake);
        }
        pthread_mutex_unlock(&s->populate_mutex);
    }
#else
    (void) s;
    (void) entry;
#endif
}

// stops the populator after its current piece; [*from, *to) of mem is what it had left (empty: none)
static void populate_stop(struct zipmoe_store * s, size_t * from, size_t * to) {
    *from = *to = 0;
    if (s->populating) {
        pthread_mutex_lock(&s->populate_mutex);
        atomic_store(&s->populate_halt, 1);
        pthread_cond_signal(&s->populate_wake);
        pthread_mutex_unlock(&s->populate_mutex);
        pthread_join(s->populator, NULL);
        pthread_mutex_destroy(&s->populate_mutex);
        pthread_cond_destroy(&s->populate_wake);
        atomic_store(&s->populate_halt, 0);
        s->populating = 0;
        *from = s->populated_to;
        *to   = s->populate_end;
    }
}

// bytes [from, to) of s->mem, whole pages, on a helper thread (none where it cannot be made, nor where
// the headers lack MADV_POPULATE_WRITE: a thread would have nothing to do), up to window bytes past the
// entries taken; entry_size: the store's entries' as resized
static void populate_async(struct zipmoe_store * s, struct zipmoe_counters * counters, size_t from, size_t to,
                           size_t entry_size, size_t window) {
    s->counters = counters;
#if defined(MADV_POPULATE_WRITE)
    const uintptr_t page  = 4096;
    const uintptr_t base  = (uintptr_t) s->mem;
    const uintptr_t start = (base + from + page - 1) & ~(page - 1);
    const uintptr_t end   = (base + to) & ~(page - 1);
    if (end <= start) {
        return;
    }
    s->populated_to  = start - base;
    s->populate_end  = end - base;
    s->entry_size      = entry_size;
    s->populate_window = window;
    s->populate_want   = s->taken ? s->populated_to + window : s->populate_end;
    if (pthread_mutex_init(&s->populate_mutex, NULL) != 0) {
        return;
    }
    if (pthread_cond_init(&s->populate_wake, NULL) != 0) {
        pthread_mutex_destroy(&s->populate_mutex);
        return;
    }
    s->populating = pthread_create(&s->populator, NULL, populate_pages, s) == 0;
    if (!s->populating) {
        pthread_cond_destroy(&s->populate_wake);
        pthread_mutex_destroy(&s->populate_mutex);
    }
#else
    (void) from;
    (void) to;
    (void) entry_size;
    (void) window;
#endif
}

// store p's arrays to n_new entries (new ones empty); 0 frees them. [pending_from, pending_to): what a
// stopped populator had left; it goes on with that, and with the pages a growing store adds.
static int size_store(struct ggml_zipmoe_cache * c, int p, int32_t n_new, size_t entry_size, size_t pending_from,
                      size_t pending_to) {
    struct zipmoe_store * s = &c->pools.store[p];
    if (n_new == 0) {
        free(s->mem);
        free(s->entry_key);
        free(s->entry_pinned);
        free(s->entry_last_use);
        memset(s, 0, sizeof(*s));
        return GGML_ZIPMOE_OK;
    }
    // each array is replaced only once reallocated, so that a failure leaves the store as it was
    uint8_t * mem = (uint8_t *) realloc(s->mem, entry_size * (size_t) n_new);
    if (mem == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    s->mem = mem;
    zipmoe_advise_huge_pages(mem, entry_size * (size_t) n_new);
    int64_t * key = (int64_t *) realloc(s->entry_key, sizeof(int64_t) * (size_t) n_new);
    s->entry_key  = key != NULL ? key : s->entry_key;
    uint64_t * pinned = key != NULL ? (uint64_t *) realloc(s->entry_pinned, sizeof(uint64_t) * (size_t) n_new) : NULL;
    s->entry_pinned   = pinned != NULL ? pinned : s->entry_pinned;
    uint64_t * last = pinned != NULL ? (uint64_t *) realloc(s->entry_last_use, sizeof(uint64_t) * (size_t) n_new) : NULL;
    s->entry_last_use = last != NULL ? last : s->entry_last_use;
    if (last == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    for (int32_t i = s->n_entries; i < n_new; i++) {
        s->entry_key[i]      = -1;
        s->entry_last_use[i] = 0;
    }
    for (int32_t i = 0; i < n_new; i++) {
        s->entry_pinned[i] = 0;
    }
    const size_t old_bytes = s->entry_size * (size_t) s->n_entries, new_bytes = entry_size * (size_t) n_new;
    const size_t from = pending_to > pending_from ? pending_from : old_bytes;
    const size_t to   = new_bytes > old_bytes ? new_bytes : pending_to < new_bytes ? pending_to : new_bytes;
    if (to > from) {
        // two layers' entries ahead: a prompt's fetch takes up to a layer's at once
        populate_async(s, &c->stats, from, to, entry_size, 2 * (size_t) c->layout.max_expert * entry_size);
    }
    s->entry_size = entry_size;
    s->n_entries  = n_new;
    return GGML_ZIPMOE_OK;
}

int zipmoe_cache_resize_stores(struct ggml_zipmoe_cache * c, const int32_t * capacity, uint64_t max_e, char * msg,
                               size_t msg_size) {
    size_t pending[4][2];
    for (int p = GGML_ZIPMOE_POOL_C; p <= GGML_ZIPMOE_POOL_E; p++) {
        populate_stop(&c->pools.store[p], &pending[p][0], &pending[p][1]); // its pages may move or go
    }
    // the stores that shrink first, then those that grow: memory is given back before more is taken
    for (int grow = 0; grow <= 1; grow++) {
        for (int p = GGML_ZIPMOE_POOL_C; p <= GGML_ZIPMOE_POOL_E; p++) {
            struct zipmoe_store * s = &c->pools.store[p];
            int32_t n_new = capacity[p] * c->layout.n_served;
            if (zipmoe_store_migrates_from(p) && c->pools.migrating && n_new < s->n_entries) {
                // the experts bound for F stay until decoded from here (never more than the store holds now)
                for (int32_t i = 0; i < s->n_entries && n_new < s->n_entries; i++) {
                    n_new += s->entry_key[i] >= 0 && zipmoe_store_migrant(c, s->entry_key[i]);
                }
            }
            if ((n_new > s->n_entries) != grow) {
                continue;
            }
            const uint64_t size = (p != GGML_ZIPMOE_POOL_E ? c->layout.sm_bytes : 0) + (p != GGML_ZIPMOE_POOL_S ? max_e : 0);
            int status = grow ? GGML_ZIPMOE_OK : shrink_store(c, p, n_new);
            if (status == GGML_ZIPMOE_OK) {
                status = size_store(c, p, n_new, (size_t) zipmoe_align_up(size, 64), pending[p][0], pending[p][1]);
            }
            if (status != GGML_ZIPMOE_OK) {
                snprintf(msg, msg_size, "expert cache: out of memory for pool %s's %d entries of %zu bytes",
                         ggml_zipmoe_pool_name(p), n_new, (size_t) zipmoe_align_up(size, 64));
                return GGML_ZIPMOE_ERR_NOMEM;
            }
        }
    }
    return GGML_ZIPMOE_OK;
}

static void swap_bytes(uint8_t * a, uint8_t * b, size_t n) {
    uint8_t tmp[4096];
    for (size_t done = 0; done < n; done += sizeof(tmp)) {
        const size_t m = n - done < sizeof(tmp) ? n - done : sizeof(tmp);
        memcpy(tmp, a + done, m);
        memcpy(a + done, b + done, m);
        memcpy(b + done, tmp, m);
    }
}

// Expert `key`, kept in E entry e_entry, is promoted into C entry c_entry, which holds `victim`.
// They trade E parts: the victim keeps its E-chunks in the promoted expert's E entry rather than
// being dropped, so its next use reads its SM-chunks only. Rank dispatch on an even profile
// promotes and demotes experts by noise, and each dropped victim cost a whole read: the 6-layer
// uniform Qwen at 5 GiB read 1.30x what its pools imply per token before this, 1.15x after
// (docs/benchmarks/BENCHMARKS.md, "Steady reads"). The promoted expert's E-chunks are in its C entry
// after this.
void zipmoe_store_trade_e_parts(struct ggml_zipmoe_cache * c, int64_t key, int32_t c_entry, int32_t e_entry, int64_t victim) {
    const int     layer   = (int) (key / c->layout.max_expert);
    const int     v_layer = (int) (victim / c->layout.max_expert);
    const int32_t e       = (int32_t) (key % c->layout.max_expert);
    const int32_t v       = (int32_t) (victim % c->layout.max_expert);
    const uint64_t a = expert_e_bytes(c, layer, e), b = expert_e_bytes(c, v_layer, v);
    struct zipmoe_store * cs = &c->pools.store[GGML_ZIPMOE_POOL_C];
    struct zipmoe_store * es = &c->pools.store[GGML_ZIPMOE_POOL_E];
    // both parts are at least max_e_bytes long
    swap_bytes(cs->mem + (size_t) c_entry * cs->entry_size + c->layout.sm_bytes, es->mem + (size_t) e_entry * es->entry_size,
               (size_t) (a > b ? a : b));
    es->entry_key[e_entry]       = victim;
    es->entry_last_use[e_entry]  = cs->entry_last_use[c_entry];
    c->pools.key_pool[victim]    = GGML_ZIPMOE_POOL_E;
    c->pools.key_entry[victim]   = e_entry;
}
