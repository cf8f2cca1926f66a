// Expert cache, prefetch: reads ahead for the experts the caller predicts a layer will choose
// (SMoE §5.2's top-score prediction), and for the experts of a layer's next pass (known, not
// predicted: a ubatch's ids are all known at its first pass), so that the disk works while the
// graph decodes and computes.
//
// A prefetch fills one of two banks with the predicted experts the cache lacks (what each lacks:
// its SM-chunks, its E-chunks or both) and hands the bank to the I/O thread, which reads it when
// it has no fetch's reads to do. A fetch that begins stops those reads after the one in progress
// (its own reads go first), takes from the bank predicted for its layer what was read, like a
// store hit, and lets the I/O thread go on with any later bank once its own reads are handed over.
// The banks alternate, so a prefetch made while a fetch is open never writes the bank that fetch
// reads. A read that fails is not an error here: the fetch reads that chunk itself and reports it.

#include "cache/zipmoe-cache-impl.h"

#include <stdlib.h>
#include <string.h>

enum { PART_SM = 1, PART_E = 2 };

// an SM-chunk (megabytes) is read in pieces of this size, so that a fetch that begins waits for at
// most one piece before the disk is its own (O_DIRECT: a multiple of the block size)
#define PREFETCH_PIECE (1u << 20)

static int  has_work_locked(const struct ggml_zipmoe_cache * c);
static void read_locked(struct ggml_zipmoe_cache * c);

int zipmoe_prefetch_init(struct ggml_zipmoe_cache * c, int32_t predict, int32_t lookahead) {
    const int32_t capacity = predict > lookahead ? predict : lookahead;
    struct zipmoe_prefetch * pf = &c->prefetch;
    pf->latest    = -1;
    pf->consuming = -1;
    pf->bank[0].layer = pf->bank[1].layer = -1;
    const size_t n_layer = (size_t) (c->layout.n_layer > 0 ? c->layout.n_layer : 1);
    pf->recall = (uint64_t *) calloc(3 * n_layer, sizeof(uint64_t));
    if (pf->recall == NULL) {
        return GGML_ZIPMOE_ERR_NOMEM;
    }
    if (capacity <= 0 || c->layout.n_served == 0) {
        return GGML_ZIPMOE_OK;
    }
    c->pipe.has_idle_work = has_work_locked;
    c->pipe.idle_work     = read_locked;
    // more experts than a layer has would never be predicted
    pf->capacity      = capacity < c->layout.max_expert ? capacity : c->layout.max_expert;
    pf->predict_limit = predict < pf->capacity ? predict : pf->capacity;
    pf->lookahead     = lookahead < pf->capacity ? lookahead : pf->capacity;
    pf->sm_region = (size_t) zipmoe_align_up(c->file->max_sm_size, GGML_ZIPMOE_CHUNK_ALIGNMENT);
    pf->e_region  = (size_t) c->file->n_shards * zipmoe_cache_e_region_bytes(c);
    for (int b = 0; b < 2; b++) {
        pf->bank[b].predicted = (int32_t *) malloc(sizeof(int32_t) * (size_t) c->layout.max_expert);
        pf->bank[b].entries   = (struct zipmoe_prefetch_entry *) calloc((size_t) pf->capacity,
                                                                        sizeof(struct zipmoe_prefetch_entry));
        if (pf->bank[b].predicted == NULL || pf->bank[b].entries == NULL) {
            return GGML_ZIPMOE_ERR_NOMEM;
        }
    }
    return GGML_ZIPMOE_OK;
}

void zipmoe_prefetch_free(struct ggml_zipmoe_cache * c) {
    struct zipmoe_prefetch * pf = &c->prefetch;
    for (int b = 0; b < 2; b++) {
        free(pf->bank[b].predicted);
        free(pf->bank[b].entries);
        free(pf->bank[b].mem);
    }
    free(pf->recall);
}

// bytes of one entry's part for a kind: its SM-chunk, then its E-chunks
static size_t kind_region(const struct zipmoe_prefetch * pf) {
    return pf->sm_region + pf->e_region;
}

size_t zipmoe_prefetch_bytes(const struct ggml_zipmoe_cache * c) {
    const struct zipmoe_prefetch * pf = &c->prefetch;
    return pf->capacity > 0 ? 2 * (size_t) pf->capacity * 3 * kind_region(pf) : 0;
}

static uint8_t * entry_sm(const struct zipmoe_prefetch * pf, const struct zipmoe_prefetch_bank * bank, int i, int kind) {
    return bank->mem + ((size_t) i * 3 + (size_t) kind) * kind_region(pf);
}

static uint8_t * entry_e(const struct zipmoe_prefetch * pf, const struct zipmoe_prefetch_bank * bank, int i, int kind) {
    return entry_sm(pf, bank, i, kind) + pf->sm_region;
}

// the fetching thread: the I/O thread starts no prefetch read until zipmoe_prefetch_resume_locked,
// and with wait, has finished the one in progress (the banks may then be rewritten). A fetch does
// not wait: it takes only parts marked ready, and its own reads follow the piece in progress.
void zipmoe_prefetch_pause(struct ggml_zipmoe_cache * c, int wait) {
    struct zipmoe_prefetch * pf = &c->prefetch;
    if (pf->capacity == 0) {
        return;
    }
    atomic_store(&pf->interrupt, 1);
    if (!wait) {
        return;
    }
    pthread_mutex_lock(&c->pipe.io_lock);
    while (pf->active) {
        pthread_cond_wait(&pf->idle, &c->pipe.io_lock);
    }
    pthread_mutex_unlock(&c->pipe.io_lock);
}

void zipmoe_prefetch_resume_locked(struct ggml_zipmoe_cache * c) {
    atomic_store(&c->prefetch.interrupt, 0);
}

static int has_work_locked(const struct ggml_zipmoe_cache * c) {
    const struct zipmoe_prefetch * pf = &c->prefetch;
    return pf->capacity > 0 && pf->pending && pf->latest >= 0 && !atomic_load(&pf->interrupt);
}

// a fetch of `layer` begins (paused): it takes from the bank predicted for it; that bank's reads
// not done by now are dropped, since the fetch reads what it still lacks itself
void zipmoe_prefetch_claim(struct ggml_zipmoe_cache * c, int layer) {
    struct zipmoe_prefetch * pf = &c->prefetch;
    pf->consuming = -1;
    if (pf->capacity == 0 || pf->latest < 0) {
        return; // no prefetch yet
    }
    for (int i = 0; i < 2 && pf->consuming < 0; i++) {
        const int b = i == 0 ? pf->latest : 1 - pf->latest; // the latest first
        if (pf->bank[b].layer == layer) {
            pf->consuming = b;
        }
    }
    if (pf->consuming >= 0 && pf->consuming == pf->latest) {
        pthread_mutex_lock(&c->pipe.io_lock);
        pf->pending = 0;
        pthread_mutex_unlock(&c->pipe.io_lock);
    }
}

void zipmoe_prefetch_release(struct ggml_zipmoe_cache * c) {
    c->prefetch.consuming = -1;
}

// recall of the prediction, at a layer's first pass of a ubatch
void zipmoe_prefetch_score(struct ggml_zipmoe_cache * c, int layer, const int32_t * unique, int n_unique) {
    struct zipmoe_prefetch * pf = &c->prefetch;
    if (pf->consuming < 0 || pf->bank[pf->consuming].scored) {
        return;
    }
    struct zipmoe_prefetch_bank * bank = &pf->bank[pf->consuming];
    bank->scored = 1;
    uint64_t correct = 0;
    for (int i = 0; i < n_unique; i++) {
        for (int j = 0; j < bank->n_predicted; j++) {
            correct += bank->predicted[j] == unique[i];
        }
    }
    uint64_t * r = pf->recall + (size_t) layer * 3;
    __atomic_fetch_add(&r[0], (uint64_t) bank->n_predicted, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r[1], (uint64_t) n_unique, __ATOMIC_RELAXED);
    __atomic_fetch_add(&r[2], correct, __ATOMIC_RELAXED);
}

// a task of the planning fetch that reads: what the claimed bank read for it becomes its source,
// and the task reads the rest. Returns 1 if it took anything.
int zipmoe_prefetch_supply(struct ggml_zipmoe_cache * c, struct zipmoe_task * t) {
    struct zipmoe_prefetch * pf = &c->prefetch;
    if (pf->consuming < 0 || t->state == GGML_ZIPMOE_STATE_C || t->state == GGML_ZIPMOE_STATE_F) {
        return 0;
    }
    struct zipmoe_prefetch_bank * bank = &pf->bank[pf->consuming];
    int i = 0;
    while (i < bank->n_entries && bank->entries[i].expert != t->expert) {
        i++;
    }
    if (i == bank->n_entries) {
        return 0;
    }
    struct zipmoe_prefetch_entry * en = &bank->entries[i];
    const int ready = atomic_load(&en->ready[t->kind]);
    int took = 0;
    if (t->sm_src == NULL && (ready & PART_SM)) {
        t->sm_src = entry_sm(pf, bank, i, t->kind);
        took |= PART_SM;
    }
    if (t->e_src == NULL && (ready & PART_E)) {
        t->e_src = entry_e(pf, bank, i, t->kind);
        took |= PART_E;
    }
    if (took == 0) {
        return 0;
    }
    // what is in memory now decides the reads, as for a store hit
    t->state = t->sm_src != NULL && t->e_src != NULL ? GGML_ZIPMOE_STATE_C
             : t->sm_src != NULL                     ? GGML_ZIPMOE_STATE_S
                                                     : GGML_ZIPMOE_STATE_E;
    const int fresh = took & ~en->used[t->kind]; // counted once, however often a bank is taken from
    en->used[t->kind] |= (uint8_t) took;
    uint64_t used = 0;
    if (fresh & PART_SM) {
        used += zipmoe_file_chunk(c->file, t->tensor, t->expert, 0)->size;
    }
    if (fresh & PART_E) {
        used += zipmoe_cache_e_bytes(c, t->tensor, t->expert);
    }
    atomic_fetch_add(&pf->bytes_used, used);
    return 1;
}

// I/O thread: a fetch began (interrupt), or posted reads the I/O thread has not done
static int yield_to_fetch(struct ggml_zipmoe_cache * c) {
    return atomic_load(&c->prefetch.interrupt) || atomic_load(&c->pipe.io_job) != atomic_load(&c->pipe.io_done);
}

// I/O thread: the SM-chunk of an entry's kind, piece by piece from where it stopped; 1 when read
// and checked, 0 when a fetch interrupted it, -1 when the read failed
static int read_sm_pieces(struct ggml_zipmoe_cache * c, struct zipmoe_prefetch_bank * bank, int i, int kind) {
    struct zipmoe_prefetch * pf = &c->prefetch;
    struct zipmoe_prefetch_entry * en = &bank->entries[i];
    const int32_t tensor = c->layout.layer_tensor[bank->layer * 3 + kind];
    const struct zipmoe_chunk * ch = zipmoe_file_chunk(c->file, tensor, en->expert, 0);
    uint8_t * mem = entry_sm(pf, bank, i, kind);
    while (en->sm_read[kind] < ch->size) {
        if (yield_to_fetch(c)) {
            return 0;
        }
        const uint64_t off = en->sm_read[kind];
        const struct zipmoe_chunk piece = { ch->offset + off, ch->size - off < PREFETCH_PIECE ? ch->size - off : PREFETCH_PIECE, 0, 0 };
        int sys_errno = 0;
        const uint64_t t0 = zipmoe_now_ns();
        const int status = zipmoe_read_chunk_unchecked(c->file, &piece, mem + off, pf->sm_region - off, &sys_errno);
        atomic_fetch_add(&c->stats.io_ns, zipmoe_now_ns() - t0);
        if (status != GGML_ZIPMOE_OK) {
            return -1;
        }
        atomic_fetch_add(&c->stats.bytes_read, piece.size);
        atomic_fetch_add(&pf->bytes_read, piece.size);
        en->sm_read[kind] += piece.size;
    }
    if (ggml_zipmoe_checksum(mem, ch->size) != ch->checksum) {
        return -1;
    }
    atomic_fetch_or(&en->ready[kind], PART_SM); // publishes the bytes
    return 1;
}

// I/O thread: an entry's E-chunks (one span read where they lie back to back, well under a
// megabyte), then packed back to back (as a store keeps them); 1 when read and checked, -1 if not
static int read_e(struct ggml_zipmoe_cache * c, struct zipmoe_prefetch_bank * bank, int i, int kind) {
    struct zipmoe_prefetch * pf = &c->prefetch;
    struct zipmoe_prefetch_entry * en = &bank->entries[i];
    const int32_t tensor = c->layout.layer_tensor[bank->layer * 3 + kind];
    const int     K      = c->file->n_shards;
    uint64_t base = UINT64_MAX;
    int bad = 0, sys_errno = 0;
    uint8_t * mem = entry_e(pf, bank, i, kind);
    const size_t region = pf->e_region / (size_t) K;
    if (zipmoe_read_chunks(c, tensor, en->expert, 1, K, mem, region, 1, &base, &bad, &sys_errno) != GGML_ZIPMOE_OK) {
        return -1; // left to the fetch, which reads it again and names the chunk if it fails again
    }
    uint8_t * dst = mem;
    uint64_t stored = 0;
    for (int k = 1; k <= K; k++) {
        const struct zipmoe_chunk * ch = zipmoe_file_chunk(c->file, tensor, en->expert, k);
        const uint8_t * src = base != UINT64_MAX ? mem + (ch->offset - base) : mem + (size_t) (k - 1) * region;
        memmove(dst, src, ch->size);
        dst += ch->size;
        stored += ch->size;
    }
    atomic_fetch_add(&pf->bytes_read, stored);
    atomic_fetch_or(&en->ready[kind], PART_E); // publishes the bytes
    return 1;
}

// I/O thread (active set): the latest bank's reads in order, until done or a fetch interrupts
static void read_latest_bank(struct ggml_zipmoe_cache * c) {
    struct zipmoe_prefetch * pf = &c->prefetch;
    struct zipmoe_prefetch_bank * bank = &pf->bank[pf->latest];
    for (int i = 0; i < bank->n_entries; i++) {
        struct zipmoe_prefetch_entry * en = &bank->entries[i];
        for (int kind = 0; kind < 3; kind++) {
            for (int part = PART_SM; part <= PART_E; part <<= 1) {
                const int needed = part == PART_SM ? en->need_sm : en->need_e;
                if (!needed || (atomic_load(&en->ready[kind]) & part)) {
                    continue;
                }
                if (yield_to_fetch(c)) {
                    return; // pending stays: the rest is read when the fetch's reads are done
                }
                const int got = part == PART_SM ? read_sm_pieces(c, bank, i, kind) : read_e(c, bank, i, kind);
                if (got == 0) {
                    return;
                }
                if (got < 0) {
                    // not retried: left to the fetch, which reads it again and names the chunk if it fails again
                    if (part == PART_SM) {
                        en->need_sm = 0;
                    } else {
                        en->need_e = 0;
                    }
                }
            }
        }
    }
    pthread_mutex_lock(&c->pipe.io_lock);
    pf->pending = 0;
    pthread_mutex_unlock(&c->pipe.io_lock);
}

// the I/O thread's idle work (under io_lock, returned held): the latest bank's reads, active meanwhile
static void read_locked(struct ggml_zipmoe_cache * c) {
    c->prefetch.active = 1;
    pthread_mutex_unlock(&c->pipe.io_lock);
    read_latest_bank(c);
    pthread_mutex_lock(&c->pipe.io_lock);
    c->prefetch.active = 0;
    pthread_cond_broadcast(&c->prefetch.idle);
}

void zipmoe_prefetch_reset_stats(struct ggml_zipmoe_cache * c) {
    struct zipmoe_prefetch * pf = &c->prefetch;
    atomic_store(&pf->hits, 0);
    atomic_store(&pf->bytes_read, 0);
    atomic_store(&pf->bytes_used, 0);
    for (int i = 0; i < 3 * (c->layout.n_layer > 0 ? c->layout.n_layer : 1); i++) {
        __atomic_store_n(&pf->recall[i], 0, __ATOMIC_RELAXED);
    }
}

// under the cache's lock: the experts of ids, in order, into the bank no open fetch reads; up to limit of
// those the cache lacks get entries, which the I/O thread reads when it has no fetch's reads left
// (resume: from now; else once the caller's fetch has posted its own). predicted: the ids are a
// prediction, whose recall the layer's first fetch scores.
static int post_bank(struct ggml_zipmoe_cache * c, int layer, const int32_t * ids, int64_t n_used, int64_t n_tokens,
                     int64_t ids_stride, int32_t limit, int predicted, int resume) {
    struct zipmoe_prefetch * pf = &c->prefetch;
    int status = zipmoe_cache_start_io(c);
    const int target = pf->consuming >= 0 ? 1 - pf->consuming : pf->latest < 0 ? 0 : 1 - pf->latest;
    struct zipmoe_prefetch_bank * bank = &pf->bank[target];
    if (status == GGML_ZIPMOE_OK && bank->mem == NULL) {
        void * mem = NULL;
        if (posix_memalign(&mem, GGML_ZIPMOE_CHUNK_ALIGNMENT, (size_t) pf->capacity * 3 * kind_region(pf)) != 0) {
            status = GGML_ZIPMOE_ERR_NOMEM;
        }
        bank->mem = (uint8_t *) mem;
    }
    if (status != GGML_ZIPMOE_OK) {
        return status;
    }
    zipmoe_prefetch_pause(c, 1);
    bank->layer       = layer;
    bank->n_entries   = 0;
    bank->n_predicted = 0;
    bank->scored      = !predicted;
    const int32_t n_expert = c->layout.layer_n_expert[layer];
    uint8_t * seen = c->plan.seen; // the planning scratch: no fetch plans while this runs
    memset(seen, 0, (size_t) n_expert);
    const int64_t base = (int64_t) layer * c->layout.max_expert;
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            const int32_t e = ids[t * ids_stride + k];
            if (seen[e]) {
                continue;
            }
            seen[e] = 1;
            bank->predicted[bank->n_predicted++] = e;
            const int pool = c->pools.key_pool[base + e];
            if (c->slots.of_key[base + e] >= 0 || pool == GGML_ZIPMOE_POOL_C || bank->n_entries == limit) {
                continue; // resident, or no room left
            }
            struct zipmoe_prefetch_entry * en = &bank->entries[bank->n_entries++];
            en->expert  = e;
            en->need_sm = pool != GGML_ZIPMOE_POOL_S;
            en->need_e  = pool != GGML_ZIPMOE_POOL_E;
            for (int kind = 0; kind < 3; kind++) {
                atomic_store(&en->ready[kind], 0);
                en->used[kind]    = 0;
                en->sm_read[kind] = 0;
            }
        }
    }
    pthread_mutex_lock(&c->pipe.io_lock);
    pf->latest  = target;
    pf->pending = bank->n_entries > 0;
    if (resume) {
        zipmoe_prefetch_resume_locked(c);
        pthread_cond_signal(&c->pipe.io_wake);
    }
    pthread_mutex_unlock(&c->pipe.io_lock);
    return GGML_ZIPMOE_OK;
}

int ggml_zipmoe_cache_prefetch(struct ggml_zipmoe_cache * c, int layer, const int32_t * ids, int64_t n_used,
                               int64_t n_tokens, int64_t ids_stride) {
    if (c == NULL || c->prefetch.predict_limit == 0 || !zipmoe_layer_served(c, layer) || ids == NULL ||
        n_used < 1 || n_tokens < 1 || ids_stride < n_used) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const int32_t n_expert = c->layout.layer_n_expert[layer];
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t k = 0; k < n_used; k++) {
            if (ids[t * ids_stride + k] < 0 || ids[t * ids_stride + k] >= n_expert) {
                return GGML_ZIPMOE_ERR_ARG;
            }
        }
    }
    // residency is read under the cache's lock, which the caller holds if it has a fetch open
    const int own = c->fetch_open && pthread_equal(c->fetch_owner, pthread_self());
    if (!own) {
        pthread_mutex_lock(&c->lock);
    }
    const int status = post_bank(c, layer, ids, n_used, n_tokens, ids_stride, c->prefetch.predict_limit, 1, 1);
    if (!own) {
        pthread_mutex_unlock(&c->lock);
    }
    return status;
}

// thread 0 of a fetch, under the lock, after planning pass `pass`: the experts of the next pass, if
// the ubatch has one, into a bank, read once this fetch's own reads are done. A failure (no memory
// for a bank) only leaves the next pass to read them itself.
void zipmoe_prefetch_next_pass(struct ggml_zipmoe_cache * c, int layer, int pass) {
    const int width = zipmoe_cache_pass_width(c);
    const int next  = (pass + 1) * width;
    if (c->prefetch.lookahead == 0 || next >= c->plan.n_unique) {
        return;
    }
    const int n = c->plan.n_unique - next < width ? c->plan.n_unique - next : width;
    // post_bank marks experts in c->plan.seen, which planning has finished with
    post_bank(c, layer, c->plan.unique + next, n, 1, n, c->prefetch.lookahead, 0, 0);
}

int ggml_zipmoe_cache_get_prefetch_recall(const struct ggml_zipmoe_cache * c, int layer, uint64_t * predicted,
                                          uint64_t * actual, uint64_t * correct) {
    if (c == NULL || predicted == NULL || actual == NULL || correct == NULL ||
        (layer != -1 && !zipmoe_layer_served(c, layer))) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    *predicted = *actual = *correct = 0;
    for (int l = 0; l < c->layout.n_layer; l++) {
        if (layer == -1 || l == layer) {
            *predicted += __atomic_load_n(&c->prefetch.recall[l * 3 + 0], __ATOMIC_RELAXED);
            *actual    += __atomic_load_n(&c->prefetch.recall[l * 3 + 1], __ATOMIC_RELAXED);
            *correct   += __atomic_load_n(&c->prefetch.recall[l * 3 + 2], __ATOMIC_RELAXED);
        }
    }
    return GGML_ZIPMOE_OK;
}
