// Expert cache, moves between the stores that keep an expert's E-chunks when C takes an entry: an
// E-held expert promoted into C trades E parts with C's victim, and a victim of any other fill whose rank
// fell to E keeps its E-chunks in an empty E entry. Either way the victim's next use reads its
// SM-chunks, not the whole expert.

#include "cache/zipmoe-cache-impl.h"

#include <string.h>

static void swap_bytes(uint8_t * a, uint8_t * b, size_t n) {
    uint8_t tmp[4096];
    for (size_t done = 0; done < n; done += sizeof(tmp)) {
        const size_t m = n - done < sizeof(tmp) ? n - done : sizeof(tmp);
        memcpy(tmp, a + done, m);
        memcpy(a + done, b + done, m);
        memcpy(b + done, tmp, m);
    }
}

int zipmoe_store_demote_e_part(struct ggml_zipmoe_cache * c, int64_t victim, int32_t c_entry, uint64_t serial) {
    const int     layer = (int) (victim / c->layout.max_expert);
    const int32_t e     = (int32_t) (victim % c->layout.max_expert);
    struct zipmoe_store * cs = &c->pools.store[GGML_ZIPMOE_POOL_C];
    struct zipmoe_store * es = &c->pools.store[GGML_ZIPMOE_POOL_E];
    if (zipmoe_dispatch_pool(c, layer, e) != GGML_ZIPMOE_POOL_E) {
        return 0;
    }
    for (int32_t i = 0; i < es->n_entries; i++) {
        if (es->entry_key[i] < 0 && es->entry_pinned[i] != serial) {
            memcpy(es->mem + (size_t) i * es->entry_size, cs->mem + (size_t) c_entry * cs->entry_size + c->layout.sm_bytes,
                   (size_t) zipmoe_expert_e_bytes(c, layer, e));
            es->entry_key[i]           = victim;
            es->entry_last_use[i]      = cs->entry_last_use[c_entry];
            c->pools.key_pool[victim]  = GGML_ZIPMOE_POOL_E;
            c->pools.key_entry[victim] = i;
            return 1;
        }
    }
    return 0;
}

// Expert `key`, kept in E entry e_entry, is promoted into C entry c_entry, which holds `victim`.
// They trade E parts: the victim keeps its E-chunks in the promoted expert's E entry rather than
// being dropped, so its next use reads its SM-chunks only. Rank dispatch on an even profile
// promotes and demotes experts by noise, and each dropped victim cost a whole read (BENCHMARKS,
// "steady reads"). The promoted expert's E-chunks are in its C entry after this.
void zipmoe_store_trade_e_parts(struct ggml_zipmoe_cache * c, int64_t key, int32_t c_entry, int32_t e_entry, int64_t victim) {
    const int     layer   = (int) (key / c->layout.max_expert);
    const int     v_layer = (int) (victim / c->layout.max_expert);
    const int32_t e       = (int32_t) (key % c->layout.max_expert);
    const int32_t v       = (int32_t) (victim % c->layout.max_expert);
    const uint64_t a = zipmoe_expert_e_bytes(c, layer, e), b = zipmoe_expert_e_bytes(c, v_layer, v);
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
