// ZipMoE fork: the graph's side of the glue (llama-zipmoe.h): the experts' products on the slots,
// the fetch, merge, prefetch and substitution ops, and how a failed fetch stops a graph.

#include "llama-zipmoe.h"

#include "llama-context.h"
#include "llama-model.h"
#include "llama-impl.h"

#include "ggml-zipmoe.h"

#include <algorithm>
#include <cstring>

llama_zipmoe::op_args * llama_zipmoe::args_for(int il, int pass, bool offloaded, bool with_cpu) {
    std::lock_guard<std::mutex> lock(state_mutex);
    const int64_t key = ((int64_t) il << 32 | (uint32_t) pass << 2 | (uint32_t) with_cpu << 1 | (uint32_t) offloaded);
    auto it = args_index.find(key);
    if (it != args_index.end()) {
        return it->second;
    }
    args.push_back({ this, set_of(il), il, pass, offloaded, with_cpu });
    args_index[key] = &args.back();
    return &args.back();
}

void llama_zipmoe::fail(const char * message) {
    if (!failed.exchange(true)) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        failure = message;
    }
}

// no correct output is possible without the expert: the graph stops (abort_callback) and the
// message, which names the chunk at fault, reaches the caller
static void zipmoe_check(const llama_zipmoe::op_args * a, int status) {
    if (status != GGML_ZIPMOE_OK) {
        a->zm->fail(ggml_zipmoe_cache_error(a->set->cache));
    }
}

static void zipmoe_fetch_begin_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const auto *        a   = (const llama_zipmoe::op_args *) userdata;
    const ggml_tensor * ids = dst->src[0];
    int32_t *           out = (int32_t *) dst->data;
    // whatever happens, the products never see an out-of-range id: a failed fetch computes nothing
    for (int64_t i = 0; i < ggml_nelements(dst); ++i) {
        out[i] = GGML_ZIPMOE_NO_SLOT;
    }
    const ggml_tensor * scores = a->pass == 0 ? dst->src[1] : nullptr; // zipmoe.eviction=score
    if (scores != nullptr) {
        ggml_zipmoe_cache_observe_scores(a->set->cache, a->il, (const float *) scores->data, scores->ne[0], scores->ne[1],
                                         scores->nb[1] / sizeof(float));
    }
    // with the CPU computing: [2][n_tokens][n_used], the device's slot ids, then the CPU's
    int32_t * cpu_out = a->with_cpu ? out + ids->ne[0] * ids->ne[1] : nullptr;
    zipmoe_check(a, ggml_zipmoe_cache_fetch_begin_cpu(a->set->cache, a->il, a->pass, (const int32_t *) ids->data,
                                                      ids->ne[0], ids->ne[1], ids->nb[1] / sizeof(int32_t), out,
                                                      cpu_out));
}

// passes the slot ids on once the slots are filled, so that the products depend on it
static void zipmoe_fetch_end_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto * a = (const llama_zipmoe::op_args *) userdata;
    zipmoe_check(a, ggml_zipmoe_cache_fetch_end(a->set->cache, ith, nth));
    if (ith == 0) {
        memcpy(dst->data, dst->src[0]->data, ggml_nbytes(dst));
        if (a->set->absent_slot(0, 1, a->offloaded) != GGML_ZIPMOE_NO_SLOT) { // products a GPU runs
            int32_t * ids = (int32_t *) dst->data;
            for (int64_t i = 0; i < dst->ne[0] * dst->ne[1]; ++i) { // the device's ids (the CPU's skip theirs)
                ids[i] = ids[i] == GGML_ZIPMOE_NO_SLOT ? a->set->absent_slot(i, dst->ne[0], a->offloaded) : ids[i];
            }
        }
    }
}

static void zipmoe_merge_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const auto *        a    = (const llama_zipmoe::op_args *) userdata;
    const ggml_tensor * ids  = dst->src[0];
    const ggml_tensor * cur  = dst->src[1];
    const ggml_tensor * acc  = dst->src[2];
    // build_experts made these tensors alike; a graph that breaks that stops with an error
    if (!ggml_are_same_shape(cur, dst) || !ggml_are_same_stride(cur, dst) ||
        (acc != nullptr && (!ggml_are_same_shape(acc, dst) || !ggml_are_same_stride(acc, dst)))) {
        a->zm->fail(format("layer %d, pass %d: the merged products differ in shape", a->il, a->pass).c_str());
        return;
    }
    const int status = ggml_zipmoe_cache_merge_pass(a->set->cache, a->il, a->pass, (const int32_t *) ids->data,
                                                    ids->ne[0], ids->ne[1], ids->nb[1] / sizeof(int32_t),
                                                    acc ? acc->data : nullptr, cur->data, dst->data,
                                                    ggml_row_size(dst->type, dst->ne[0]), dst->nb[1], dst->nb[2]);
    if (status != GGML_ZIPMOE_OK) {
        a->zm->fail(format("layer %d, pass %d: merging the passes' products failed: %s", a->il, a->pass,
                           ggml_zipmoe_status_string(status)).c_str());
    }
}

// a pass's products with the CPU computing some experts: the CPU's rows where it computed them (its slot id
// >= 0), the device's for the rest
static void zipmoe_take_cpu_rows_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const auto *        a       = (const llama_zipmoe::op_args *) userdata;
    const ggml_tensor * cpu_ids = dst->src[0];
    const ggml_tensor * dev     = dst->src[1];
    const ggml_tensor * cpu     = dst->src[2];
    if (!ggml_are_same_shape(dev, dst) || !ggml_are_same_shape(cpu, dst) || dev->type != dst->type ||
        cpu->type != dst->type || cpu_ids->ne[0] != dst->ne[1] || cpu_ids->ne[1] != dst->ne[2]) {
        a->zm->fail(format("layer %d, pass %d: the CPU's and the device's products differ in shape", a->il,
                           a->pass).c_str());
        return;
    }
    const size_t row = ggml_row_size(dst->type, dst->ne[0]);
    for (int64_t t = 0; t < dst->ne[2]; ++t) {
        for (int64_t k = 0; k < dst->ne[1]; ++k) {
            const int32_t     s   = *(const int32_t *) ((const char *) cpu_ids->data + t * cpu_ids->nb[1] + k * cpu_ids->nb[0]);
            const ggml_tensor * src = s >= 0 ? cpu : dev;
            memcpy((char *) dst->data + t * dst->nb[2] + k * dst->nb[1],
                   (const char *) src->data + t * src->nb[2] + k * src->nb[1], row);
        }
    }
}

static void zipmoe_prefetch_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    const auto *        a   = (const llama_zipmoe::op_args *) userdata;
    const ggml_tensor * ids = dst->src[0];
    if (ith == 0) {
        // advisory: a prediction that cannot be read ahead (ERR_ARG) costs the fetch nothing
        ggml_zipmoe_cache_prefetch(a->set->cache, a->il, (const int32_t *) ids->data, ids->ne[0], ids->ne[1],
                                   ids->nb[1] / sizeof(int32_t));
    }
}

// the substitution hook (lossy, opt-in): the router's ids with the cache's policy applied
static void zipmoe_substitute_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const auto *        a      = (const llama_zipmoe::op_args *) userdata;
    const ggml_tensor * ids    = dst->src[0];
    const ggml_tensor * scores = dst->src[1];
    const int status = ggml_zipmoe_cache_substitute(a->set->cache, a->il, (const float *) scores->data, scores->ne[0],
                                                    scores->nb[1] / sizeof(float), (const int32_t *) ids->data,
                                                    ids->ne[0], ids->ne[1], ids->nb[1] / sizeof(int32_t),
                                                    (int32_t *) dst->data);
    if (status != GGML_ZIPMOE_OK) {
        for (int64_t i = 0; i < ggml_nelements(dst); ++i) { // in range: the graph stops (fail) before the products
            ((int32_t *) dst->data)[i] = 0;
        }
        a->zm->fail(format("layer %d: expert substitution failed: %s", a->il, ggml_zipmoe_status_string(status)).c_str());
    }
}

ggml_tensor * llama_zipmoe::substitute(ggml_context * ctx0, int il, ggml_tensor * probs, ggml_tensor * selected,
                                      ggml_tensor ** weight_ids) {
    const llama_zipmoe_slot_set * set = set_of(il);
    ggml_zipmoe_cache * cache = set != nullptr ? set->cache : nullptr;
    if ((opt.substitution == GGML_ZIPMOE_SUBST_NONE && !opt.trace_routing) || cache == nullptr || !ggml_zipmoe_cache_has_layer(cache, il) ||
        probs == nullptr || probs->type != GGML_TYPE_F32 || selected->type != GGML_TYPE_I32 ||
        ggml_n_dims(probs) > 2 || probs->ne[0] != ggml_zipmoe_cache_n_expert(cache, il) ||
        probs->ne[1] != selected->ne[1] || probs->nb[0] != sizeof(float) || selected->nb[0] != sizeof(int32_t)) {
        return selected;
    }
    ggml_tensor * srcs[2] = { selected, probs };
    ggml_tensor * out = ggml_custom_4d(ctx0, GGML_TYPE_I32, selected->ne[0], selected->ne[1], 1, 1, srcs, 2,
                                       zipmoe_substitute_op, 1, args_for(il, 0));
    ggml_format_name(out, "zipmoe_substitute-%d", il);
    // BuddyMoE's Alg. 1 rewrites the expert indices only: a buddy computes with the weight the router
    // gave the expert it stands in for. SMoE's router chooses its alternatives: they weigh their own scores
    if (weight_ids != nullptr && opt.substitution == GGML_ZIPMOE_SUBST_BUDDY) {
        *weight_ids = selected;
    }
    return out;
}

// SMoE's top-score prediction: the next MoE layer's router applied to this layer's FFN input, taken
// to the next layer's FFN norm (RMS norm is per-token scale-invariant and top-k ignores a positive
// scale, so the ratio of the two norms' weights is all that differs). The residual stream changes
// little from one layer to the next, so the top-k of these scores mostly names the experts the next
// router will choose. The op runs after this layer's fetch began: its reads go after the fetch's.
void llama_zipmoe::build_prefetch(ggml_context * ctx0, ggml_cgraph * gf, int il, ggml_tensor * ffn_inp,
                                  ggml_tensor * after, int64_t n_used) {
    int next = il + 1;
    while (next < (int) gate_inp.size() && gate_inp[next] == nullptr) {
        ++next;
    }
    if (!opt.prefetch || next >= (int) gate_inp.size() || ffn_inp == nullptr || ffn_inp->ne[1] != 1 ||
        !ggml_is_contiguous(ffn_inp) || gate_inp[next]->ne[0] != ffn_inp->ne[0]) {
        return;
    }
    ggml_tensor * x = ggml_reshape_2d(ctx0, ffn_inp, ffn_inp->ne[0], ffn_inp->ne[2]);
    if (ffn_norm[il] != nullptr && ffn_norm[next] != nullptr && ggml_are_same_shape(ffn_norm[il], ffn_norm[next]) &&
        ffn_norm[il]->ne[0] == x->ne[0] && ffn_norm[il]->type == GGML_TYPE_F32 && ffn_norm[next]->type == GGML_TYPE_F32) {
        x = ggml_mul(ctx0, x, ggml_div(ctx0, ffn_norm[next], ffn_norm[il]));
    }
    ggml_tensor * scores = ggml_mul_mat(ctx0, gate_inp[next], x); // [n_expert, n_tokens]
    const int64_t k = std::min<int64_t>(n_used, scores->ne[0]);
    ggml_tensor * predicted = ggml_argsort_top_k(ctx0, scores, (int) k);
    ggml_tensor * srcs[2] = { predicted, after };
    ggml_tensor * op = ggml_custom_4d(ctx0, GGML_TYPE_I32, 1, 1, 1, 1, srcs, 2, zipmoe_prefetch_op, 1, args_for(next, 0));
    ggml_format_name(op, "zipmoe_prefetch-%d", next);
    ggml_build_forward_expand(gf, op);
}

bool llama_zipmoe::resident_bases(const llama_zipmoe_slot_set & set, std::vector<int32_t> & base) {
    base.assign(gate_inp.size(), -1);
    bool any = false;
    for (int il = 0; il < (int) base.size(); ++il) {
        if (set_of(il) != &set || !ggml_zipmoe_cache_has_layer(set.cache, il)) {
            continue;
        }
        base[il] = ggml_zipmoe_cache_resident_base(set.cache, il);
        if (base[il] < 0) {
            return false; // one layer fetching could evict another's experts from under its views
        }
        any = true;
    }
    return any;
}

std::array<ggml_tensor *, 3> llama_zipmoe::resident_weights_of(ggml_context * ctx0, int il, int32_t base) {
    auto it = resident_weights.find({ il, base });
    if (it != resident_weights.end()) {
        return it->second;
    }
    const llama_zipmoe_slot_set * set = set_of(il);
    const int64_t n_expert = ggml_zipmoe_cache_n_expert(set->cache, il);
    ggml_init_params params = { /*.mem_size =*/ 3 * ggml_tensor_overhead(), /*.mem_buffer =*/ nullptr,
                                /*.no_alloc =*/ true };
    ggml_context * rc = ggml_init(params);
    std::array<ggml_tensor *, 3> w = {};
    bool placed = rc != nullptr;
    for (int k = 0; k < 3 && placed; ++k) {
        ggml_tensor * s = set->slots_of(il, k);
        w[k] = ggml_new_tensor_3d(rc, s->type, s->ne[0], s->ne[1], n_expert);
        w[k]->nb[1] = s->nb[1];
        w[k]->nb[2] = s->nb[2];
        w[k]->nb[3] = s->nb[2] * (size_t) n_expert;
        ggml_format_name(w[k], "zipmoe.resident.%s-%d", k_zipmoe_kinds[k], il);
        placed = ggml_backend_tensor_alloc(s->buffer, w[k], (char *) s->data + (size_t) base * s->nb[2]) ==
                 GGML_STATUS_SUCCESS;
    }
    if (placed) {
        resident_ctxs.push_back(rc);
        resident_weights[{ il, base }] = w;
        return w;
    }
    // no memory for the tensors' metadata, or a buffer that will not place them: views in the graph's
    // context, which cost only the backend's fusion
    ggml_free(rc);
    for (int k = 0; k < 3; ++k) {
        ggml_tensor * s = set->slots_of(il, k);
        w[k] = ggml_view_3d(ctx0, s, s->ne[0], s->ne[1], n_expert, s->nb[1], s->nb[2], (size_t) base * s->nb[2]);
        ggml_format_name(w[k], "zipmoe.resident.%s-%d", k_zipmoe_kinds[k], il);
    }
    return w;
}

// whether ggml's scheduler runs a product on host slots on another backend: its offload of an op on
// host weights to a backend that wants it (ggml_backend_sched_backend_id_from_cur), asked of the same
// functions with a mul_mat_id of the pass's shape on the slots
static bool products_offloaded(ggml_backend_sched_t sched, bool op_offload, ggml_tensor * slots, int64_t n_used,
                               int64_t n_tokens) {
    if (!op_offload || sched == nullptr || slots == nullptr || slots->buffer == nullptr ||
        !ggml_backend_buffer_is_host(slots->buffer)) {
        return false;
    }
    ggml_init_params params = { /*.mem_size =*/ 3 * ggml_tensor_overhead(), /*.mem_buffer =*/ nullptr,
                                /*.no_alloc =*/ true };
    ggml_context * probe = ggml_init(params);
    if (probe == nullptr) {
        return false;
    }
    ggml_tensor * b   = ggml_new_tensor_3d(probe, GGML_TYPE_F32, slots->ne[0], 1, n_tokens);
    ggml_tensor * ids = ggml_new_tensor_2d(probe, GGML_TYPE_I32, n_used, n_tokens);
    ggml_tensor * op  = ggml_mul_mat_id(probe, slots, b, ids);
    bool offloaded = false;
    const int n_backends = ggml_backend_sched_get_n_backends(sched);
    for (int i = 0; i + 1 < n_backends && !offloaded; ++i) { // the last is the CPU's, the slots' own
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
        offloaded = ggml_backend_supports_op(backend, op) && ggml_backend_offload_op(backend, op);
    }
    ggml_free(probe);
    return offloaded;
}

ggml_tensor * llama_zipmoe::build_experts(ggml_context * ctx0, ggml_cgraph * gf, int il, ggml_tensor * ffn_inp,
                                          ggml_tensor * selected_experts, ggml_tensor * probs,
                                          const experts_fn & build, bool * deferred, ggml_backend_sched_t sched,
                                          bool op_offload) {
    const int64_t n_used   = selected_experts->ne[0];
    const int64_t n_tokens = selected_experts->ne[1];
    llama_zipmoe_slot_set * set = set_of(il);
    ggml_zipmoe_cache * cache = set->cache;
    int32_t view_base = -1;
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        built[gf] = layout;
        if (views_layout != layout) {
            // once per slot layout: every layer of a set in place, or none of the set's used in place
            views_base.assign(gate_inp.size(), -1);
            for (const auto & s : sets) {
                std::vector<int32_t> base;
                if (s->views_wanted && resident_bases(*s, base)) {
                    for (size_t l = 0; l < base.size() && l < views_base.size(); ++l) {
                        views_base[l] = set_of((int) l) == s.get() ? base[l] : views_base[l];
                    }
                }
            }
            views_layout = layout;
        }
        if (set->views_wanted && il < (int) views_base.size()) {
            view_base = views_base[il];
        }
    }
    if (view_base >= 0) {
        // every expert resident, in order: stock's products on the slots in place, no fetch op (nothing
        // is read or evicted while every layer is in place; a resize changes the layout and rebuilds)
        std::array<ggml_tensor *, 3> w;
        {
            std::lock_guard<std::mutex> lock(state_mutex);
            w = resident_weights_of(ctx0, il, view_base);
        }
        *deferred = false;
        return build(selected_experts, w[0], w[1], w[2]);
    }
    *deferred = true;
    const int n_passes = ggml_zipmoe_cache_n_passes(cache, il, n_used * n_tokens);
    const bool offloaded = !set->on_device && set->zero_slots > 0 &&
                           (test_offloaded_passes || products_offloaded(sched, op_offload, set->slots_of(il, 0), n_used,
                                                                        n_tokens));
    // the CPU computes what the balancer gives it, unless ggml's scheduler would run those products on a GPU
    const bool with_cpu = set->n_cpu_slots > 0 &&
                          !products_offloaded(sched, op_offload, set->cpu_slots_of(il, 0), n_used, n_tokens);
    if (probs != nullptr && probs->ne[0] == 1 && ggml_is_contiguous(probs)) {
        probs = ggml_reshape_2d(ctx0, probs, probs->ne[1], probs->ne[2]); // build_moe_ffn's [1, n_expert, n_tokens]
    }
    ggml_tensor * scores = opt.eviction == GGML_ZIPMOE_EVICT_SCORE && probs != nullptr && probs->type == GGML_TYPE_F32 &&
                           probs->ne[1] == n_tokens && probs->ne[0] == ggml_zipmoe_cache_n_expert(cache, il) ? probs : nullptr;

    ggml_tensor * merged = nullptr;
    for (int pass = 0; pass < n_passes; ++pass) {
        // a pass's fetch must wait for the previous pass's products: they share the slots; the first
        // takes the router's scores when the eviction policy is score's
        ggml_tensor * second = pass > 0 ? merged : scores;
        ggml_tensor * srcs[2] = { selected_experts, second };
        op_args * a = args_for(il, pass, offloaded, with_cpu);
        ggml_tensor * begin = ggml_custom_4d(ctx0, GGML_TYPE_I32, n_used, n_tokens, with_cpu ? 2 : 1, 1, srcs,
                                             second ? 2 : 1, zipmoe_fetch_begin_op, 1, a);
        ggml_format_name(begin, "zipmoe_fetch_begin-%d.%d", il, pass);
        if (pass == 0) {
            ggml_build_forward_expand(gf, begin);
            build_prefetch(ctx0, gf, il, ffn_inp, begin, n_used);
        }
        ggml_tensor * slot_ids = ggml_custom_4d(ctx0, GGML_TYPE_I32, n_used, n_tokens, with_cpu ? 2 : 1, 1, &begin, 1,
                                                zipmoe_fetch_end_op, GGML_N_TASKS_MAX, a);
        ggml_format_name(slot_ids, "zipmoe_slot_ids-%d.%d", il, pass);
        ggml_tensor * out = with_cpu ? build_with_cpu(ctx0, il, pass, slot_ids, a, build)
                                     : build(slot_ids, set->slots_of(il, 0), set->slots_of(il, 1), set->slots_of(il, 2));
        if (n_passes == 1) {
            return out;
        }
        ggml_tensor * msrcs[3] = { selected_experts, out, merged };
        merged = ggml_custom_4d(ctx0, out->type, out->ne[0], out->ne[1], out->ne[2], out->ne[3], msrcs, merged ? 3 : 2,
                                zipmoe_merge_op, 1, a);
        ggml_format_name(merged, "zipmoe_merged-%d.%d", il, pass);
    }
    return merged;
}

// a pass's products where the CPU computes some experts: the device's on its slots (the ids' first plane),
// the CPU's on its own (the second), the rows taken from where each was computed
ggml_tensor * llama_zipmoe::build_with_cpu(ggml_context * ctx0, int il, int pass, ggml_tensor * slot_ids, op_args * a,
                                           const experts_fn & build) {
    const llama_zipmoe_slot_set * set = set_of(il);
    const int64_t n_used = slot_ids->ne[0], n_tokens = slot_ids->ne[1];
    ggml_tensor * dev_ids = ggml_view_2d(ctx0, slot_ids, n_used, n_tokens, slot_ids->nb[1], 0);
    ggml_tensor * cpu_ids = ggml_view_2d(ctx0, slot_ids, n_used, n_tokens, slot_ids->nb[1], slot_ids->nb[2]);
    ggml_tensor * dev = build(dev_ids, set->slots_of(il, 0), set->slots_of(il, 1), set->slots_of(il, 2));
    ggml_tensor * cpu = build(cpu_ids, set->cpu_slots_of(il, 0), set->cpu_slots_of(il, 1), set->cpu_slots_of(il, 2));
    ggml_tensor * srcs[3] = { cpu_ids, dev, cpu };
    ggml_tensor * out = ggml_custom_4d(ctx0, dev->type, dev->ne[0], dev->ne[1], dev->ne[2], dev->ne[3], srcs, 3,
                                       zipmoe_take_cpu_rows_op, 1, a);
    ggml_format_name(out, "zipmoe_cpu_rows-%d.%d", il, pass);
    return out;
}

uint32_t llama_zipmoe::graph_extra_nodes(uint32_t n_tokens, uint32_t n_expert_used_max) const {
    uint32_t total = 0;
    for (int i = 0; i < ggml_zipmoe_file_n_tensors(file); ++i) {
        if (strstr(ggml_zipmoe_file_tensor_name(file, i), "ffn_down_exps") == nullptr) {
            continue;
        }
        const int il = ggml_zipmoe_file_tensor_layer(file, i);
        const llama_zipmoe_slot_set * set = set_of(il);
        if (set == nullptr || set->cache == nullptr) {
            continue;
        }
        ggml_zipmoe_cache * cache = set->cache;
        // the narrowest pass resize ever makes (the fewest slots in use with one F pool, the working
        // slots with pools): a graph reserved now stays big enough after it
        const int32_t capacity = ggml_zipmoe_cache_slot_capacity(cache);
        const int64_t fewest   = std::min<int64_t>(opt.with_pools() ? capacity : std::min(capacity, n_expert_used),
                                                   std::max(1, opt.work_slots));
        const int64_t n_ids    = (int64_t) n_tokens * n_expert_used_max;
        const int64_t distinct = std::min<int64_t>(n_ids, ggml_zipmoe_cache_n_expert(cache, il));
        const int64_t passes   = std::max<int64_t>(1, (distinct + fewest - 1) / fewest);
        // fetch begin and end + merge + the ~16 nodes of one experts block, per pass; the prefetch's
        // reshape, norm ratio (div, mul), scores, argsort, top-k view and op
        // with the CPU computing: its products (as many again), the two id views and the row op
        total += (set->n_cpu_slots > 0 ? 38u : 19u) * (uint32_t) passes + (opt.prefetch ? 8u : 0u) +
                 (opt.substitution != GGML_ZIPMOE_SUBST_NONE || opt.trace_routing ? 1u : 0u);
    }
    return total;
}

std::unique_lock<std::mutex> llama_zipmoe::lock_compute(llama_context * lctx, bool batched) {
    std::unique_lock<std::mutex> lock(compute_mutex);
    // no fetch is open between graphs: the balancer may take the time on this graph's threads
    const int n_threads = (int) (batched ? llama_n_threads_batch(lctx) : llama_n_threads(lctx));
    for (const auto & set : sets) {
        if (set->n_cpu_slots > 0 && !set->time_cpu_products(std::max(1, n_threads))) {
            LLAMA_LOG_WARN("%s: zipmoe.cpu_compute: the CPU's products on %d threads could not be measured: the "
                           "balancer keeps the time it had, %.2f ms an expert a token\n", __func__, n_threads,
                           set->cpu_token_s * 1e3);
        }
    }
    graph_start_us = ggml_time_us(); // the graph's whole time, for the account of a token (finish_compute)
    return lock;
}

bool llama_zipmoe::graph_is_current(const ggml_cgraph * gf) const {
    std::lock_guard<std::mutex> lock(state_mutex);
    auto it = built.find(gf);
    return it != built.end() && it->second == layout;
}

// the rpc-server of the model's devices that stopped answering (patch 0020), or "": its part of the graph did
// not run, and what came back from it is zeros
static std::string lost_rpc_server(const llama_model & model) {
    for (const llama_device & d : model.devices) {
        ggml_backend_reg_t reg = d.dev ? ggml_backend_dev_backend_reg(d.dev) : nullptr;
        if (reg == nullptr || strcmp(ggml_backend_reg_name(reg), "RPC") != 0) {
            continue;
        }
        auto device_lost = (bool (*)(ggml_backend_dev_t)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_device_lost");
        if (device_lost && device_lost(d.dev)) {
            return std::string(ggml_backend_dev_description(d.dev)) + " (" + ggml_backend_dev_name(d.dev) + ")";
        }
    }
    return "";
}

ggml_status llama_zipmoe::finish_compute(llama_context * lctx, ggml_status status, const llama_token * tokens,
                                         uint32_t n_tokens, uint32_t n_seqs) {
    // a graph stopped between a fetch's begin and end (by the user's abort callback, or a failed
    // begin) left the fetch open: its reads stop and its slots are forgotten
    for (const auto & set : sets) {
        ggml_zipmoe_cache_cancel(set->cache);
    }
    if (graph_start_us >= 0 && !sets.empty()) {
        // the graph's whole time, counted once: in the first set's statistics
        ggml_zipmoe_cache_count_graph(sets[0]->cache, (uint64_t) (ggml_time_us() - graph_start_us) * 1000u);
        graph_start_us = -1;
    }
    context_state & st = state_of(lctx);
    st.error.clear();
    if (failed.load()) {
        {
            std::lock_guard<std::mutex> lock(failure_mutex);
            st.error = "ZipMoE: " + failure;
            failure.clear();
        }
        failed.store(false);
        LLAMA_LOG_ERROR("%s: %s\n", __func__, st.error.c_str());
        return GGML_STATUS_FAILED;
    }
    const std::string lost = lost_rpc_server(llama_get_model(lctx)[0]);
    if (!lost.empty()) {
        st.error = "RPC server " + lost + ": connection lost (it stopped or crashed); the layers it held did not "
                   "run. Restart it and load the model again";
        LLAMA_LOG_ERROR("%s: %s\n", __func__, st.error.c_str());
        return GGML_STATUS_FAILED;
    }
    if (status == GGML_STATUS_SUCCESS) {
        // the routing seen may re-plan the default pools (state_mutex: memory_plan reads the sizing)
        std::lock_guard<std::mutex> lock(state_mutex);
        // graphs built for the old slots are rebuilt
        for (const auto & set : sets) {
            ggml_zipmoe_serving_observe_tokens(set->serving, tokens, (int32_t) n_tokens, (int32_t) n_seqs);
            layout += ggml_zipmoe_serving_observe(set->serving, (int32_t) n_tokens, (int32_t) n_seqs);
        }
    }
    return status;
}

bool llama_zipmoe::abort_callback(void * data) {
    const auto * st = (const context_state *) data;
    return st->zm->failed.load(std::memory_order_relaxed) || (st->user_callback && st->user_callback(st->user_data));
}

void * llama_zipmoe::wrap_abort_callback(llama_context * lctx, ggml_abort_callback user_callback, void * user_data) {
    context_state & st = state_of(lctx);
    st.user_callback = user_callback;
    st.user_data     = user_data;
    return &st;
}

const char * llama_zipmoe::last_error(const llama_context * lctx) {
    std::lock_guard<std::mutex> lock(state_mutex);
    auto it = contexts.find(lctx);
    return it == contexts.end() ? "" : it->second->error.c_str();
}
