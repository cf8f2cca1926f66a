// ZipMoE GGUF chunk index (docs/FORMAT.md): parsed with ggml's own GGUF reader and validated
// once at open, so that every later read can trust offsets, sizes and codecs.

#define _GNU_SOURCE // O_DIRECT

#include "ggml-zipmoe.h"
#include "common/zipmoe-impl.h"

#include "ggml.h"
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ZIPMOE_MAX_SHARDS   64
#define ZIPMOE_MAX_DIM      (1ll << 24)   // per-dimension sanity bound: fuzzed sizes must not overflow
#define ZIPMOE_MAX_EXPERTS  65536

uint64_t zipmoe_align_up(uint64_t x, uint64_t a) {
    return (x + a - 1) / a * a;
}

void zipmoe_tensor_shard_range(const struct zipmoe_tensor * t, int shards, int k, uint64_t * first, uint64_t * count) {
    if (t->raw) { // a raw expert has no exponent plane: its E-chunks are empty
        *first = 0;
        *count = 0;
        return;
    }
    zipmoe_shard_range(t->n, shards, k, first, count);
}

static void set_error(char * err, size_t err_size, const char * fmt, ...) {
    if (err == NULL || err_size == 0) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_size, fmt, ap);
    va_end(ap);
}

// "blk.N.ffn_{gate,up,down}_exps.weight" -> N, or -1 for any other name
static int expert_tensor_layer(const char * name) {
    int layer = -1, used = 0;
    if (sscanf(name, "blk.%d.%n", &layer, &used) != 1 || used == 0 || layer < 0) {
        return -1;
    }
    const char * rest = name + used;
    if (strcmp(rest, "ffn_gate_exps.weight") != 0 && strcmp(rest, "ffn_up_exps.weight") != 0 &&
        strcmp(rest, "ffn_down_exps.weight") != 0) {
        return -1;
    }
    return layer;
}

// the value of key as an array of n_expected items of type, or NULL if it is anything else
static const void * typed_array(const struct gguf_context * ctx, const char * key, enum gguf_type type,
                                size_t n_expected) {
    const int64_t id = gguf_find_key(ctx, key);
    if (id < 0 || gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(ctx, id) != type ||
        gguf_get_arr_n(ctx, id) != n_expected) {
        return NULL;
    }
    return gguf_get_arr_data(ctx, id);
}

static bool typed_u32(const struct gguf_context * ctx, const char * key, uint32_t * out) {
    const int64_t id = gguf_find_key(ctx, key);
    if (id < 0 || gguf_get_kv_type(ctx, id) != GGUF_TYPE_UINT32) {
        return false;
    }
    *out = gguf_get_val_u32(ctx, id);
    return true;
}

void ggml_zipmoe_file_close(struct ggml_zipmoe_file * file) {
    if (file == NULL) {
        return;
    }
    for (int i = 0; i < file->n_tensors; i++) {
        free(file->tensors[i].name);
        free(file->tensors[i].chunks);
    }
    free(file->tensors);
    if (file->fd >= 0) {
        close(file->fd);
    }
    free(file->path);
    free(file);
}

#define ZIPMOE_KEY_BYTES 512 // a metadata key or chunk tensor name made from a tensor's name (64 past it)

// t's ggml type from zipmoe.tensor.NAME.type: BF16 experts are split; from format version 3, an expert of
// any other ggml type is stored raw
static bool tensor_type(const struct ggml_zipmoe_file * file, const struct gguf_context * ctx, const char * name,
                        struct zipmoe_tensor * t, char * err, size_t err_size) {
    char key[ZIPMOE_KEY_BYTES];
    snprintf(key, sizeof(key), "zipmoe.tensor.%s.type", name);
    uint32_t type = 0;
    if (!typed_u32(ctx, key, &type)) {
        set_error(err, err_size, "%s: ZipMoE metadata: %s is missing or not a u32", file->path, key);
        return false;
    }
    t->type = (int) type;
    t->raw  = type != GGML_TYPE_BF16;
    if (t->raw && (file->version < 3 || type >= GGML_TYPE_COUNT || ggml_blck_size((enum ggml_type) type) <= 0 ||
                   ggml_type_size((enum ggml_type) type) == 0)) {
        set_error(err, err_size, "%s: ZipMoE metadata: %s is %u, %s", file->path, key, type,
                  file->version < 3 ? "not BF16 (30), the only type format versions 1 and 2 have"
                                    : "not a ggml type this build serves");
        return false;
    }
    return true;
}

// t's shape from zipmoe.tensor.NAME.shape, and its sizes: values, SM-chunk, bytes in a slot
static bool tensor_shape(const struct ggml_zipmoe_file * file, const struct gguf_context * ctx, const char * name,
                         struct zipmoe_tensor * t, char * err, size_t err_size) {
    char key[ZIPMOE_KEY_BYTES];
    snprintf(key, sizeof(key), "zipmoe.tensor.%s.shape", name);
    const uint64_t * shape = (const uint64_t *) typed_array(ctx, key, GGUF_TYPE_UINT64, 3);
    if (shape == NULL || shape[0] < 1 || shape[1] < 1 || shape[2] < 1 || shape[0] > ZIPMOE_MAX_DIM ||
        shape[1] > ZIPMOE_MAX_DIM || shape[2] > ZIPMOE_MAX_EXPERTS) {
        set_error(err, err_size, "%s: ZipMoE metadata: %s is missing or not 3 sizes in range", file->path, key);
        return false;
    }
    for (int d = 0; d < 3; d++) {
        t->ne[d] = (int64_t) shape[d];
    }
    t->n = shape[0] * shape[1];
    const enum ggml_type type = (enum ggml_type) t->type;
    if (t->raw && shape[0] % (uint64_t) ggml_blck_size(type) != 0) {
        set_error(err, err_size, "%s: ZipMoE metadata: %s is %llu wide, not a whole number of %s blocks of %lld",
                  file->path, name, (unsigned long long) shape[0], ggml_type_name(type),
                  (long long) ggml_blck_size(type));
        return false;
    }
    t->sm_size = t->raw ? (uint64_t) ggml_row_size(type, t->ne[0]) * shape[1] : t->n;
    t->bytes   = t->raw ? t->sm_size : 2 * t->n;
    return true;
}

// where the chunks of tensor name live: the I8 tensor named like it with .zipmoe for .weight
static bool chunk_tensor(const struct ggml_zipmoe_file * file, const struct gguf_context * ctx, const char * name,
                         uint64_t * offset, uint64_t * size, char * err, size_t err_size) {
    char blob[ZIPMOE_KEY_BYTES];
    snprintf(blob, sizeof(blob), "%.*s.zipmoe", (int) (strlen(name) - strlen(".weight")), name);
    const int64_t tid = gguf_find_tensor(ctx, blob);
    const int64_t * bne = tid < 0 ? NULL : gguf_get_tensor_ne(ctx, tid);
    if (tid < 0 || gguf_get_tensor_type(ctx, tid) != GGML_TYPE_I8 || bne[1] != 1 || bne[2] != 1 || bne[3] != 1) {
        set_error(err, err_size, "%s: ZipMoE metadata: chunk tensor %s is missing or malformed", file->path, blob);
        return false;
    }
    *offset = gguf_get_data_offset(ctx) + gguf_get_tensor_offset(ctx, tid);
    *size   = gguf_get_tensor_size(ctx, tid);
    if (*offset % GGML_ZIPMOE_CHUNK_ALIGNMENT != 0) {
        set_error(err, err_size, "%s: chunk tensor %s starts at offset %llu, not a multiple of %d", file->path, blob,
                  (unsigned long long) *offset, GGML_ZIPMOE_CHUNK_ALIGNMENT);
        return false;
    }
    return true;
}

// the chunk index of tensor name: its n_chunks offsets, sizes, checksums (u64) and codecs (u8)
struct chunk_index {
    const uint64_t * offsets;
    const uint64_t * sizes;
    const uint64_t * checksums;
    const uint8_t *  codecs;
};

static bool chunk_index(const struct ggml_zipmoe_file * file, const struct gguf_context * ctx, const char * name,
                        uint64_t n_chunks, struct chunk_index * index, char * err, size_t err_size) {
    const char * what[4] = { "chunk_offset", "chunk_size", "chunk_checksum", "chunk_codec" };
    const void * arrays[4];
    for (int a = 0; a < 4; a++) {
        char key[ZIPMOE_KEY_BYTES];
        snprintf(key, sizeof(key), "zipmoe.tensor.%s.%s", name, what[a]);
        arrays[a] = typed_array(ctx, key, a == 3 ? GGUF_TYPE_UINT8 : GGUF_TYPE_UINT64, n_chunks);
        if (arrays[a] == NULL) {
            set_error(err, err_size, "%s: ZipMoE metadata: %s is missing or does not hold %llu %s", file->path, key,
                      (unsigned long long) n_chunks, a == 3 ? "u8" : "u64");
            return false;
        }
    }
    index->offsets   = (const uint64_t *) arrays[0];
    index->sizes     = (const uint64_t *) arrays[1];
    index->checksums = (const uint64_t *) arrays[2];
    index->codecs    = (const uint8_t *) arrays[3];
    return true;
}

// what is wrong with chunk j of t (chunk c of its expert: 0 the SM-chunk, k > 0 the E-chunk of shard
// k - 1) in a chunk tensor of blob_size bytes, or NULL
static const char * chunk_problem(const struct ggml_zipmoe_file * file, const struct zipmoe_tensor * t,
                                  const struct chunk_index * index, uint64_t j, int c, uint64_t blob_size) {
    uint64_t first = 0, count = t->sm_size;
    if (c > 0) {
        zipmoe_tensor_shard_range(t, file->n_shards, c - 1, &first, &count);
    }
    const uint64_t size = index->sizes[j], offset = index->offsets[j];
    const uint8_t  codec = index->codecs[j];
    if (size > blob_size || offset > blob_size - size) {
        return "lies outside its tensor";
    } else if (offset % GGML_ZIPMOE_CHUNK_ALIGNMENT != 0) {
        return "is not aligned to 4096 bytes";
    } else if (codec >= GGML_ZIPMOE_CODEC_COUNT) {
        return "has an unknown codec";
    } else if (codec == GGML_ZIPMOE_CODEC_GHUF && file->version < 2) {
        return "uses codec ghuf, which format version 1 does not have";
    } else if (c == 0 && (codec != GGML_ZIPMOE_CODEC_RAW || size != t->sm_size)) {
        return t->raw ? "is not a raw chunk of the expert's bytes" : "is not a raw chunk of one byte per value";
    } else if (t->raw && c > 0 && (codec != GGML_ZIPMOE_CODEC_RAW || size != 0)) {
        return "is not empty, as a raw tensor's E-chunks are";
    } else if (codec == GGML_ZIPMOE_CODEC_RAW && size != count) {
        return "is raw but its size is not its value count";
    } else if (count > 0 && size == 0) {
        return "is empty";
    }
    return NULL;
}

// t's chunks from the index, each checked, at their place in the file
static bool load_chunks(struct ggml_zipmoe_file * file, const char * name, const struct chunk_index * index,
                        uint64_t n_chunks, uint64_t blob_offset, uint64_t blob_size, struct zipmoe_tensor * t,
                        char * err, size_t err_size) {
    const int per = 1 + file->n_shards;
    t->chunks = (struct zipmoe_chunk *) calloc(n_chunks, sizeof(*t->chunks));
    if (t->chunks == NULL) {
        set_error(err, err_size, "%s: out of memory", file->path);
        return false;
    }
    for (uint64_t j = 0; j < n_chunks; j++) {
        const int expert = (int) (j / per), c = (int) (j % per);
        const char * problem = chunk_problem(file, t, index, j, c, blob_size);
        if (problem != NULL) {
            char what[32];
            snprintf(what, sizeof(what), c == 0 ? "SM-chunk" : "E-chunk (shard %d)", c - 1);
            set_error(err, err_size, "%s: layer %d, tensor %s, expert %d, %s %s (corrupt index)", file->path, t->layer,
                      name, expert, what, problem);
            return false;
        }
        t->chunks[j].offset   = blob_offset + index->offsets[j];
        t->chunks[j].size     = index->sizes[j];
        t->chunks[j].checksum = index->checksums[j];
        t->chunks[j].codec    = index->codecs[j];
        if (index->sizes[j] > file->max_chunk_size) {
            file->max_chunk_size = index->sizes[j];
        }
    }
    return true;
}

// fills t from the metadata of tensor name; returns false with err set when anything is off
static bool load_tensor(struct ggml_zipmoe_file * file, const struct gguf_context * ctx, const char * name,
                        uint64_t file_size, struct zipmoe_tensor * t, char * err, size_t err_size) {
    t->layer = expert_tensor_layer(name);
    if (t->layer < 0 || strlen(name) + 64 > ZIPMOE_KEY_BYTES) {
        set_error(err, err_size, "%s: zipmoe.tensors names '%s', which is not a routed-expert tensor", file->path,
                  name);
        return false;
    }
    t->name = strdup(name);
    if (t->name == NULL) {
        set_error(err, err_size, "%s: out of memory", file->path);
        return false;
    }
    uint64_t blob_offset = 0, blob_size = 0;
    if (!tensor_type(file, ctx, name, t, err, err_size) || !tensor_shape(file, ctx, name, t, err, err_size) ||
        !chunk_tensor(file, ctx, name, &blob_offset, &blob_size, err, err_size)) {
        return false;
    }
    const uint64_t     n_chunks = (uint64_t) t->ne[2] * (uint64_t) (1 + file->n_shards);
    struct chunk_index index;
    if (!chunk_index(file, ctx, name, n_chunks, &index, err, err_size) ||
        !load_chunks(file, name, &index, n_chunks, blob_offset, blob_size, t, err, err_size)) {
        return false;
    }
    if (blob_offset + blob_size > file_size) {
        set_error(err, err_size, "%s: the chunks of tensor %s lie beyond the end of the file (%llu bytes): "
                  "the file is truncated", file->path, name, (unsigned long long) file_size);
        return false;
    }
    if (t->sm_size > file->max_sm_size) {
        file->max_sm_size = t->sm_size;
    }
    return true;
}

static bool load_index(struct ggml_zipmoe_file * file, const struct gguf_context * ctx, uint64_t file_size,
                       char * err, size_t err_size) {
    const char * path = file->path;
    uint32_t version = 0, shards = 0, alignment = 0;
    if (gguf_find_key(ctx, "zipmoe.format_version") < 0) {
        set_error(err, err_size, "%s is not a ZipMoE GGUF (no zipmoe.format_version)", path);
        return false;
    }
    if (!typed_u32(ctx, "zipmoe.format_version", &version)) {
        set_error(err, err_size, "%s: zipmoe.format_version is not a u32", path);
        return false;
    }
    if (version < 1 || version > GGML_ZIPMOE_FORMAT_VERSION) {
        set_error(err, err_size, "%s: ZipMoE format version %u is not supported (this build reads versions 1 to %d)",
                  path, version, GGML_ZIPMOE_FORMAT_VERSION);
        return false;
    }
    file->version = (int) version;
    if (!typed_u32(ctx, "zipmoe.shards", &shards) || shards < 1 || shards > ZIPMOE_MAX_SHARDS) {
        set_error(err, err_size, "%s: ZipMoE metadata: zipmoe.shards is missing or not in 1..%d", path,
                  ZIPMOE_MAX_SHARDS);
        return false;
    }
    if (!typed_u32(ctx, "zipmoe.chunk_alignment", &alignment) || alignment != GGML_ZIPMOE_CHUNK_ALIGNMENT) {
        set_error(err, err_size, "%s: ZipMoE metadata: zipmoe.chunk_alignment is missing or not %d", path,
                  GGML_ZIPMOE_CHUNK_ALIGNMENT);
        return false;
    }
    file->n_shards = (int) shards;

    const int64_t id = gguf_find_key(ctx, "zipmoe.tensors");
    if (id < 0 || gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(ctx, id) != GGUF_TYPE_STRING) {
        set_error(err, err_size, "%s: ZipMoE metadata: zipmoe.tensors is missing or not a string array", path);
        return false;
    }
    const size_t n = gguf_get_arr_n(ctx, id);
    if (n > (size_t) gguf_get_n_tensors(ctx)) {
        set_error(err, err_size, "%s: ZipMoE metadata: zipmoe.tensors lists more tensors than the file has", path);
        return false;
    }
    file->tensors = (struct zipmoe_tensor *) calloc(n == 0 ? 1 : n, sizeof(*file->tensors));
    if (file->tensors == NULL) {
        set_error(err, err_size, "%s: out of memory", path);
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        const char * name = gguf_get_arr_str(ctx, id, i);
        for (size_t j = 0; j < i; j++) {
            if (strcmp(file->tensors[j].name, name) == 0) {
                set_error(err, err_size, "%s: ZipMoE metadata: zipmoe.tensors lists %s twice", path, name);
                return false;
            }
        }
        file->n_tensors = (int) i + 1; // counted before loading so that close frees a half-loaded tensor
        if (!load_tensor(file, ctx, name, file_size, &file->tensors[i], err, err_size)) {
            return false;
        }
    }
    return true;
}

struct ggml_zipmoe_file * ggml_zipmoe_file_open(const char * path, unsigned flags, char * err, size_t err_size) {
    set_error(err, err_size, "%s", "");
    if (path == NULL || (flags & ~(unsigned) (GGML_ZIPMOE_OPEN_DIRECT | GGML_ZIPMOE_OPEN_DIRECT_IF_SUPPORTED)) != 0) {
        set_error(err, err_size, "ggml_zipmoe_file_open: invalid argument");
        return NULL;
    }
    struct ggml_zipmoe_file * file = (struct ggml_zipmoe_file *) calloc(1, sizeof(*file));
    if (file == NULL || (file->path = strdup(path)) == NULL) {
        free(file);
        set_error(err, err_size, "%s: out of memory", path);
        return NULL;
    }

    // O_DIRECT where asked; with GGML_ZIPMOE_OPEN_DIRECT_IF_SUPPORTED, plain reads where the
    // filesystem refuses it (tmpfs, some network filesystems)
    const int want_direct = (flags & (GGML_ZIPMOE_OPEN_DIRECT | GGML_ZIPMOE_OPEN_DIRECT_IF_SUPPORTED)) != 0;
    file->flags = flags & ~(unsigned) (GGML_ZIPMOE_OPEN_DIRECT | GGML_ZIPMOE_OPEN_DIRECT_IF_SUPPORTED);
    file->fd = -1;
#ifdef O_DIRECT
    if (want_direct) {
        file->fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (file->fd >= 0) {
            file->flags |= GGML_ZIPMOE_OPEN_DIRECT;
        } else if (errno == EINVAL && (flags & GGML_ZIPMOE_OPEN_DIRECT)) {
            set_error(err, err_size, "%s: the filesystem does not support direct I/O (O_DIRECT); "
                      "turn direct I/O off", path);
            ggml_zipmoe_file_close(file);
            return NULL;
        } else if (errno != EINVAL) {
            set_error(err, err_size, "%s: cannot open: %s", path, strerror(errno));
            ggml_zipmoe_file_close(file);
            return NULL;
        }
    }
#else
    if (flags & GGML_ZIPMOE_OPEN_DIRECT) {
        set_error(err, err_size, "%s: direct I/O (O_DIRECT) is not available on this platform", path);
        ggml_zipmoe_file_close(file);
        return NULL;
    }
#endif
    if (file->fd < 0) {
        file->fd = open(path, O_RDONLY | O_CLOEXEC);
    }
    if (file->fd < 0) {
        set_error(err, err_size, "%s: cannot open: %s", path, strerror(errno));
        ggml_zipmoe_file_close(file);
        return NULL;
    }
    struct stat st;
    if (fstat(file->fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        set_error(err, err_size, "%s: not a regular file", path);
        ggml_zipmoe_file_close(file);
        return NULL;
    }

    // metadata only (no_alloc): ggml's GGUF reader checks the header structure and tensor infos
    struct gguf_init_params params = { /*.no_alloc =*/ true, /*.ctx =*/ NULL };
    struct gguf_context * ctx = gguf_init_from_file(path, params);
    if (ctx == NULL) {
        set_error(err, err_size, "%s: not a valid GGUF file (ggml's GGUF reader refused it)", path);
        ggml_zipmoe_file_close(file);
        return NULL;
    }
    const bool ok = load_index(file, ctx, (uint64_t) st.st_size, err, err_size);
    gguf_free(ctx);
    if (!ok) {
        ggml_zipmoe_file_close(file);
        return NULL;
    }
    return file;
}

const char * ggml_zipmoe_file_path(const struct ggml_zipmoe_file * file) {
    return file->path;
}

int ggml_zipmoe_file_is_direct(const struct ggml_zipmoe_file * file) {
    return file != NULL && (file->flags & GGML_ZIPMOE_OPEN_DIRECT) != 0;
}

int ggml_zipmoe_file_n_shards(const struct ggml_zipmoe_file * file) {
    return file->n_shards;
}

int ggml_zipmoe_file_n_tensors(const struct ggml_zipmoe_file * file) {
    return file->n_tensors;
}

size_t ggml_zipmoe_file_max_chunk_size(const struct ggml_zipmoe_file * file) {
    return (size_t) file->max_chunk_size;
}

size_t ggml_zipmoe_file_chunk_buffer_size(const struct ggml_zipmoe_file * file) {
    return (size_t) zipmoe_align_up(file->max_chunk_size > 0 ? file->max_chunk_size : 1, GGML_ZIPMOE_CHUNK_ALIGNMENT);
}

static const struct zipmoe_tensor * tensor_at(const struct ggml_zipmoe_file * file, int tensor) {
    return file != NULL && tensor >= 0 && tensor < file->n_tensors ? &file->tensors[tensor] : NULL;
}

const char * ggml_zipmoe_file_tensor_name(const struct ggml_zipmoe_file * file, int tensor) {
    const struct zipmoe_tensor * t = tensor_at(file, tensor);
    return t != NULL ? t->name : NULL;
}

int ggml_zipmoe_file_tensor_layer(const struct ggml_zipmoe_file * file, int tensor) {
    const struct zipmoe_tensor * t = tensor_at(file, tensor);
    return t != NULL ? t->layer : -1;
}

int ggml_zipmoe_file_tensor_type(const struct ggml_zipmoe_file * file, int tensor) {
    const struct zipmoe_tensor * t = tensor_at(file, tensor);
    return t != NULL ? t->type : -1;
}

size_t ggml_zipmoe_file_tensor_expert_bytes(const struct ggml_zipmoe_file * file, int tensor) {
    const struct zipmoe_tensor * t = tensor_at(file, tensor);
    return t != NULL ? (size_t) t->bytes : 0;
}

void ggml_zipmoe_file_tensor_shape(const struct ggml_zipmoe_file * file, int tensor, int64_t ne[3]) {
    const struct zipmoe_tensor * t = tensor_at(file, tensor);
    for (int d = 0; d < 3; d++) {
        ne[d] = t != NULL ? t->ne[d] : 0;
    }
}

int ggml_zipmoe_file_find_tensor(const struct ggml_zipmoe_file * file, const char * name) {
    for (int i = 0; file != NULL && name != NULL && i < file->n_tensors; i++) {
        if (strcmp(file->tensors[i].name, name) == 0) {
            return i;
        }
    }
    return -1;
}

const struct zipmoe_chunk * zipmoe_file_chunk(const struct ggml_zipmoe_file * file, int tensor, int expert, int chunk) {
    const struct zipmoe_tensor * t = tensor_at(file, tensor);
    if (t == NULL || expert < 0 || expert >= t->ne[2] || chunk < 0 || chunk > file->n_shards) {
        return NULL;
    }
    return &t->chunks[(size_t) expert * (size_t) (1 + file->n_shards) + (size_t) chunk];
}

int ggml_zipmoe_file_chunk(const struct ggml_zipmoe_file * file, int tensor, int expert, int chunk,
                           struct ggml_zipmoe_chunk_info * info) {
    const struct zipmoe_chunk * c = zipmoe_file_chunk(file, tensor, expert, chunk);
    if (c == NULL || info == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const struct zipmoe_tensor * t = &file->tensors[tensor];
    info->offset   = c->offset;
    info->size     = c->size;
    info->checksum = c->checksum;
    info->codec    = c->codec;
    info->shard    = chunk - 1;
    info->first    = 0;
    info->count    = t->sm_size;
    if (chunk > 0) {
        zipmoe_tensor_shard_range(t, file->n_shards, chunk - 1, &info->first, &info->count);
    }
    return GGML_ZIPMOE_OK;
}

void ggml_zipmoe_file_describe_chunk(const struct ggml_zipmoe_file * file, int tensor, int expert, int chunk,
                                     char * buf, size_t size) {
    if (buf == NULL || size == 0) {
        return;
    }
    const struct zipmoe_tensor * t = tensor_at(file, tensor);
    char what[32];
    if (chunk == 0) {
        snprintf(what, sizeof(what), "SM-chunk");
    } else {
        snprintf(what, sizeof(what), "E-chunk (shard %d)", chunk - 1);
    }
    if (t == NULL) {
        snprintf(buf, size, "tensor #%d, expert %d, %s", tensor, expert, what);
    } else {
        snprintf(buf, size, "layer %d, tensor %s, expert %d, %s", t->layer, t->name, expert, what);
    }
}
