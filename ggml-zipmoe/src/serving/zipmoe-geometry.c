// The served experts' geometry (ggml_zipmoe_serving_info): one slot shape per kind, the bytes of a slot and
// of every expert, and how many experts there are, from the file's index and the layers served.

#include "serving/zipmoe-serving-impl.h"
#include "common/zipmoe-impl.h"

#include <stdio.h>
#include <string.h>

// routed experts of every MoE layer: the most slots ever in use. Not the experts' bytes in slots: a quantized
// file may type layers apart (Q4_K_M: Q6_K down experts in half of them), and every slot has the largest's size
static int32_t expert_count(const struct ggml_zipmoe_serving * s) {
    int64_t n = 0;
    for (int l = 0; l < s->p.n_layer; ++l) {
        const int t = s->layer_tensors[3 * l];
        if (t >= 0) {
            int64_t ne[3];
            ggml_zipmoe_file_tensor_shape(s->p.file, t, ne);
            n += ne[2];
        }
    }
    return (int32_t) MIN(n, (int64_t) INT32_MAX);
}

// the experts' geometry from the file: one slot shape per kind (the cache checks every layer has it)
int zipmoe_serving_measure_experts(struct ggml_zipmoe_serving * s, char * err, size_t err_size) {
    static const char * const kinds[3] = { "gate", "up", "down" };
    const struct ggml_zipmoe_file * file = s->p.file;
    struct ggml_zipmoe_serving_info * in = &s->info;
    int first = -1;
    for (int l = 0; l < s->p.n_layer && first < 0; ++l) {
        const int32_t * t = s->layer_tensors + 3 * l;
        if (t[0] < 0 && t[1] < 0 && t[2] < 0) {
            continue;
        }
        for (int k = 0; k < 3; ++k) {
            if (t[k] < 0) {
                const int any = t[0] >= 0 ? t[0] : t[1] >= 0 ? t[1] : t[2];
                snprintf(err, err_size, "%s: %s is repacked but its layer's %s experts are not",
                         ggml_zipmoe_file_path(file), ggml_zipmoe_file_tensor_name(file, any), kinds[k]);
                return GGML_ZIPMOE_ERR_FORMAT;
            }
        }
        first = l;
    }
    if (first < 0) {
        snprintf(err, err_size, "%s: no layer has repacked gate, up and down experts", ggml_zipmoe_file_path(file));
        return GGML_ZIPMOE_ERR_FORMAT;
    }
    for (int k = 0; k < 3; ++k) {
        int64_t ne[3];
        ggml_zipmoe_file_tensor_shape(file, s->layer_tensors[3 * first + k], ne);
        in->slot_ne[k][0] = ne[0];
        in->slot_ne[k][1] = ne[1];
    }
    for (int l = 0; l < s->p.n_layer; ++l) {
        // a slot of a kind holds any layer's expert: the largest (a quantized file may type layers apart)
        for (int k = 0; k < 3 && s->layer_tensors[3 * l] >= 0; ++k) {
            const int t = s->layer_tensors[3 * l + k];
            in->slot_bytes[k] = MAX(in->slot_bytes[k], (uint64_t) ggml_zipmoe_file_tensor_expert_bytes(file, t));
            in->raw |= ggml_zipmoe_file_tensor_type(file, t) != 30 /* GGML_TYPE_BF16 */;
        }
    }
    in->expert_bytes = in->slot_bytes[0] + in->slot_bytes[1] + in->slot_bytes[2];
    for (int i = 0; i < ggml_zipmoe_file_n_tensors(file); ++i) {
        int64_t ne[3];
        ggml_zipmoe_file_tensor_shape(file, i, ne);
        in->all_experts += (uint64_t) ggml_zipmoe_file_tensor_expert_bytes(file, i) * (uint64_t) ne[2];
        in->n_moe_layers += strstr(ggml_zipmoe_file_tensor_name(file, i), "ffn_gate_exps") != NULL;
        in->max_expert = MAX(in->max_expert, (int32_t) ne[2]);
    }
    in->n_experts = expert_count(s);
    return GGML_ZIPMOE_OK;
}
