// Expert cache, C's leftovers: a change of pools to none with C keeps the C entries it does not decode
// into F, rather than dropping them (struct zipmoe_leftovers says why). An expert used again is a C
// hit: decoded from its entry into a slot, the entry forgotten (one F pool keeps no C entry). At the
// change the weakest go until the slots' pages and the entries fit the new pools' memory; then a fill
// of a slot with no pages takes an entry's (a used one, else the weakest): its pages move into the
// next empty slots (the change's sink stays open), so the fill costs neither a read nor a first
// write's faults.
//
// Only where the slots take pages (host slots in the caller's mapping, a kernel that moves pages):
// elsewhere an entry given back would be memory freed and a new slot memory faulted in, and the count
// of both would be a guess.

#include "cache/zipmoe-cache-impl.h"

#include <stdlib.h>
#include <string.h>

int zipmoe_leftovers_keep(const struct ggml_zipmoe_cache * c, const int32_t * capacity, int migrating) {
    return migrating && capacity[GGML_ZIPMOE_POOL_C] == 0 && c->slots.take_pages && zipmoe_cache_slots_in_host(c) &&
           c->pools.store[GGML_ZIPMOE_POOL_C].n_entries > 0;
}

static size_t slot_bytes(const struct ggml_zipmoe_cache * c) {
    return c->slots.stride[0] + c->slots.stride[1] + c->slots.stride[2];
}

// slot s has its pages, or the sink's next blocks leave less than a block of it to fault in
static int slot_paged(const struct ggml_zipmoe_cache * c, int32_t s) {
    const struct zipmoe_leftovers * l = &c->pools.leftovers;
    if (s < l->paged_end) {
        return 1;
    }
    if (c->pools.sink.end <= s) {
        return 0;
    }
    for (int j = 0; j < 3; j++) {
        const uintptr_t end = (uintptr_t) (c->slots.data[j] + (size_t) (s + 1) * c->slots.stride[j]);
        if ((uintptr_t) c->pools.sink.at[j] + ZIPMOE_MOVE_BLOCK <= end) {
            return 0;
        }
    }
    return 1;
}

// the slots below the sink's blocks in every kind (they were given pages)
static int32_t sink_frontier(const struct ggml_zipmoe_cache * c) {
    int32_t lo = c->slots.n_used;
    for (int j = 0; j < 3 && c->pools.sink.end > 0; j++) {
        const int32_t s = (int32_t) ((size_t) (c->pools.sink.at[j] - c->slots.data[j]) / c->slots.stride[j]);
        lo = s < lo ? s : lo;
    }
    return c->pools.sink.end > 0 ? lo : 0;
}

// an entry's strength: the tokens that chose it, then the ubatches, then its last use
struct strength {
    int32_t  entry;
    uint64_t tokens, ubatches, last_use;
};

static int by_strength(const void * a, const void * b) { // weakest first
    const struct strength * x = (const struct strength *) a;
    const struct strength * y = (const struct strength *) b;
    if (x->tokens != y->tokens) {
        return x->tokens < y->tokens ? -1 : 1;
    }
    if (x->ubatches != y->ubatches) {
        return x->ubatches < y->ubatches ? -1 : 1;
    }
    return x->last_use < y->last_use ? -1 : x->last_use > y->last_use;
}

// the held entries, weakest first, into l->order; the rest given back (their pages into the slots)
static int order_entries(struct ggml_zipmoe_cache * c) {
    struct zipmoe_leftovers * l = &c->pools.leftovers;
    struct zipmoe_store *     s = &c->pools.store[GGML_ZIPMOE_POOL_C];
    struct strength * held = (struct strength *) malloc(sizeof(*held) * (size_t) (s->n_entries + 1));
    if (held == NULL) {
        return 0;
    }
    l->held = 0;
    for (int32_t i = 0, j; i < s->n_entries; i = j) {
        for (j = i; j < s->n_entries && s->entry_key[j] < 0; j++) {
            l->gone[j] = 1;
        }
        if (j > i) {
            zipmoe_store_release(c, GGML_ZIPMOE_POOL_C, i, j - i); // a migrant's, or the populator's pages
            continue;
        }
        const int64_t key = s->entry_key[j];
        held[l->held++] = (struct strength) { j, c->policy.selected[key], c->policy.freq[key], s->entry_last_use[j] };
        j++;
    }
    l->n_order = l->held;
    qsort(held, (size_t) l->held, sizeof(*held), by_strength);
    for (int32_t i = 0; i < l->held; i++) {
        l->order[i] = held[i].entry;
    }
    free(held);
    return 1;
}

// one entry given back (a used one first, then the weakest), none this call reads; 0: none is left
static int give_back_one(struct ggml_zipmoe_cache * c, uint64_t serial) {
    struct zipmoe_leftovers * l = &c->pools.leftovers;
    struct zipmoe_store *     s = &c->pools.store[GGML_ZIPMOE_POOL_C];
    int32_t entry = -1;
    for (int32_t i = l->next; i < l->n_order && entry < 0; i++) {
        const int32_t e = l->order[i];
        entry = !l->gone[e] && s->entry_key[e] < 0 && s->entry_pinned[e] != serial ? e : -1;
    }
    // the experts a change in progress decodes into F stay: their entries become their slots' pages
    for (int32_t i = l->next; i < l->n_order && entry < 0; i++) {
        const int32_t e     = l->order[i];
        const int     bound = s->entry_key[e] >= 0 && zipmoe_store_migrant(c, s->entry_key[e]);
        entry = !l->gone[e] && s->entry_pinned[e] != serial && !bound ? e : -1;
    }
    if (entry < 0) {
        return 0;
    }
    const uint64_t moved = atomic_load(&c->stats.moved_page_bytes);
    zipmoe_store_forget(c, GGML_ZIPMOE_POOL_C, entry);
    zipmoe_store_release(c, GGML_ZIPMOE_POOL_C, entry, 1);
    l->gone[entry] = 1;
    l->held--;
    while (l->next < l->n_order && l->gone[l->order[l->next]]) {
        l->next++;
    }
    l->memory += atomic_load(&c->stats.moved_page_bytes) - moved;
    l->memory -= l->memory > s->entry_size ? s->entry_size : l->memory;
    return 1;
}

void zipmoe_leftovers_start(struct ggml_zipmoe_cache * c) {
    struct zipmoe_leftovers * l = &c->pools.leftovers;
    struct zipmoe_store *     s = &c->pools.store[GGML_ZIPMOE_POOL_C];
    l->order = (int32_t *) malloc(sizeof(int32_t) * (size_t) (s->n_entries + 1));
    l->gone  = (uint8_t *) calloc((size_t) s->n_entries + 1, 1);
    if (l->order == NULL || l->gone == NULL || c->pools.sink.end == 0 || c->slots_lost) {
        zipmoe_leftovers_stop(c, 1); // no memory to track them, or the sink refused a move: as without
        return;
    }
    l->n_entries = s->n_entries;
    zipmoe_store_stop_populating(c, GGML_ZIPMOE_POOL_C); // its empty entries' pages go now, and stay gone
    if (!order_entries(c)) {
        zipmoe_leftovers_stop(c, 1);
        return;
    }
    int32_t filled = 0;
    for (int32_t i = 0; i < c->slots.n_used; i++) {
        filled = c->slots.key[i] >= 0 ? i + 1 : filled;
    }
    const int32_t frontier = sink_frontier(c);
    l->paged_end = c->pools.sink.first > filled ? c->pools.sink.first : filled;
    l->paged_end = frontier > l->paged_end ? frontier : l->paged_end;
    l->next   = 0;
    l->budget = (uint64_t) c->slots.n_used * slot_bytes(c);
    l->memory = (uint64_t) l->paged_end * slot_bytes(c) + (uint64_t) l->held * s->entry_size;
    l->keep   = 0;
    // within the new pools' memory from the start, but for the experts bound for F: the weakest go now
    uint64_t migrants = 0;
    for (int32_t i = 0; i < l->n_order; i++) {
        migrants += zipmoe_store_migrant(c, s->entry_key[l->order[i]]) ? s->entry_size : 0;
    }
    while (l->memory > l->budget + migrants && give_back_one(c, UINT64_MAX)) {
    }
    if (l->held == 0) {
        zipmoe_leftovers_stop(c, 1);
    }
}

void zipmoe_leftovers_make_room(struct ggml_zipmoe_cache * c, int32_t s, uint64_t serial) {
    struct zipmoe_leftovers * l = &c->pools.leftovers;
    if (l->n_entries == 0 || c->slots.key[s] >= 0) {
        return;
    }
    // an entry's pages (a used one's first, then the weakest's), whatever room the pools leave: first
    // writes faulting new pages in cost more than the entries saved (a sighting on the full Qwen1.5-MoE
    // geometry at 20 GiB, the slots faulted in while the entries stayed: 6.6 s of decoding on the
    // graphs' path against 2.2, for 2.1 GB fewer read)
    while (!slot_paged(c, s) && give_back_one(c, serial)) {
    }
    l->paged_end = s + 1 > l->paged_end ? s + 1 : l->paged_end;
}

void zipmoe_leftovers_finish(struct ggml_zipmoe_cache * c) {
    if (c->pools.leftovers.n_entries > 0 && c->pools.leftovers.held == 0) {
        zipmoe_leftovers_stop(c, 1);
    }
}

void zipmoe_leftovers_stop(struct ggml_zipmoe_cache * c, int drop) {
    struct zipmoe_leftovers * l = &c->pools.leftovers;
    const int draining = l->n_entries > 0 || l->keep;
    free(l->order);
    free(l->gone);
    memset(l, 0, sizeof(*l));
    if (draining) {
        zipmoe_sink_close(c);
        if (drop) {
            zipmoe_store_drop(c, GGML_ZIPMOE_POOL_C);
        }
    }
}
