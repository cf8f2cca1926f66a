// Slots in a device's memory (a GPU's, an rpc-server's): how many fit beside what else the device holds,
// and the plan that reports that device's memory rather than the host's.

#include "serving/zipmoe-serving-impl.h"
#include "common/zipmoe-impl.h"

#include <stdio.h>
#include <string.h>

int32_t ggml_zipmoe_serving_fit_device(struct ggml_zipmoe_serving * s, const char * device, uint64_t free_bytes,
                                       uint64_t reserve_bytes, int shares_host_memory) {
    struct ggml_zipmoe_serving_info * in = &s->info;
    if (shares_host_memory && s->available != 0 && s->available < free_bytes) {
        // an integrated GPU's memory is the host's: the process's limit (its cgroup, zipmoe.mem_limit)
        // bounds the slots too, where the device reports all the RAM free
        zipmoe_serving_log(s, 0, "%s shares the host's memory: %s of %s free counted (%s)", device,
                           zipmoe_size_text(s->available), zipmoe_size_text(free_bytes), s->source);
        free_bytes = s->available;
        snprintf(s->device_source, sizeof(s->device_source), "%s shares the host's memory: %s", device, s->source);
    } else {
        snprintf(s->device_source, sizeof(s->device_source), "%s's free memory", device);
    }
    s->device_free    = free_bytes;
    s->device_reserve = reserve_bytes;
    const int32_t all_slots = MAX(1, s->info.n_experts);
    const uint64_t room     = free_bytes > reserve_bytes ? free_bytes - reserve_bytes : 0;
    const int32_t fit       = (int32_t) MIN(room / in->expert_bytes, (uint64_t) INT32_MAX);
    const int32_t fewest    = MIN(all_slots, s->p.n_expert_used);
    if (!in->with_pools && s->p.budget == 0) {
        in->capacity = MAX(MIN(all_slots, fit), fewest);
    } else if (!in->with_pools && in->capacity > fit) {
        const int32_t n = MAX(fit, fewest);
        zipmoe_serving_log(s, 1, "%s of %s does not fit in %s's %s free beside %s of other weights and "
                           "buffers: %d slots (%s)", s->budget_name, zipmoe_size_text(s->p.budget), device,
                           zipmoe_size_text(free_bytes), zipmoe_size_text(reserve_bytes), n,
                           zipmoe_size_text((uint64_t) n * in->expert_bytes));
        in->capacity = n;
    }
    s->on_gpu   = true;
    in->fewest  = in->capacity; // every slot in use
    return in->capacity;
}

void ggml_zipmoe_serving_get_slots_plan(const struct ggml_zipmoe_serving * s, struct ggml_zipmoe_serving_plan * plan) {
    *plan = s->plan;
    if (!s->on_gpu) {
        return;
    }
    plan->available  = s->device_free;
    plan->non_expert = s->device_reserve;
    plan->contexts   = plan->cache_buffers = plan->margin = 0;
    plan->n_contexts = 0;
    plan->fits       = s->device_free > s->device_reserve ? s->device_free - s->device_reserve : 0;
    snprintf(plan->source, sizeof(plan->source), "%s", s->device_source);
}
