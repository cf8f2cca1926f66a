// Chunk reads from a ZipMoE GGUF (pread, optionally O_DIRECT) and whole-expert reads (the
// library's one decode + recover routine, shard by shard): every chunk's checksum is checked
// before its bytes are used.

#include "ggml-zipmoe.h"
#include "common/zipmoe-impl.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// reads [offset, offset + size) fully (retrying short reads and EINTR); returns bytes read,
// which is less than size only at the end of the file, or -1 with errno set
static int64_t pread_full(int fd, uint8_t * buf, uint64_t size, uint64_t offset) {
    uint64_t done = 0;
    while (done < size) {
        const ssize_t r = pread(fd, buf + done, (size_t) (size - done), (off_t) (offset + done));
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        if (r == 0) {
            break;
        }
        done += (uint64_t) r;
    }
    return (int64_t) done;
}

int zipmoe_read_chunk_unchecked(const struct ggml_zipmoe_file * file, const struct zipmoe_chunk * c, uint8_t * buf,
                                size_t capacity, int * sys_errno) {
    *sys_errno = 0;
    const int direct = (file->flags & GGML_ZIPMOE_OPEN_DIRECT) != 0;
    // O_DIRECT transfers whole aligned blocks; the tail past the chunk is padding or other chunks
    const uint64_t want = direct ? zipmoe_align_up(c->size, GGML_ZIPMOE_CHUNK_ALIGNMENT) : c->size;
    if (buf == NULL || capacity < want ||
        (direct && ((uintptr_t) buf % GGML_ZIPMOE_CHUNK_ALIGNMENT) != 0)) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    const int64_t got = pread_full(file->fd, buf, want, c->offset);
    if (got < 0) {
        *sys_errno = errno;
        return GGML_ZIPMOE_ERR_IO;
    }
    if ((uint64_t) got < c->size) {
        return GGML_ZIPMOE_ERR_IO; // the file shrank after it was opened
    }
    return GGML_ZIPMOE_OK;
}

// reads a chunk's stored bytes and checks them; *sys_errno gets errno of a failed read (else 0)
static int read_chunk(const struct ggml_zipmoe_file * file, const struct zipmoe_chunk * c, uint8_t * buf,
                      size_t capacity, int * sys_errno) {
    const int status = zipmoe_read_chunk_unchecked(file, c, buf, capacity, sys_errno);
    if (status != GGML_ZIPMOE_OK) {
        return status;
    }
    return ggml_zipmoe_checksum(buf, c->size) == c->checksum ? GGML_ZIPMOE_OK : GGML_ZIPMOE_ERR_CHECKSUM;
}

int ggml_zipmoe_file_read_chunk(const struct ggml_zipmoe_file * file, int tensor, int expert, int chunk, void * buf,
                                size_t capacity) {
    const struct zipmoe_chunk * c = zipmoe_file_chunk(file, tensor, expert, chunk);
    if (c == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    int sys_errno;
    return read_chunk(file, c, (uint8_t *) buf, capacity, &sys_errno);
}

struct ggml_zipmoe_reader {
    const struct ggml_zipmoe_file * file;
    struct ggml_zipmoe_decoder *    decoder;
    uint8_t *                       sm;       // SM-chunk of one expert (aligned, O_DIRECT-sized)
    size_t                          sm_cap;
    uint8_t *                       stored;   // one E-chunk as stored (aligned, O_DIRECT-sized)
    size_t                          stored_cap;
    char                            error[768];
};

static void * aligned_buffer(size_t size) {
    void * p = NULL;
    return posix_memalign(&p, GGML_ZIPMOE_CHUNK_ALIGNMENT, size == 0 ? GGML_ZIPMOE_CHUNK_ALIGNMENT : size) == 0 ? p : NULL;
}

struct ggml_zipmoe_reader * ggml_zipmoe_reader_new(const struct ggml_zipmoe_file * file) {
    if (file == NULL) {
        return NULL;
    }
    struct ggml_zipmoe_reader * r = (struct ggml_zipmoe_reader *) calloc(1, sizeof(*r));
    if (r == NULL) {
        return NULL;
    }
    r->file       = file;
    r->sm_cap     = (size_t) zipmoe_align_up(file->max_sm_size, GGML_ZIPMOE_CHUNK_ALIGNMENT);
    r->stored_cap = ggml_zipmoe_file_chunk_buffer_size(file);
    r->decoder    = ggml_zipmoe_decoder_new();
    r->sm         = (uint8_t *) aligned_buffer(r->sm_cap);
    r->stored     = (uint8_t *) aligned_buffer(r->stored_cap);
    if (r->decoder == NULL || r->sm == NULL || r->stored == NULL) {
        ggml_zipmoe_reader_free(r);
        return NULL;
    }
    return r;
}

void ggml_zipmoe_reader_free(struct ggml_zipmoe_reader * reader) {
    if (reader != NULL) {
        ggml_zipmoe_decoder_free(reader->decoder);
        free(reader->sm);
        free(reader->stored);
        free(reader);
    }
}

const char * ggml_zipmoe_reader_error(const struct ggml_zipmoe_reader * reader) {
    return reader != NULL ? reader->error : "no reader";
}

void zipmoe_describe_failure(const struct ggml_zipmoe_file * file, int status, int tensor, int expert, int chunk,
                             int sys_errno, char * buf, size_t size) {
    char where[512];
    ggml_zipmoe_file_describe_chunk(file, tensor, expert, chunk, where, sizeof(where));
    switch (status) {
        case GGML_ZIPMOE_ERR_CHECKSUM:
            snprintf(buf, size, "checksum mismatch in %s", where);
            break;
        case GGML_ZIPMOE_ERR_IO:
            if (sys_errno != 0) {
                snprintf(buf, size, "reading %s failed: %s", where, strerror(sys_errno));
            } else {
                snprintf(buf, size, "%s is truncated (the file is shorter than its index)", where);
            }
            break;
        case GGML_ZIPMOE_ERR_CORRUPT:
            snprintf(buf, size, "%s does not decode: %s", where, ggml_zipmoe_status_string(status));
            break;
        default:
            snprintf(buf, size, "%s: %s", where, ggml_zipmoe_status_string(status));
    }
}

static int fail(struct ggml_zipmoe_reader * r, int status, int tensor, int expert, int chunk, int sys_errno) {
    zipmoe_describe_failure(r->file, status, tensor, expert, chunk, sys_errno, r->error, sizeof(r->error));
    return status;
}

int ggml_zipmoe_read_expert(struct ggml_zipmoe_reader * r, int tensor, int expert, void * dst) {
    if (r == NULL || dst == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    r->error[0] = '\0';
    const struct ggml_zipmoe_file * file = r->file;
    const struct zipmoe_chunk *     sm   = zipmoe_file_chunk(file, tensor, expert, 0);
    if (sm == NULL) {
        snprintf(r->error, sizeof(r->error), "%s: no expert %d in repacked tensor #%d", file->path, expert, tensor);
        return GGML_ZIPMOE_ERR_ARG;
    }
    const uint64_t n = file->tensors[tensor].n;
    int sys_errno;
    int status = read_chunk(file, sm, r->sm, r->sm_cap, &sys_errno);
    if (status != GGML_ZIPMOE_OK) {
        return fail(r, status, tensor, expert, 0, sys_errno);
    }
    if (file->tensors[tensor].raw) { // the expert's bytes, as stored (its E-chunks are empty)
        memcpy(dst, r->sm, sm->size);
        return GGML_ZIPMOE_OK;
    }
    for (int k = 0; k < file->n_shards; k++) {
        const struct zipmoe_chunk * c = zipmoe_file_chunk(file, tensor, expert, 1 + k);
        status = read_chunk(file, c, r->stored, r->stored_cap, &sys_errno);
        if (status == GGML_ZIPMOE_OK) {
            status = zipmoe_shard_decode_recover(r->decoder, c->codec, r->stored, c->size, r->sm, n, file->n_shards, k,
                                                 (uint16_t *) dst);
        }
        if (status != GGML_ZIPMOE_OK) {
            return fail(r, status, tensor, expert, 1 + k, sys_errno);
        }
    }
    return GGML_ZIPMOE_OK;
}
