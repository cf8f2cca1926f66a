#pragma once

// ZipMoE fork: routed experts of a ZipMoE GGUF are not loaded; they are read on demand by
// ggml-zipmoe into slot tensors (see ggml-zipmoe.h for the cache). Each device that computes some MoE
// layer's experts, by stock llama.cpp's placement (-ngl, -ot, --n-cpu-moe, -ts, RPC servers), holds one
// slot set: the slots of those layers, in its memory, with its own sizing and cache; host memory is the
// set of the layers computed on the CPU.
//
// This glue is ZipMoE's own source, compiled into libllama by the ZipMoE project's CMakeLists.txt;
// the patch series (vendor/llama.cpp/patches) only adds the calls into it from llama.cpp's loader,
// graph builder and context. By concern:
//   llama-zipmoe.h / .cpp       the model's expert cache: made at load, sized per context
//   llama-zipmoe-options.cpp    the options, from KV overrides and the environment
//   llama-zipmoe-graph.cpp      the graph's ops: fetch, merge, prefetch, substitution; errors
//   llama-zipmoe-sets.cpp       which device each layer's slots take; the sets' sizing and statistics
//   llama-zipmoe-slots.cpp      a set's slots in a device's or host memory, and how bytes reach them
//
// Memory. The sizing is ggml-zipmoe's (ggml-zipmoe-serving.h): the slot tensors reserve address
// space for every expert but take memory only for the slots in use, decided when a context is made
// or freed, and again when decode steps re-plan the default pools (zipmoe.replan_tokens, then doubling). An
// explicit zipmoe.budget is reduced, with a warning giving the numbers, when it does not fit; pools
// that do not fit make context creation fail with the numbers.
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
#include "ggml-zipmoe-policy.h"
#include "ggml-zipmoe-serving.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <string>
#include <unordered_map>
#include <vector>

// the routed experts' tensors in llama.cpp's names, by enum ggml_zipmoe_expert_kind
inline constexpr const char * k_zipmoe_kinds[3] = { "gate", "up", "down" };

struct gguf_context;
struct ggml_zipmoe_file;
struct ggml_zipmoe_cache;
struct llama_context;
struct llama_hparams;
struct llama_model;
struct llama_zipmoe_slot_set;

// a size in words ("1.23 GiB", "18.0 KiB": ggml_zipmoe_size_text), for the glue's messages
std::string llama_zipmoe_size_text(uint64_t bytes);

// the name of layer il's routed-expert tensor of a kind in llama.cpp ("blk.3.ffn_up_exps.weight")
std::string llama_zipmoe_expert_tensor_name(int il, int kind);

// a set's slot tensors entered in (add) or removed from the registry llama_zipmoe::of reads
void llama_zipmoe_register_slots(const llama_zipmoe_slot_set & set, bool add);

inline constexpr double k_zipmoe_mib = 1024.0 * 1024.0;

// a buffer type of the CPU device other than its plain one: ggml-cpu's repacking ("CPU_REPACK")
bool llama_zipmoe_is_cpu_extra_buft(ggml_backend_buffer_type_t buft);

// how llama.cpp lays a context's KV cache out (llama_kv_cache_iswa): a sliding-window layer keeps, per
// stream, at most its window (of every sequence, in one unified stream) and a ubatch, padded to 256 cells
struct llama_zipmoe_kv_shape {
    uint32_t n_seq_max = 1;
    bool     unified   = false;
    uint32_t n_ubatch  = 512; // at most: the context's n_batch or n_ubatch, whichever is larger
    bool     swa_full  = false; // sliding-window layers keep every cell (--swa-full)
    uint32_t n_outputs = 512;   // logits rows the context's compute buffer holds: its n_ubatch (at most n_batch)
};

// every ZipMoE option, as the loader uses it: a KV override (--override-kv zipmoe.NAME=TYPE:VALUE), else
// the environment variable (ZIPMOE_NAME), else the default. Names, ranges, defaults and help are
// ggml-zipmoe's option table (ggml-zipmoe-options.h); parse fills every field from it.
struct llama_zipmoe_options {
    uint64_t    budget         = 0;     // bytes of expert slots (0: from memory)
    std::string device_budgets;         // "CUDA0=6G CPU=8G": a set's slots by its device's name ("": none)
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
    bool        device_stores  = false; // device slots: host stores beside them from the first context
    bool        cpu_compute    = false; // device slots: the CPU computes missing experts where the balancer says
                                        // (SMoE Alg. 2; exact weights, the CPU's rounding)
    int32_t     replan_tokens  = 0;     // decode steps before the default pools are planned again (0: never)
    bool        prefetch       = false; // read ahead for the next layer's predicted experts
    bool        resident_views = true;
    int32_t     substitution   = 0;     // enum ggml_zipmoe_substitution (LOSSY unless none)
    float       smoe_alpha     = 0;     // SMoE's alpha
    ggml_zipmoe_buddy_params buddy = {}; // BuddyMoE's parameters
    bool        trace_routing  = false; // record co-activations (zipmoe-buddies)
    std::string budget_source  = "zipmoe.budget"; // where the budget came from, for messages

    bool with_pools() const { return pools[0] + pools[1] + pools[2] + pools[3] > 0; }

    // parses the overrides and the environment; throws naming the option and where it came from
    static llama_zipmoe_options parse(const std::unordered_map<std::string, llama_model_kv_override> & overrides);

    // the ZipMoE options given, as the user gave them ("ZIPMOE_BUDGET", "zipmoe.budget"), unparsed
    static std::vector<std::string> given_names(const std::unordered_map<std::string, llama_model_kv_override> & overrides);
};

struct llama_zipmoe {
    // true if the GGUF is a ZipMoE GGUF (has zipmoe.format_version)
    static bool is_zipmoe(const gguf_context * meta);

    // a GGUF that is not a ZipMoE GGUF: warns when ZipMoE options were given, since they do nothing
    static void warn_options_ignored(const std::string & fname,
                                     const std::unordered_map<std::string, llama_model_kv_override> & overrides);

    // the routed experts' parameters (values of every repacked tensor): what the chunk tensors stand for
    uint64_t expert_params() const;

    // true for the GGUF tensors that hold an expert tensor's chunks ("blk.N.ffn_up_exps.zipmoe")
    static bool is_chunk_tensor(const std::string & name);

    // the ZipMoE state owning slot tensor t, or nullptr (t is not a slot tensor)
    static llama_zipmoe * of(const ggml_tensor * t);

    // opens the chunk index, reads the options, measures the memory this process may take (before
    // any weight is mapped) and checks the options that size the cache; throws on error
    llama_zipmoe(const std::string & fname, const gguf_context * meta,
                 const std::unordered_map<std::string, llama_model_kv_override> & overrides);
    ~llama_zipmoe();

    // where a layer's weights go (its buffer type list's first)
    using layer_buft_fn = std::function<ggml_backend_buffer_type_t (int il)>;
    // the host buffer type the loader gives routed-expert weight w (a meta tensor) in host memory: the
    // plain CPU one, or one of ggml-cpu's that lay weights out their own way (repacking quantized types)
    using weight_buft_fn = std::function<ggml_backend_buffer_type_t (ggml_tensor * w)>;
    // a tensor override's pattern (-ot, --n-cpu-moe), compiled, and its buffer type
    using buft_pattern = std::pair<std::regex, ggml_backend_buffer_type_t>;

    // makes the slot sets, their slot tensors and expert caches, before the model's tensors are created:
    // a layer's slots go where stock llama.cpp puts its experts, the layer's weights' device or where a
    // tensor override sends them (layer_buft, overrides), one set per device. A device's own (not host)
    // buffer type puts them in its memory: CUDA's, recovered by ZipMoE's kernels (a build with
    // ZIPMOE_CUDA, docs/CUDA.md), or any other backend's (an rpc-server's, docs/DISTRIBUTED.md), written
    // with ggml_backend_tensor_set. Host slots take the buffer type stock llama.cpp gives the experts
    // (weight_buft), so that the products run the same kernels. Throws on error.
    void make_cache(const layer_buft_fn & layer_buft, const weight_buft_fn & weight_buft,
                    const llama_model_tensor_buft_override * overrides);

    // the slot tensor to use for routed-expert tensor `name` (shape ne); nullptr if `name` is not
    // repacked in the file. Throws if the shape is not the file's.
    ggml_tensor * serve(const std::string & name, const std::initializer_list<int64_t> & ne) const;

    // the slot sets, in the order of their first layers, and the set serving layer il (nullptr: none)
    const std::vector<std::unique_ptr<llama_zipmoe_slot_set>> & slot_sets() const { return sets; }
    llama_zipmoe_slot_set * set_of(int il) const {
        return il >= 0 && il < (int) layer_set.size() && layer_set[il] >= 0 ? sets[layer_set[il]].get() : nullptr;
    }
    // the first set's cache: the one llama_model_zipmoe_cache gives (nullptr before make_cache)
    ggml_zipmoe_cache * first_cache() const;

    // after the model's tensors are made: refuses layers the slots cannot serve (expert biases,
    // per-expert scales, merged gate_up) and records the non-expert weights held in host memory
    void check_model(const llama_model & model);

    // the context size of a context made without one (n_ctx 0), as upstream's fit sizes one for a model
    // that does not fit: the trained context (per stream) when its KV cache fits in what every expert in a
    // slot leaves beside the non-expert weights, the cache's buffers, twice its margin and a ubatch's
    // logits (the bulk of the context's compute buffer), else the largest multiple of 256 that does, at least
    // 4096 tokens per stream. The KV cache is cleared, so all of it is resident from the start, and an
    // unset context's is mostly never used: the trained context of DeepSeek-V2-Lite (163,840 tokens,
    // 4.9 GiB) would take the experts' memory, or a small machine's whole. Sliding-window layers count at
    // their window (llama_zipmoe_kv_shape): gpt-oss's full layers alone decide its size. Logs the choice.
    uint32_t unset_context_size(const llama_hparams & hparams, ggml_type type_k, ggml_type type_v,
                                const llama_zipmoe_kv_shape & shape) const;

    // where a memory cgroup's hard limit applies (the kernel kills a process past it), throws naming the
    // numbers when the limit cannot hold what must be resident: at load, the vocabulary's tables beside what
    // the process uses already; for a context of n_ctx tokens, its KV cache (cleared, so all resident),
    // the cache's own buffers and the fewest slots. A soft limit (MemAvailable, zipmoe.mem_limit) only
    // sizes the slots; paged weights never count, as a mapped model may page.
    void check_load_fits() const;
    void check_context_fits(const llama_hparams & hparams, uint32_t n_ctx, ggml_type type_k, ggml_type type_v,
                            const llama_zipmoe_kv_shape & shape) const;

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
    // shared expert) is computed while the experts are read; the products are left unexpanded, and
    // *deferred says so (false on resident views: no fetch to overlap, so the caller keeps stock's
    // node order, and with it the backend's fusions).
    // With zipmoe.prefetch, the next MoE layer's experts are predicted from ffn_inp (this layer's
    // normalized FFN input, [n_embd, 1, n_tokens]) and read ahead after this layer's own reads.
    // probs: the router's scores of every expert [n_expert, n_tokens] (zipmoe.eviction=score reads them)
    // sched, op_offload: the context's scheduler and llama_context_params.op_offload, which say whether
    // products on host slots run on a GPU (products_offloaded)
    ggml_tensor * build_experts(ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * ffn_inp,
                                ggml_tensor * selected_experts, ggml_tensor * probs, const experts_fn & build,
                                bool * deferred, ggml_backend_sched_t sched, bool op_offload);

    // the substitution hook, after the router's top-k (selected, [n_used, n_tokens]) of layer il and
    // before the weights are taken from probs ([n_expert, n_tokens], the router's scores): the ids
    // the experts compute with, zipmoe.substitution's policy applied (LOSSY), or selected itself when
    // it is none. *weight_ids gets the ids whose scores weigh them when they are not those (BuddyMoE:
    // the router's own choice), else is left as it is
    ggml_tensor * substitute(ggml_context * ctx, int il, ggml_tensor * probs, ggml_tensor * selected,
                             ggml_tensor ** weight_ids);

    // graph nodes the passes may add to a ubatch of n_tokens (at the fewest slots the cache uses)
    uint32_t graph_extra_nodes(uint32_t n_tokens, uint32_t n_expert_used) const;

    // the model's graphs run one at a time: held from graph build through compute of a ubatch of lctx (batched:
    // of more than one token, computed on its batch threads); the CPU's products (zipmoe.cpu_compute) are
    // weighed at the time they take on those threads
    std::unique_lock<std::mutex> lock_compute(llama_context * lctx, bool batched);

    // false if gf was built for another slot count (a resize since): it must be rebuilt
    bool graph_is_current(const ggml_cgraph * gf) const;

    // after a graph of lctx computed (under lock_compute) for a ubatch of n_tokens tokens of n_seqs
    // distinct sequences: abandons a fetch the graph left open and turns a failed fetch into
    // GGML_STATUS_FAILED, keeping its message for llama_zipmoe_last_error; a decode step's routing
    // may re-plan the default pools
    ggml_status finish_compute(llama_context * lctx, ggml_status status, const llama_token * tokens, uint32_t n_tokens,
                               uint32_t n_seqs);

    // the abort callback installed in lctx's backends: a failed fetch, or the user's callback
    static bool abort_callback(void * data);
    void * wrap_abort_callback(llama_context * lctx, ggml_abort_callback user_callback, void * user_data);

    // the message of lctx's last failed decode ("" if none)
    const char * last_error(const llama_context * lctx);

    // how the slots in use were last sized: the set in host memory's (else the first set's), and set i's
    llama_zipmoe_memory_plan memory_plan() const;
    ggml_zipmoe_serving_plan serving_plan() const; // the last sizing (what memory_plan reports)
    // slots_memory: for a set in a device's memory, that device's memory rather than the host's sizing
    ggml_zipmoe_serving_plan serving_plan(const llama_zipmoe_slot_set & set, bool slots_memory = false) const;

    ggml_zipmoe_file * file = nullptr;

    // what a graph's fetch / merge op works on
    struct op_args {
        llama_zipmoe *          zm;
        llama_zipmoe_slot_set * set; // the layer's
        int                     il;
        int                     pass;
        bool                    offloaded; // the pass's products run on another backend than the slots'
        bool                    with_cpu;  // the CPU computes the experts the balancer gives it (zipmoe.cpu_compute)
    };

    // an op's failure: stops the graph (through abort_callback) with this message
    void fail(const char * message);

private:
    friend struct llama_zipmoe_slot_set;

    struct context_state {
        llama_zipmoe *      zm            = nullptr;
        ggml_abort_callback user_callback = nullptr;
        void *              user_data     = nullptr;
        uint64_t            host_bytes    = 0;     // KV cache + compute buffers in host memory
        bool                attached      = false;
        std::string         error;
    };

    op_args * args_for(int il, int pass, bool offloaded = false, bool with_cpu = false);
    ggml_tensor * build_with_cpu(ggml_context * ctx, int il, int pass, ggml_tensor * slot_ids, op_args * a,
                                 const experts_fn & build);
    void build_prefetch(ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * ffn_inp, ggml_tensor * after,
                        int64_t n_used);
    context_state & state_of(const llama_context * lctx);
    // the slots in use sized again for the live contexts (making: the one being made)
    void resize(const llama_context * making);
    void preload(llama_context * lctx);
    // the device whose memory holds layer il's slots (nullptr: host memory), as stock places its experts
    ggml_backend_dev_t expert_device(int il, const layer_buft_fn & layer_buft,
                                     const std::vector<buft_pattern> & overrides) const;
    // the serving's parameters from the options, for the layers of a table (-1 outside them)
    ggml_zipmoe_serving_params serving_params(const std::vector<int32_t> & table) const;
    // the model's non-expert weights that go to dev's memory (layer_buft: each layer's placement)
    uint64_t weights_on(ggml_backend_dev_t dev, const layer_buft_fn & layer_buft) const;
    // a set's sizing: the constructor's serving for a single set serving every layer, else its own
    // (budget: the set's share of zipmoe.budget, 0 for none)
    // (named: its device's in zipmoe.device_budgets)
    void make_serving(llama_zipmoe_slot_set & set, size_t n_sets, bool host_set_exists, uint64_t budget, bool named);
    // the set in host memory, else the first: what a context's host memory is sized against
    const llama_zipmoe_slot_set * primary() const;
    void log_substitution() const;
    void log_statistics(const llama_zipmoe_slot_set & set, bool name_the_device);
    // every served layer's in set, if all are in place
    bool resident_bases(const llama_zipmoe_slot_set & set, std::vector<int32_t> & base);

    std::string           fname;
    llama_zipmoe_options  opt;
    std::vector<int32_t>  layer_tensors;     // [n_layer][3] the file's tensor of each layer's gate, up, down
    int32_t               n_expert_used = 1; // the model's top-k
    // ZIPMOE_TEST_OFFLOADED_PASSES=1, tests only: host slots take their zero slots and every pass of a
    // product on them runs as when a GPU runs it (absent_slot), so that a CPU-only build tests that path
    const bool            test_offloaded_passes = getenv("ZIPMOE_TEST_OFFLOADED_PASSES") != nullptr &&
                                                  atoi(getenv("ZIPMOE_TEST_OFFLOADED_PASSES")) != 0;
    std::vector<uint64_t> layer_non_expert;  // by layer: bytes of the file's tensors of blk.N that are not expert chunks
    uint64_t              other_non_expert = 0; // the rest of them (embeddings, output, final norm)
    uint64_t              file_non_expert  = 0; // all of them
    uint64_t              n_vocab = 0;       // the vocabulary's tokens (a context's logits are this wide)

    // the slot sets (llama-zipmoe-sets.cpp) and, by layer, the index of the set serving it (-1: none)
    std::vector<std::unique_ptr<llama_zipmoe_slot_set>> sets;
    std::vector<int32_t>                                layer_set;

    // the sizing (ggml-zipmoe-serving.h): made at load over every layer, before the placement is known;
    // the single set's, or freed once the sets have their own
    ggml_zipmoe_serving *     serving = nullptr;
    ggml_zipmoe_serving_info  info    = {};
    uint64_t                  non_expert_bytes = 0; // non-expert weights in host memory a decode step reads
    int32_t                   n_threads_max    = 1; // graph threads of the widest context
    bool                      preloaded        = false; // the slots were filled once (zipmoe.preload)
    bool                      sized            = false; // a context sized the slots (resize)

    // resident views: every served layer's first slot, valid for slot layout views_layout (guarded by
    // state_mutex); a layer at -1 (or views off in its set) uses the fetch
    uint64_t             views_layout = UINT64_MAX;
    std::vector<int32_t> views_base;
    // their weights: leaf tensors over the slots, as stock's expert tensors are (a VIEW node between
    // the products keeps a backend from fusing them as it fuses stock's: CUDA's gate+up+GLU), by
    // (layer, first slot); kept until the model goes, as graphs built on them may outlive a layout
    std::map<std::pair<int, int32_t>, std::array<ggml_tensor *, 3>> resident_weights;
    std::vector<ggml_context *> resident_ctxs;
    std::array<ggml_tensor *, 3> resident_weights_of(ggml_context * ctx0, int il, int32_t base);

    // prefetch: by layer, the router's weights and the FFN norm's (nullptr where not served)
    std::vector<ggml_tensor *> gate_inp, ffn_norm;

    // graphs and contexts
    std::mutex                  compute_mutex; // held by lock_compute, and by resize
    int64_t                     graph_start_us = -1; // the graph under compute_mutex began (lock_compute)
    mutable std::mutex          state_mutex;   // args, contexts, built, layout
    std::deque<op_args>         args;          // stable addresses for the graph's custom ops
    std::unordered_map<int64_t, op_args *> args_index;
    std::map<const llama_context *, std::unique_ptr<context_state>> contexts;
    std::unordered_map<const ggml_cgraph *, uint64_t> built; // graph -> slot layout it was built for
    uint64_t                    layout = 0;    // bumped by every change of the slot count

    std::atomic<bool> failed { false };
    std::string       failure;
    std::mutex        failure_mutex;
};

// one device's expert slots: the MoE layers whose routed experts stock llama.cpp computes on that device
// (or on the CPU, from host memory), their slots in its memory, and their own sizing and cache
// (llama-zipmoe-slots.cpp)
struct llama_zipmoe_slot_set {
    llama_zipmoe *           zm      = nullptr;
    ggml_backend_dev_t       dev     = nullptr; // the device whose memory holds the slots; nullptr: host memory
    std::vector<int32_t>     layer_tensors;     // the file's table of the set's layers, -1 for every other layer
    int32_t                  n_layers = 0;      // MoE layers in the set
    ggml_zipmoe_serving *    serving = nullptr; // owned
    ggml_zipmoe_serving_info info    = {};
    ggml_zipmoe_cache *      cache   = nullptr; // owned
    bool                     views_wanted = false; // a preload left every expert resident (zipmoe.resident_views)

    // slots in a device's memory: all allocated when the model loads, all in use (no host memory sizing)
    bool           on_device    = false;
    bool           cuda_slots   = false;   // ZipMoE's CUDA kernels recover into them; else slot_write
    bool           slots_in_own_mapping = false; // host slots in the serving's mmap (ggml_zipmoe_cache_params.slot_pages_movable)
    ggml_backend_t slot_backend = nullptr; // slot_write's, where the device's backend sets asynchronously
    std::mutex     slot_mutex;             // slot_write through a buffer: one at a time
    int32_t        zero_slot    = -1; // the first zero slot
    int32_t        zero_slots   = 0;  // on a device, as many as a layer's experts: a warmup token selects them
                                      // all; in host memory beside a GPU, one token's (a warmup is not offloaded)
    // one slot never used, where the slots would be one in a buffer of ggml-cpu's repacking types: ggml takes a
    // tensor of one expert as 2-D, and those types' kernels serve 3-D experts only (no backend would run it)
    int32_t        spare_slots  = 0;

    // the slot tensors: by kind, one per ggml type the file's tensors of that kind have (a quantized file
    // may type layers apart: Q4_K_M), all over the same memory with the largest expert as stride
    ggml_context *             ctx = nullptr;
    ggml_backend_buffer_t      buf = nullptr;
    ggml_backend_buffer_t      plain_buf = nullptr; // with buf of a repacking type: a plain CPU buffer over its
                                                    // memory, for the types stock does not repack
    std::vector<ggml_tensor *> slots[3];
    // slots in a buffer whose type lays weights out its own way (ggml-cpu's repacking): by (kind, type),
    // a [ne0, ne1] view per slot, set through the buffer
    std::map<std::pair<int, int>, std::vector<ggml_tensor *>> fill_views;

    // experts the CPU computes beside slots in a device's memory (zipmoe.cpu_compute, llama-zipmoe-cpu.cpp):
    // by kind, one tensor per ggml type over a plain host buffer, as the device's slots are laid out
    int32_t                    n_cpu_slots = 0;
    ggml_context *             cpu_ctx     = nullptr;
    ggml_backend_buffer_t      cpu_buf     = nullptr;
    std::vector<ggml_tensor *> cpu_slots[3];
    double                     cpu_token_s = 0; // measured: one expert's products of one token on the CPU, on
    int                        cpu_token_threads = 0;         // this many threads: the graph's (time_cpu_products)
    std::map<int, double>      cpu_token_s_by_threads;        // each thread count's, measured once

    ~llama_zipmoe_slot_set();

    // "CPU" for host memory, else the device's name ("CUDA0", "RPC0[host:port]")
    const char * device_name() const;

    // the slot id given to selection i (of n_used per token) that a pass does not compute:
    // GGML_ZIPMOE_NO_SLOT, which the patched ggml-cpu skips; with slots in a device's memory, or products
    // on host slots that a GPU runs (offloaded), one of the zero slots beyond the cache's, distinct
    // within a token, whose rows the merge drops (ggml's CUDA mul_mat_id has no id that skips a row and
    // wants a token's ids distinct; an rpc-server may run stock ggml, or CUDA; ggml's scheduler copies
    // the experts an offloaded product uses, and asserts every id in range)
    int32_t absent_slot(int64_t i, int64_t n_used, bool offloaded) const {
        return (on_device || offloaded) && zero_slots > 0
                   ? zero_slot + (int32_t) (i % std::max<int64_t>(1, std::min<int64_t>(n_used, zero_slots)))
                   : GGML_ZIPMOE_NO_SLOT;
    }

    ggml_tensor * slots_of(int il, int kind) const; // layer il's slot tensor of a kind (its type's)
    ggml_tensor * cpu_slots_of(int il, int kind) const; // the same, of the CPU's slots

    // the CPU's slots for n experts and its measured cost on n_threads (zipmoe.cpu_compute), given to the
    // cache; logs them
    void place_cpu_slots(int32_t n, int n_threads);
    // the cache's balancer weighs the CPU's products at their time on n_threads threads (measured the first
    // time). False, the first time only, if they could not be measured or the cache refused it: the time it
    // had stays
    bool time_cpu_products(int n_threads);

    // the slots: in the device's memory, beside weights_bytes of the model's weights there; or in host memory
    void place_on_device(uint64_t weights_bytes);
    // zero_slots: after the slots, for products a GPU may run (absent_slot)
    void place_in_host(const llama_zipmoe::weight_buft_fn & weight_buft, int32_t zero_slots);
    // the cache over the placed slots, handed to the serving; logs where the slots are
    void make_cache();

private:
    // of a kind's tensors (one per ggml type), the one of layer il's type
    ggml_tensor * of_layers_type(const std::vector<ggml_tensor *> & of_kind, int il, int kind) const;
    // slot tensors at data[k], nb[2] stride[k]: one per kind and ggml type of the file's tensors of that
    // kind; expected_extra: by (kind, type), whether the buffer's type must lay them out its own way
    void make_slot_tensors(void * const data[3], const size_t stride[3],
                           const std::map<std::pair<int, int>, bool> & expected_extra);
    // a raw expert's bytes into its slot (ggml_zipmoe_cache_params.slot_fill): through a per-slot view's
    // set_tensor where its buffer lays weights out its own way, else copied
    static int slot_fill(void * data, int kind, int tensor, int32_t slot, const void * src, size_t size, char * err,
                         size_t err_size);
    // slots in a device's memory other than ZipMoE's CUDA path (ggml_zipmoe_cache_params.slot_write and
    // slot_sync): set through the device's backend (an rpc-server's queues it), else the buffer
    static int slot_write(void * data, int kind, int tensor, int32_t slot, size_t offset, const void * src,
                          size_t size, char * err, size_t err_size);
    static int slot_sync(void * data, char * err, size_t err_size);
};
