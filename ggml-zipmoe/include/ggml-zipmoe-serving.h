// ggml-zipmoe serving: how many expert slots a process uses, and with which pools.
//
// A serving object is made from a ZipMoE GGUF's index when a model is loaded, before any weight is
// mapped. It measures the memory the process may take, checks the options that size the cache
// against the file, and decides how many slots to reserve (address space, or device memory). Once
// the caller has placed the slots and made the cache, it sizes the slots in use each time the
// memory the process needs besides them changes (a context made or freed): the slots that fit, the
// default pools for them (compressed experts kept where full ones no longer fit), and later the
// pools planned once more from the routing seen. The llama.cpp glue drives it; it holds no ggml
// object, so the tests drive it too.
//
// Not thread-safe: calls on one object must not overlap, and no fetch may be open during
// ggml_zipmoe_serving_resize or _observe (they change the cache's slots).

#pragma once

#include "ggml-zipmoe.h"

#ifdef __cplusplus
extern "C" {
#endif

// where the serving object's messages go: level 0 information, 1 warning
typedef void (*ggml_zipmoe_log_fn)(int level, const char * text, void * user_data);

struct ggml_zipmoe_serving_params {
    const struct ggml_zipmoe_file * file;          // must outlive the object
    const int32_t *                 layer_tensors; // [n_layer][3], as ggml_zipmoe_cache_params
    int32_t                         n_layer;
    int32_t                         n_expert_used; // the model's top-k: the fewest slots an automatic size keeps
    uint64_t                        available;     // bytes the process may take (0: measured now, below)
    uint64_t                        mem_limit;     // zipmoe.mem_limit (0: none)
    uint64_t                        budget;        // zipmoe.budget (0: from memory)
    const char *                    budget_name;   // how the user gave it, for messages (NULL: "zipmoe.budget")
    int32_t                         pools[4];      // zipmoe.pool_f/c/s/e: experts per MoE layer (all 0: none given)
    int32_t                         work_slots;    // zipmoe.work_slots
    int32_t                         eviction;      // zipmoe.eviction
    int32_t                         threads;       // zipmoe.threads (0: the graph's)
    int32_t                         auto_pools;    // zipmoe.auto_pools
    int32_t                         device_stores; // zipmoe.device_stores
    int32_t                         replan_tokens; // zipmoe.replan_tokens (0: never)
    ggml_zipmoe_log_fn              log;           // may be NULL
    void *                          log_data;
    const char *                    available_source; // where a given `available` came from (NULL: "given")
};

// the served experts' geometry and the slots to reserve
struct ggml_zipmoe_serving_info {
    uint64_t expert_bytes;   // gate + up + down of one expert in its slot (BF16, or a raw tensor's type)
    uint64_t all_experts;    // bytes of every routed expert
    int64_t  slot_ne[3][2];  // by kind: ne0, ne1 of a slot
    int32_t  n_moe_layers;
    int32_t  max_expert;     // experts of the largest MoE layer
    int32_t  capacity;       // slots to reserve
    int32_t  fewest;         // the fewest slots the sizing keeps
    int32_t  with_pools;     // pools were given
    int32_t  raw;            // the experts are stored raw (not BF16: a quantized file): one F pool
    uint64_t slot_bytes[3];  // by kind: bytes of a slot (the largest of any layer's expert tensor)
    int32_t  n_experts;      // routed experts of every MoE layer: the most slots ever in use (every expert
                             // held takes n_experts x expert_bytes, more than all_experts where layers' types differ)
};

// the last sizing: what llama.h's llama_zipmoe_memory_plan reports, field for field
struct ggml_zipmoe_serving_plan {
    uint64_t available;     // bytes the process could take when the model was loaded
    uint64_t non_expert;    // non-expert weights in host memory that a decode step reads
    uint64_t contexts;      // KV caches and compute buffers of the live contexts, in host memory
    uint64_t cache_buffers; // the expert cache's own buffers (staging, stores, decoders)
    uint64_t margin;        // kept free for heap growth, readahead and allocator slack
    uint64_t fits;          // what is left for expert slots
    uint64_t budget;        // zipmoe.budget, 0 when none was given
    uint64_t expert_bytes;  // one expert's gate + up + down slot
    int32_t  n_contexts;
    int32_t  n_slots;       // slots in use
    int32_t  slot_capacity; // slots reserved
    int32_t  min_slots;     // the fewest slots the sizing keeps
    char     source[256];   // where `available` came from (MemAvailable, a cgroup, zipmoe.mem_limit)
    int32_t  pools[4];      // experts per MoE layer in F, C, S, E (all 0: one F pool of every slot)
    char     pools_why[320]; // why those pools (given, planned for the memory left, or one F pool)
};

struct ggml_zipmoe_serving;

// measures the memory, checks the options against the file (pools that hold more experts than a
// layer has, a budget below one expert) and decides the slots to reserve; NULL with a message in
// err on failure
GGML_ZIPMOE_API struct ggml_zipmoe_serving * ggml_zipmoe_serving_new(const struct ggml_zipmoe_serving_params * params,
                                                                     char * err, size_t err_size);
// frees the object and the host slots it reserved (not the cache)
GGML_ZIPMOE_API void ggml_zipmoe_serving_free(struct ggml_zipmoe_serving * s);

GGML_ZIPMOE_API void ggml_zipmoe_serving_get_info(const struct ggml_zipmoe_serving * s,
                                                  struct ggml_zipmoe_serving_info * info);

// slots in a device's memory: free_bytes free there, reserve_bytes of it wanted by everything else
// (weights, KV cache, buffers, zero slots). shares_host_memory: an integrated GPU (Jetson), whose
// memory is the host's: no more than the process may take (info's available) counts as free. Every
// slot then stays in use (F and working slots; host memory holds the stores: ggml_zipmoe_cache_device_pools). Returns the slots to reserve (at least one token's experts
// of a layer); warns when a budget is cut.
GGML_ZIPMOE_API int32_t ggml_zipmoe_serving_fit_device(struct ggml_zipmoe_serving * s, const char * device,
                                                       uint64_t free_bytes, uint64_t reserve_bytes,
                                                       int shares_host_memory);

// n slots of zeros after the host slots, which reserve_host (called after) reserves with them: address
// space that is never written, so never committed. With a GPU beside, ggml may run a host layer's
// products there (its offload of a large batch's products on host weights), where mul_mat_id has no
// id that skips a row: the selections outside a pass then take one of these.
GGML_ZIPMOE_API void ggml_zipmoe_serving_set_host_zero_slots(struct ggml_zipmoe_serving * s, int32_t n);

// slots in host memory: reserves address space for info.capacity slots (and the zero slots after them),
// committed only where a slot is written (fewer, halving, where the kernel refuses that much;
// info.capacity follows). data[k] gets kind k's first slot, stride[k] the bytes between slots. OK, or
// ERR_NOMEM with a message in err.
GGML_ZIPMOE_API int ggml_zipmoe_serving_reserve_host(struct ggml_zipmoe_serving * s, void * data[3], size_t stride[3],
                                                     char * err, size_t err_size);

// slots in host memory the caller allocated instead (a ggml-cpu buffer type that lays weights out its
// own way, for quantized experts): info.capacity slots of info.slot_bytes[k] each from data[k]; the
// pages of slots given up are returned to the system as with reserve_host
GGML_ZIPMOE_API void ggml_zipmoe_serving_adopt_host(struct ggml_zipmoe_serving * s, void * const data[3]);

// the cache made on the slots (info.capacity of them; on_gpu: in device memory): checks that given
// pools fit the budget, uses the fewest slots until a context is sized, and logs the layout.
// OK, or ERR_ARG with a message in err.
GGML_ZIPMOE_API int ggml_zipmoe_serving_set_cache(struct ggml_zipmoe_serving * s, struct ggml_zipmoe_cache * cache,
                                                  int on_gpu, char * err, size_t err_size);

// what the process needs besides the slots, for a sizing
struct ggml_zipmoe_serving_demand {
    uint64_t non_expert;    // non-expert weights in host memory a decode step reads
    uint64_t contexts;      // host memory of the live contexts (KV cache, compute buffers)
    int32_t  n_contexts;
    int32_t  n_threads_max; // graph threads of the widest context (the cache's buffers)
    int32_t  making;        // a context is being made: pools that do not fit are an error
};

// sizes the slots in use and picks the pools for the memory left; returns OK, or ERR_ARG /
// ERR_NOMEM with a message in err (pools given that do not fit while making a context; the cache
// refusing a change: nothing changed then). *changed (may be NULL): the slot layout changed, and
// graphs built for the old one must be rebuilt.
GGML_ZIPMOE_API int ggml_zipmoe_serving_resize(struct ggml_zipmoe_serving * s, const struct ggml_zipmoe_serving_demand * d,
                                               int * changed, char * err, size_t err_size);

// after a graph of a ubatch of n_tokens tokens of n_seqs distinct sequences computed: counts the
// routing of decode steps (n_tokens == n_seqs: one token of each sequence, one decoding or several in
// parallel; a prompt is not counted); after zipmoe.replan_tokens of them, and again each time their
// number doubles, plans the default pools from their rank profile, for the experts a step selected
// (slots in a device's memory: once, adds host stores beside them if those steps missed once per step
// or more). Returns 1 if the slot layout changed (graphs must be rebuilt), else 0.
GGML_ZIPMOE_API int ggml_zipmoe_serving_observe(struct ggml_zipmoe_serving * s, int32_t n_tokens, int32_t n_seqs);

// before ggml_zipmoe_serving_observe for the same ubatch: its token ids (NULL where it came as embeddings).
// Until the re-plan after one sequence's prompt, they are counted by id: a token repeated routes alike, so a
// prompt's routing looks as much more uneven than its router's as the tokens' mean multiplicity (the sum
// over the ids of their count squared, over the tokens), and that re-plan discounts it (Rao-Scott).
GGML_ZIPMOE_API void ggml_zipmoe_serving_observe_tokens(struct ggml_zipmoe_serving * s, const int32_t * tokens,
                                                        int32_t n_tokens, int32_t n_seqs);

// what a sizing keeps beside the slots, the non-expert weights and the contexts, for the graph threads seen so
// far (the plan's cache_buffers and margin): what a context size chosen for the slots' sake must leave too
GGML_ZIPMOE_API void ggml_zipmoe_serving_overhead(const struct ggml_zipmoe_serving * s, uint64_t * cache_buffers,
                                                  uint64_t * margin);

// the last sizing (before the first: what load decided)
GGML_ZIPMOE_API void ggml_zipmoe_serving_get_plan(const struct ggml_zipmoe_serving * s,
                                                  struct ggml_zipmoe_serving_plan * plan);
// the memory the slots are sized from: the last sizing for slots in host memory; for slots in a
// device's memory, that device's (available: its free memory at load, non_expert: what the sizing left
// there for its other weights, buffers and a reserve, fits: the rest; no contexts, buffers or margin)
GGML_ZIPMOE_API void ggml_zipmoe_serving_get_slots_plan(const struct ggml_zipmoe_serving * s,
                                                        struct ggml_zipmoe_serving_plan * plan);

// a sizing as Prometheus text (zipmoe:memory_bytes{part=...}, zipmoe:expert_slot_bytes, zipmoe:contexts)
// written to buf like snprintf; returns the length the whole text needs (0 for a NULL plan)
GGML_ZIPMOE_API size_t ggml_zipmoe_serving_format_metrics(const struct ggml_zipmoe_serving_plan * plan, char * buf,
                                                          size_t size);

// the default pools are in use (resident views stay off then)
GGML_ZIPMOE_API int ggml_zipmoe_serving_auto_pools_active(const struct ggml_zipmoe_serving * s);

#ifdef __cplusplus
}
#endif
