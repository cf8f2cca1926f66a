#pragma once

// ZipMoE fork: routed experts of a ZipMoE GGUF are not loaded; they are read on demand by
// ggml-zipmoe into slot tensors shared by all layers (see ggml-zipmoe.h for the cache).
//
// This file and llama-zipmoe.cpp are ZipMoE's own source, compiled into libllama by the ZipMoE
// project's CMakeLists.txt; the patch series (vendor/llama.cpp/patches) only adds the calls into
// them from llama.cpp's loader, graph builder and context.
//
// Memory. The slot tensors reserve address space for every expert but take memory only for the
// slots in use. How many are in use is decided when a context is made or freed, from what the
// process may use (its cgroup limits and MemAvailable, ggml_zipmoe_memory_available) minus the
// non-expert weights, every context's KV cache and compute buffers, the cache's own buffers and a
// margin. An explicit zipmoe.budget is reduced, with a warning giving the numbers, when it does
// not fit; pools that do not fit make context creation fail with the numbers.
//
// Concurrency. One model's graphs run one at a time (fetch through products, every layer): a
// context's fetch cannot evict a slot another context's products still read. Graph build and
// compute of a ubatch happen under the model's lock, so a resize never falls between them.
//
// Errors. A fetch that fails (I/O error, short read, checksum, corrupt chunk) stops the graph
// through the context's abort callback; llama_decode returns an error, llama_zipmoe_last_error
// names layer, tensor, expert and chunk, and the cache forgets what the fetch planned.

#include "llama.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-zipmoe.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

struct gguf_context;
struct ggml_zipmoe_file;
struct ggml_zipmoe_cache;
struct llama_context;
struct llama_model;

// every ZipMoE option, as the loader uses it: a KV override (--override-kv zipmoe.NAME=TYPE:VALUE), else
// the environment variable (ZIPMOE_NAME), else the default. Names, ranges, defaults and help are
// ggml-zipmoe's option table (ggml-zipmoe-options.h); parse fills every field from it.
struct llama_zipmoe_options {
    uint64_t    budget         = 0;     // bytes of expert slots (0: from memory)
    uint64_t    mem_limit      = 0;     // memory the process may use in all (0: its cgroup limits and MemAvailable)
    int         direct_io      = -1;    // 1, 0, -1: where the filesystem supports it
    bool        preload        = true;  // fill the slots when the first context is made
    int32_t     threads        = 0;     // graph threads that decode (0: all)
    int32_t     eviction       = 0;     // enum ggml_zipmoe_eviction
    int32_t     rank_delta     = 0;
    int32_t     pools[4]       = { 0, 0, 0, 0 }; // experts per MoE layer of F, C, S, E
    int32_t     work_slots     = 0;     // slots beyond F's with pools
    bool        auto_pools     = true;  // with no pools given, host slots and rank eviction: the pools
                                        // ggml_zipmoe_cache_default_pools picks for the memory left
    int32_t     replan_tokens  = 0;     // decode steps before the default pools are planned again (0: never)
    bool        prefetch       = false; // read ahead for the next layer's predicted experts
    int         resident_views = -1;    // 1, 0; -1: with slots in GPU memory only
    int32_t     substitution   = 0;     // enum ggml_zipmoe_substitution (LOSSY unless none)
    float       smoe_alpha     = 0;     // SMoE's alpha
    ggml_zipmoe_buddy_params buddy = {}; // BuddyMoE's parameters
    bool        trace_routing  = false; // record co-activations (zipmoe-buddies)

    bool with_pools() const { return pools[0] + pools[1] + pools[2] + pools[3] > 0; }

    // parses the overrides and the environment; throws naming the option and where it came from
    static llama_zipmoe_options parse(const std::unordered_map<std::string, llama_model_kv_override> & overrides);
};

struct llama_zipmoe {
    // true if the GGUF is a ZipMoE GGUF (has zipmoe.format_version)
    static bool is_zipmoe(const gguf_context * meta);

    // true for the GGUF tensors that hold an expert tensor's chunks ("blk.N.ffn_up_exps.zipmoe")
    static bool is_chunk_tensor(const std::string & name);

    // the ZipMoE state owning slot tensor t, or nullptr (t is not a slot tensor)
    static llama_zipmoe * of(const ggml_tensor * t);

    // opens the chunk index, reads the options and measures the memory this process may take
    // (before any weight is mapped); throws on error
    llama_zipmoe(const std::string & fname, const gguf_context * meta,
                 const std::unordered_map<std::string, llama_model_kv_override> & overrides);
    ~llama_zipmoe();

    // the slot tensor to use for routed-expert tensor `name` (shape ne), reserving the slots on
    // first use; nullptr if `name` is not repacked in the file. buft: where the tensor's layer puts
    // its weights; a CUDA device's own (not host) buffer type puts the slots in its memory (a build
    // with ZIPMOE_CUDA, docs/CUDA.md)
    ggml_tensor * serve(const std::string & name, const std::initializer_list<int64_t> & ne,
                        ggml_backend_buffer_type_t buft);

    // the slot id given to selection i (of n_used per token) that a pass does not compute:
    // GGML_ZIPMOE_NO_SLOT, which the patched ggml-cpu skips; with slots in GPU memory, one of the
    // zero slots beyond the cache's, distinct within a token (ggml's CUDA mul_mat_id has no id that
    // skips a row, and wants a token's ids distinct), whose rows the merge drops
    int32_t absent_slot(int64_t i, int64_t n_used) const {
        return on_gpu ? gpu_zero_slot + (int32_t) (i % std::max<int64_t>(1, std::min<int64_t>(n_used, gpu_zero_slots)))
                      : GGML_ZIPMOE_NO_SLOT;
    }

    // after the model's tensors are made: refuses layers the slots cannot serve (expert biases,
    // per-expert scales, merged gate_up) and records the non-expert weights held in host memory
    void check_model(const llama_model & model);

    // a context was made / is freed: the slots in use are sized again for every live context.
    // attach throws (context creation fails) when pools cannot fit.
    void attach(llama_context * lctx);
    void detach(llama_context * lctx);

    // the experts' tensors a build_experts callback is given: gate, up, down
    using experts_fn = std::function<ggml_tensor * (ggml_tensor * ids, ggml_tensor * gate, ggml_tensor * up,
                                                    ggml_tensor * down)>;

    // builds the experts' output for layer il: build(ids, gate, up, down) makes the three mul_mat_id
    // calls; here on the slot tensors with slot ids, one pass per group of slots (see ggml-zipmoe.h),
    // or, with resident views (zipmoe.resident_views), on views of the slots with the router's ids.
    // The first fetch's begin is expanded into gf at once, so that the caller's later work (the
    // shared expert) is computed while the experts are read; the products are left unexpanded.
    // With zipmoe.prefetch, the next MoE layer's experts are predicted from ffn_inp (this layer's
    // normalized FFN input, [n_embd, 1, n_tokens]) and read ahead after this layer's own reads.
    // probs: the router's scores of every expert [n_expert, n_tokens] (zipmoe.eviction=score reads them)
    ggml_tensor * build_experts(ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * ffn_inp,
                                ggml_tensor * selected_experts, ggml_tensor * probs, const experts_fn & build);

    // the substitution hook, after the router's top-k (selected, [n_used, n_tokens]) of layer il and
    // before the weights are taken from probs ([n_expert, n_tokens], the router's scores): the ids
    // the experts compute with, zipmoe.substitution's policy applied (LOSSY), or selected itself when
    // it is none. *weight_ids gets the ids whose scores weigh them when they are not those (BuddyMoE:
    // the router's own choice), else is left as it is
    ggml_tensor * substitute(ggml_context * ctx, int il, ggml_tensor * probs, ggml_tensor * selected,
                             ggml_tensor ** weight_ids);

    // graph nodes the passes may add to a ubatch of n_tokens (at the fewest slots the cache uses)
    uint32_t graph_extra_nodes(uint32_t n_tokens, uint32_t n_expert_used) const;

    // the model's graphs run one at a time: held from graph build through compute of a ubatch
    std::unique_lock<std::mutex> lock_compute();

    // false if gf was built for another slot count (a resize since): it must be rebuilt
    bool graph_is_current(const ggml_cgraph * gf) const;

    // after a graph of lctx computed (under lock_compute): abandons a fetch the graph left open and
    // turns a failed fetch into GGML_STATUS_FAILED, keeping its message for llama_zipmoe_last_error
    ggml_status finish_compute(llama_context * lctx, ggml_status status);

    // the abort callback installed in lctx's backends: a failed fetch, or the user's callback
    static bool abort_callback(void * data);
    void * wrap_abort_callback(llama_context * lctx, ggml_abort_callback user_callback, void * user_data);

    // the message of lctx's last failed decode ("" if none)
    const char * last_error(const llama_context * lctx);

    // how the slots in use were last sized
    llama_zipmoe_memory_plan memory_plan() const;

    ggml_zipmoe_file  * file  = nullptr;
    ggml_zipmoe_cache * cache = nullptr;

    // what a graph's fetch / merge op works on
    struct op_args {
        llama_zipmoe * zm;
        int            il;
        int            pass;
    };

    // an op's failure: stops the graph (through abort_callback) with this message
    void fail(const char * message);

private:
    struct context_state {
        llama_zipmoe *      zm            = nullptr;
        ggml_abort_callback user_callback = nullptr;
        void *              user_data     = nullptr;
        uint64_t            host_bytes    = 0;     // KV cache + compute buffers in host memory
        bool                attached      = false;
        std::string         error;
    };

    op_args * args_for(int il, int pass);
    void build_prefetch(ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * ffn_inp, ggml_tensor * after,
                        int64_t n_used);
    context_state & state_of(const llama_context * lctx);
    void resize(const llama_context * making);
    int32_t slots_for(uint64_t budget) const;

    std::string           fname;
    llama_zipmoe_options  opt;

    // geometry
    size_t   expert_bytes = 0;  // gate + up + down of one expert, BF16
    uint64_t all_experts  = 0;  // bytes of every routed expert
    int32_t  n_moe_layers = 0;
    int32_t  n_expert_used = 1; // the model's top-k: the fewest slots an automatic budget keeps

    // memory
    uint64_t available_at_load = 0; // what the process could take when loading began
    std::string memory_source;      // where that number came from, for the log
    uint64_t non_expert_bytes = 0;  // non-expert weights in host memory a decode step reads
    int32_t  n_threads_max = 1;     // decoding threads of the largest context (for the cache's buffers)
    bool     preloaded     = false; // the slots were filled once (zipmoe.preload)

    // resident views: every served layer's first slot, valid for slot layout views_layout (guarded by
    // state_mutex); a layer at -1 (or views off) and every layer uses the fetch
    bool                 views_wanted = false; // a preload left every expert resident (zipmoe.resident_views)
    uint64_t             views_layout = UINT64_MAX;
    std::vector<int32_t> views_base;
    bool resident_bases(std::vector<int32_t> & base); // every served layer's, if all are in place

    // prefetch: by layer, the router's weights and the FFN norm's (nullptr where not served)
    std::vector<ggml_tensor *> gate_inp, ffn_norm;

    // slots in CUDA memory: all allocated when the model loads, all in use (no host memory sizing)
    bool     on_gpu        = false;
    int32_t  gpu_zero_slot = -1;  // the first zero slot
    int32_t  gpu_zero_slots = 0;  // as many as a layer's experts: a warmup token selects them all
    uint64_t file_non_expert = 0; // bytes of the file's tensors that are not expert chunks

    // slots: one reserved region, committed only where slots are used
    void *                mapping       = nullptr;
    size_t                mapping_bytes = 0;
    size_t                section[3]    = { 0, 0, 0 }; // offset of each kind's slots in the region
    int32_t               n_slots_used  = 0;
    ggml_zipmoe_default_pools auto_choice = {}; // the pools resize chose (capacity all 0: one F pool)
    bool                  auto_active   = false; // auto_choice's pools are the cache's
    double                plan_rates[2] = { 0, 0 }; // read and decode rates the pools are planned with
    bool                  auto_eligible = false; // the default pools apply (no pools given, host slots, rank)
    uint64_t              auto_budget   = 0;     // the bytes and decoding threads they were last planned for
    int32_t               auto_threads  = 1;
    // the routing of decode steps, for planning the pools once more (observe_routing)
    std::vector<uint64_t> seen_counts, seen_ubatches; // the cache's activation counts at the last graph
    std::vector<uint64_t> counts, ubatches;           // and at this one
    int32_t               n_exp_seen = 0;             // experts of the widest served layer
    std::vector<double>   token_counts;               // [n_layer][n_expert] selections in one-token ubatches
    uint64_t              token_steps = 0;
    bool                  replanned   = false;
    std::vector<double>   observed_profile;           // rank-based inclusion probabilities of those steps
    void                  observe_routing();
    // n slots in use with the pools (capacity all 0: one F pool; nullptr: the pools unchanged), the memory
    // of slots given up returned to the system. Where their stores cannot be allocated the cache falls
    // back to one F pool, and *pools says so. OK, or the cache's refusal (nothing changed)
    int                   use_slots(int32_t n, ggml_zipmoe_default_pools * pools);
    ggml_context *        ctx    = nullptr;
    ggml_backend_buffer_t buf    = nullptr;
    ggml_tensor *         slots[3] = { nullptr, nullptr, nullptr };

    // graphs and contexts
    std::mutex                  compute_mutex; // held by lock_compute, and by resize
    mutable std::mutex          state_mutex;   // args, contexts, built, layout
    std::deque<op_args>         args;          // stable addresses for the graph's custom ops
    std::unordered_map<int64_t, op_args *> args_index;
    std::map<const llama_context *, std::unique_ptr<context_state>> contexts;
    std::unordered_map<const ggml_cgraph *, uint64_t> built; // graph -> slot layout it was built for
    uint64_t                    layout = 0;    // bumped by every change of the slot count

    llama_zipmoe_memory_plan plan = {};        // the last sizing (guarded by state_mutex)

    std::atomic<bool> failed { false };
    std::string       failure;
    std::mutex        failure_mutex;
};
