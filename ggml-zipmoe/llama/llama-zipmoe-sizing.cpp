// ZipMoE fork: the memory the expert cache may take (llama-zipmoe.h): the non-expert weights counted when
// the model loads, the context size when none is given, the slots sized again whenever a context is made
// or freed, and the plan llama.h reports. The sizing itself is ggml-zipmoe's (ggml-zipmoe-serving.h).

#include "llama-zipmoe.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <map>
#include <stdexcept>

void llama_zipmoe::check_model(const llama_model & model) {
    gate_inp.assign(model.layers.size(), nullptr);
    ffn_norm.assign(model.layers.size(), nullptr);
    for (size_t il = 0; il < model.layers.size(); ++il) {
        const llama_layer & l = model.layers[il];
        if (l.ffn_down_exps == nullptr || of(l.ffn_down_exps) != this) {
            continue;
        }
        gate_inp[il] = l.ffn_gate_inp;
        ffn_norm[il] = l.ffn_norm;
        // biases are added by expert id (build_moe_ffn_experts' bias_experts) and stay where they are;
        // scales are taken by the products' ids, which are slot ids here (zipmoe_py/families.py refuses
        // the same at conversion)
        const bool unsupported = l.ffn_gate_up_exps || l.ffn_gate_up_exps_b || l.ffn_gate_exps_s || l.ffn_up_exps_s ||
                                 l.ffn_down_exps_s;
        if (unsupported) {
            throw std::runtime_error(format("%s: layer %zu's routed experts have per-expert scales or a merged gate_up "
                                            "tensor, which ZipMoE's expert slots do not serve", fname.c_str(), il));
        }
    }
    // the weights a decode step reads from host memory: all but the token embedding, of which it
    // reads a row per token (unless the output matrix is the embedding itself)
    non_expert_bytes = 0;
    for (const auto & [name, t] : model.tensors_by_name) {
        if (t == model.tok_embd && model.output != nullptr && model.output != model.tok_embd) {
            continue;
        }
        // host memory: mapped or allocated, and ggml-cpu's repacking buffers (a quantized model's weights
        // copied out of the mapping, resident), which do not call themselves host buffers
        if (t->buffer != nullptr && !ggml_backend_buffer_is_host(t->buffer) &&
            !llama_zipmoe_is_cpu_extra_buft(ggml_backend_buffer_get_type(t->buffer))) {
            continue;
        }
        non_expert_bytes += ggml_nbytes(t);
    }
}

// upstream common's fit_params_min_ctx: the least context its fit gives a model that does not fit
static constexpr uint32_t k_unset_context_floor = 4096;

// one token's KV cells, as llama_kv_cache lays them out (MLA keeps no V of its own)
// the bytes of a context's KV cache, as llama.cpp makes it: a cell per token in each layer, but a sliding-window
// layer's cells bounded by llama_zipmoe_kv_shape
struct kv_cache_model {
    uint64_t full_row = 0; // a token's K and V rows in the layers that keep every cell
    uint64_t swa_row  = 0; // in the sliding-window layers
    uint32_t n_swa    = 0;
    llama_zipmoe_kv_shape shape;

    kv_cache_model(const llama_hparams & hparams, ggml_type type_k, ggml_type type_v, const llama_zipmoe_kv_shape & s)
        : n_swa(hparams.n_swa), shape(s) {
        for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
            uint64_t row = ggml_row_size(type_k, hparams.n_embd_k_gqa(il));
            if (!hparams.is_mla()) {
                row += ggml_row_size(type_v, hparams.n_embd_v_gqa(il));
            }
            (hparams.is_swa(il) && !s.swa_full ? swa_row : full_row) += row;
        }
    }

    uint32_t n_streams() const { // a unified cache is one stream for every sequence
        return shape.unified ? 1 : std::max<uint32_t>(1, shape.n_seq_max);
    }

    uint64_t swa_cells(uint32_t n_ctx) const { // llama_kv_cache_iswa's size_swa, over its streams
        const uint64_t window = (uint64_t) n_swa * (shape.unified ? shape.n_seq_max : 1) + shape.n_ubatch;
        return GGML_PAD(std::min<uint64_t>(n_ctx / n_streams(), window), 256) * n_streams();
    }

    uint64_t bytes(uint32_t n_ctx) const {
        return (uint64_t) n_ctx * full_row + (swa_row > 0 ? swa_cells(n_ctx) * swa_row : 0);
    }

    // the largest context of a multiple of 256 tokens whose cache takes at most `bytes` (UINT32_MAX: any)
    uint32_t fits_in(uint64_t bytes) const {
        if (full_row == 0) {
            return UINT32_MAX;
        }
        const uint64_t swa = swa_row > 0 ? swa_cells(UINT32_MAX) * swa_row : 0; // the sliding layers' most
        return bytes > swa ? (uint32_t) std::min<uint64_t>((bytes - swa) / full_row / 256 * 256, UINT32_MAX) : 0;
    }
};

// the peak heap of loading a vocabulary, per token: Qwen2's (151,936 tokens, 151,387 merges) took about
// 35 MiB beyond the file's metadata, measured with llama-completion under memory cgroups
static constexpr uint64_t k_vocab_bytes_per_token = 240;
// heap growth and allocator slack beside the vocabulary and beside a context's KV cache (compute buffers
// are touched in part): below these, the kernel killed a tiny model's runs
static constexpr uint64_t k_load_slack    = 8ull << 20;
static constexpr uint64_t k_context_slack = 16ull << 20;

// what a hard memory limit (a cgroup's) leaves this process now, with the heap the allocator holds free
// (a model loaded and freed before, as common's fit does, leaves its vocabulary's heap to the next);
// UINT64_MAX where none applies
static uint64_t hard_limit_headroom(ggml_zipmoe_memory & mem) {
    if (ggml_zipmoe_memory_available(nullptr, &mem) != GGML_ZIPMOE_OK || mem.cgroup_limit == UINT64_MAX) {
        return UINT64_MAX;
    }
    uint64_t free_heap = 0;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
    free_heap = mallinfo2().fordblks;
#endif
    return (mem.cgroup_limit > mem.cgroup_used ? mem.cgroup_limit - mem.cgroup_used : 0) + free_heap;
}

static std::string hard_limit_text(const ggml_zipmoe_memory & mem, uint64_t headroom) {
    return format("the memory limit of its cgroup (v%d %s: %s, %s in use) leaves %s (with the heap's free bytes)",
                  mem.cgroup_version, mem.cgroup_path, llama_zipmoe_size_text(mem.cgroup_limit).c_str(),
                  llama_zipmoe_size_text(mem.cgroup_used).c_str(), llama_zipmoe_size_text(headroom).c_str());
}

void llama_zipmoe::check_load_fits() const {
    const uint64_t vocab = n_vocab * k_vocab_bytes_per_token;
    ggml_zipmoe_memory mem;
    const uint64_t headroom = hard_limit_headroom(mem);
    if (headroom < vocab + k_load_slack) {
        throw std::runtime_error(format("%s cannot be loaded: %s, and loading its vocabulary's tables alone takes about %s "
                                        "(%" PRId64 " tokens); the kernel would kill the process. Raise the limit",
                                        fname.c_str(), hard_limit_text(mem, headroom).c_str(),
                                        llama_zipmoe_size_text(vocab + k_load_slack).c_str(),
                                        (int64_t) n_vocab));
    }
}

void llama_zipmoe::check_context_fits(const llama_hparams & hparams, uint32_t n_ctx, ggml_type type_k,
                                      ggml_type type_v, const llama_zipmoe_kv_shape & shape) const {
    const kv_cache_model kv(hparams, type_k, type_v, shape);
    ggml_zipmoe_memory mem;
    const uint64_t headroom = hard_limit_headroom(mem);
    const ggml_zipmoe_serving_plan plan = serving_plan();
    const uint64_t slots = (uint64_t) std::max(1, n_expert_used) * info.expert_bytes;
    const uint64_t need  = kv.bytes(n_ctx) + plan.cache_buffers + slots + k_context_slack;
    if (headroom >= need) {
        return;
    }
    const uint64_t other = need - kv.bytes(n_ctx);
    const uint32_t fits  = headroom > other ? std::min(kv.fits_in(headroom - other), n_ctx) : 0;
    throw std::runtime_error(format("a context of %u tokens does not fit: %s, and it needs %s: its KV cache %s, the "
                                    "expert cache's buffers %s, one token's experts %s and %s of slack; the kernel "
                                    "would kill the process. %s, or raise the limit", n_ctx,
                                    hard_limit_text(mem, headroom).c_str(), llama_zipmoe_size_text(need).c_str(),
                                    llama_zipmoe_size_text(kv.bytes(n_ctx)).c_str(),
                                    llama_zipmoe_size_text(plan.cache_buffers).c_str(),
                                    llama_zipmoe_size_text(slots).c_str(),
                                    llama_zipmoe_size_text(k_context_slack).c_str(),
                                    fits > 0 ? format("Give a smaller context (-c %u or less fits)", (unsigned) fits).c_str()
                                             : "No context fits"));
}

uint32_t llama_zipmoe::unset_context_size(const llama_hparams & hparams, ggml_type type_k, ggml_type type_v,
                                          const llama_zipmoe_kv_shape & shape) const {
    const uint32_t n_train = hparams.n_ctx_train;
    if (n_train == 0 || hparams.is_recr(0)) {
        return n_train; // a recurrent state: no cell per token
    }
    const kv_cache_model kv(hparams, type_k, type_v, shape);
    // as upstream's fit (common/fit.cpp) sizes an unset context: what the model leaves of the memory,
    // at least its floor of 4096 tokens. The model here is the non-expert weights and every expert in a
    // slot: each expert slot speeds decoding up, while KV cells are only ever used by a long context.
    // Beside them the sizing keeps the cache's buffers and a margin, and the context its compute buffer,
    // mostly a ubatch's F32 logits; the margin counts twice, for what the process takes before the slots
    // are sized (a program that loads the model a second time, after upstream fit's dry run, has 18 MiB
    // more resident then). Without them a trained context that fits beside every expert leaves the slots
    // a few experts short of all, and the preload, which fills only all, reads nothing
    const ggml_zipmoe_serving_plan plan = serving_plan();
    ggml_zipmoe_serving_info info;
    ggml_zipmoe_serving_get_info(serving, &info);
    uint64_t cache_buffers = 0, margin = 0;
    ggml_zipmoe_serving_overhead(serving, &cache_buffers, &margin);
    const uint64_t logits   = 4 * n_vocab * shape.n_outputs;
    const uint64_t overhead = cache_buffers + 2 * margin + logits;
    const uint64_t left     = plan.available > non_expert_bytes ? plan.available - non_expert_bytes : 0;
    const uint64_t experts  = (uint64_t) info.n_experts * info.expert_bytes; // every expert in a slot
    const uint64_t taken    = experts + overhead;
    const uint64_t spare    = left > taken ? left - taken : 0;
    if (kv.bytes(n_train) <= spare) {
        return n_train; // stock's unset context: the trained one, shared by the streams
    }
    // fit's floor is per stream (a context of several sequences, each with its own cells)
    const uint32_t floor_ctx = (uint32_t) std::min<uint64_t>((uint64_t) std::min(k_unset_context_floor, n_train) *
                                                             kv.n_streams(), UINT32_MAX);
    const uint32_t n = std::min(n_train, std::max<uint32_t>(floor_ctx, kv.fits_in(spare)));
    LLAMA_LOG_INFO("%s: ZipMoE: no context size given: %u tokens (a KV cache of %s), not the trained %u (%s): as "
                   "upstream's fit, the context gets what the model leaves, at least %u tokens, and here the model's "
                   "experts (%s) take all but %s of the %s left beside the non-expert weights, the expert cache's "
                   "buffers, twice its margin and a ubatch's logits (%s); give -c / n_ctx for another\n", __func__, n,
                   llama_zipmoe_size_text(kv.bytes(n)).c_str(), n_train, llama_zipmoe_size_text(kv.bytes(n_train)).c_str(),
                   floor_ctx, llama_zipmoe_size_text(experts).c_str(), llama_zipmoe_size_text(spare).c_str(),
                   llama_zipmoe_size_text(left).c_str(), llama_zipmoe_size_text(overhead).c_str());
    return n;
}

void llama_zipmoe::resize(const llama_context * making) {
    std::lock_guard<std::mutex> compute(compute_mutex);
    ggml_zipmoe_serving_demand demand = {};
    demand.non_expert = non_expert_bytes;
    demand.making     = making != nullptr;
    std::lock_guard<std::mutex> lock(state_mutex);
    for (const auto & [c, st] : contexts) {
        if (st->attached) {
            demand.contexts += st->host_bytes;
            demand.n_contexts++;
        }
    }
    demand.n_threads_max = n_threads_max;
    // the sets in devices' memory first: their caches' buffers (and CPU slots) are in host memory, beside the host
    // set's slots
    std::vector<llama_zipmoe_slot_set *> order;
    for (const auto & set : sets) {
        order.push_back(set.get());
    }
    std::stable_partition(order.begin(), order.end(), [](const llama_zipmoe_slot_set * s) { return s->on_device; });
    uint64_t device_sets_buffers = 0;
    for (llama_zipmoe_slot_set * set : order) {
        ggml_zipmoe_serving_demand d = demand;
        if (!set->on_device) {
            d.contexts += device_sets_buffers;
        }
        int changed = 0;
        char err[2048];
        if (ggml_zipmoe_serving_resize(set->serving, &d, &changed, err, sizeof(err)) != GGML_ZIPMOE_OK) {
            throw std::runtime_error(sets.size() > 1 ? format("%s's expert slots: %s", set->device_name(), err) : err);
        }
        layout += changed; // graphs built for another slot count must be rebuilt
        if (set->on_device) {
            uint64_t buffers = 0, margin = 0;
            ggml_zipmoe_serving_overhead(set->serving, &buffers, &margin);
            // and the host slots of the experts the CPU computes beside the device's (zipmoe.cpu_compute)
            device_sets_buffers += buffers + (set->cpu_buf != nullptr ? ggml_backend_buffer_get_size(set->cpu_buf) : 0);
        }
    }
    sized = true;
}

ggml_zipmoe_serving_plan llama_zipmoe::serving_plan() const {
    const llama_zipmoe_slot_set * set = primary();
    if (set != nullptr) {
        return serving_plan(*set);
    }
    std::lock_guard<std::mutex> lock(state_mutex);
    ggml_zipmoe_serving_plan p;
    ggml_zipmoe_serving_get_plan(serving, &p);
    p.non_expert = non_expert_bytes; // no context made yet
    return p;
}

ggml_zipmoe_serving_plan llama_zipmoe::serving_plan(const llama_zipmoe_slot_set & set, bool slots_memory) const {
    std::lock_guard<std::mutex> lock(state_mutex);
    ggml_zipmoe_serving_plan p;
    if (slots_memory && set.on_device) {
        ggml_zipmoe_serving_get_slots_plan(set.serving, &p); // its device's memory, sized at load
        return p;
    }
    ggml_zipmoe_serving_get_plan(set.serving, &p);
    if (!sized) {
        p.non_expert = non_expert_bytes; // no context made yet
    }
    return p;
}

static llama_zipmoe_memory_plan to_memory_plan(const ggml_zipmoe_serving_plan & p) {
    static_assert(sizeof(p.source) == sizeof(llama_zipmoe_memory_plan::source) &&
                  sizeof(p.pools_why) == sizeof(llama_zipmoe_memory_plan::pools_why), "plan fields differ");
    llama_zipmoe_memory_plan out = {};
    out.available     = p.available;
    out.non_expert    = p.non_expert;
    out.contexts      = p.contexts;
    out.cache_buffers = p.cache_buffers;
    out.margin        = p.margin;
    out.fits          = p.fits;
    out.budget        = p.budget;
    out.expert_bytes  = p.expert_bytes;
    out.n_contexts    = p.n_contexts;
    out.n_slots       = p.n_slots;
    out.slot_capacity = p.slot_capacity;
    out.min_slots     = p.min_slots;
    memcpy(out.source, p.source, sizeof(out.source));
    std::copy(p.pools, p.pools + 4, out.pools);
    memcpy(out.pools_why, p.pools_why, sizeof(out.pools_why));
    return out;
}

llama_zipmoe_memory_plan llama_zipmoe::memory_plan() const {
    return to_memory_plan(serving_plan());
}

bool llama_model_zipmoe_cache_memory_plan(const struct llama_model * model, int32_t i,
                                          struct llama_zipmoe_memory_plan * plan) {
    if (model == nullptr || !model->zipmoe || plan == nullptr || i < 0 ||
        i >= (int32_t) model->zipmoe->slot_sets().size()) {
        return false;
    }
    *plan = to_memory_plan(model->zipmoe->serving_plan(*model->zipmoe->slot_sets()[i], /*slots_memory =*/ true));
    return true;
}

bool llama_model_zipmoe_memory_plan(const struct llama_model * model, struct llama_zipmoe_memory_plan * plan) {
    if (model == nullptr || !model->zipmoe || model->zipmoe->first_cache() == nullptr || plan == nullptr) {
        return false;
    }
    *plan = model->zipmoe->memory_plan();
    return true;
}

// the caches' Prometheus texts as one: each sample labelled device="NAME", a metric's samples of every
// device together under its # HELP / # TYPE lines (the exposition format groups a metric's lines)
static std::string metrics_by_device(const std::vector<std::pair<std::string, std::string>> & texts) {
    std::vector<std::string> order;
    std::map<std::string, std::pair<std::string, std::string>> families; // name -> (comments, samples)
    for (size_t i = 0; i < texts.size(); ++i) {
        const std::string & text = texts[i].second;
        for (size_t at = 0; at < text.size();) {
            size_t end = text.find('\n', at);
            end = end == std::string::npos ? text.size() : end + 1;
            const std::string line = text.substr(at, end - at);
            at = end;
            std::string name;
            if (line.rfind("# ", 0) == 0) { // "# HELP name ..." / "# TYPE name ..."
                const size_t from = line.find(' ', 2) + 1;
                name = line.substr(from, line.find(' ', from) - from);
            } else {
                name = line.substr(0, line.find_first_of("{ "));
            }
            if (!families.count(name)) {
                order.push_back(name);
            }
            auto & family = families[name];
            if (line[0] == '#') {
                family.first += i == 0 ? line : "";
                continue;
            }
            const size_t name_end = name.size();
            const std::string label = format("device=\"%s\"", texts[i].first.c_str());
            family.second += name_end < line.size() && line[name_end] == '{'
                ? line.substr(0, name_end + 1) + label + "," + line.substr(name_end + 1)
                : name + "{" + label + "}" + line.substr(name_end);
        }
    }
    std::string out;
    for (const std::string & name : order) {
        out += families[name].first + families[name].second;
    }
    return out;
}

size_t llama_model_zipmoe_metrics(const struct llama_model * model, char * buf, size_t buf_size) {
    if (buf != nullptr && buf_size > 0) {
        buf[0] = '\0';
    }
    if (model == nullptr || !model->zipmoe || model->zipmoe->first_cache() == nullptr) {
        return 0;
    }
    // the caches' counters: a model on one device as they are; with several sets, one series per device
    std::vector<std::pair<std::string, std::string>> texts;
    for (const auto & set : model->zipmoe->slot_sets()) {
        std::string one(ggml_zipmoe_cache_format_metrics(set->cache, nullptr, 0), '\0');
        ggml_zipmoe_cache_format_metrics(set->cache, one.data(), one.size() + 1);
        texts.push_back({ set->device_name(), one });
    }
    std::string text = texts.size() == 1 ? texts[0].second : metrics_by_device(texts);
    const ggml_zipmoe_serving_plan plan = model->zipmoe->serving_plan();
    std::string sizing(ggml_zipmoe_serving_format_metrics(&plan, nullptr, 0), '\0');
    ggml_zipmoe_serving_format_metrics(&plan, sizing.data(), sizing.size() + 1);
    text += sizing;
    if (buf != nullptr && buf_size > 0) {
        const size_t n = std::min(text.size(), buf_size - 1);
        memcpy(buf, text.data(), n);
        buf[n] = '\0';
    }
    return text.size();
}
