// Pages of the memory the cache writes (slots, stores): given back to the system when nothing reads
// them any more, and for memory written the first time, transparent huge pages where the
// kernel offers them on request (/sys/kernel/mm/transparent_hugepage/enabled "madvise"). A first
// write of 3 GB ran at 0.84-1.79 GB/s in 4 KiB pages and 2.72-3.53 GB/s in 2 MiB ones on the bench VM;
// later writes ran alike. Only the 2 MiB-aligned pieces within [addr, addr + size) can be huge; a MADV_DONTNEED of
// part of one splits it.
//
// A store's entry that a change of pools gives up can hand its pages to the slots the change fills
// (zipmoe_move_pages): memory already written keeps its frames, and the slots skip the faults and
// zeroing of a first write, the bulk of a change's time on the bench VM (four Qwen1.5-MoE sequences at
// 20 GiB: the change's experts moved in 2.1-3.6 s instead of 3.1-5.7).

#if defined(__linux__)
#define _GNU_SOURCE // mremap
#endif

#include "common/zipmoe-impl.h"
#include "ggml-zipmoe-test.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

// the whole pages within [addr, addr + size): *lo, *hi; false if there is none
static int page_interior(void * addr, size_t size, uintptr_t * lo, uintptr_t * hi) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    *lo = ((uintptr_t) addr + page - 1) / page * page;
    *hi = ((uintptr_t) addr + size) / page * page;
    return *hi > *lo;
}

void zipmoe_advise_huge_pages(void * addr, size_t size) {
#if defined(MADV_HUGEPAGE)
    uintptr_t lo, hi;
    if (page_interior(addr, size, &lo, &hi)) {
        madvise((void *) lo, hi - lo, MADV_HUGEPAGE); // advice: a kernel without THP refuses, nothing changes
    }
#else
    (void) addr;
    (void) size;
#endif
}

void zipmoe_release_pages(void * addr, size_t size) {
    uintptr_t lo, hi;
    if (page_interior(addr, size, &lo, &hi)) {
        madvise((void *) lo, hi - lo, MADV_DONTNEED);
    }
}

#if defined(__linux__)
#define ZIPMOE_MOVES_PAGES 1
#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4 // <linux/mman.h>; glibc's headers have it from 2.32
#endif

// one page written, moved with MREMAP_DONTUNMAP: 1 where the kernel does it as documented (Linux 5.7+
// for private anonymous memory), 0 where it refuses (older kernels, seccomp filters)
static int probe_move(void) {
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    uint8_t * src = (uint8_t *) mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (src == MAP_FAILED) {
        return 0;
    }
    uint8_t * dst = src + page;
    src[0] = 0x5a;
    dst[0] = 0;
    const int ok = mremap(src, page, page, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, dst) == (void *) dst &&
                   dst[0] == 0x5a && src[0] == 0;
    munmap(src, 2 * page);
    return ok;
}
#endif

int zipmoe_can_move_pages(void) {
#if defined(ZIPMOE_MOVES_PAGES)
    static int known = -1; // a race probes twice, with one answer
    if (__atomic_load_n(&known, __ATOMIC_RELAXED) < 0) {
        __atomic_store_n(&known, probe_move(), __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&known, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

int64_t zipmoe_map_headroom(void) {
#if defined(ZIPMOE_MOVES_PAGES)
    FILE * f = fopen("/proc/sys/vm/max_map_count", "r");
    long long limit = -1;
    if (f == NULL || fscanf(f, "%lld", &limit) != 1) {
        limit = -1;
    }
    if (f != NULL) {
        fclose(f);
    }
    FILE * maps = fopen("/proc/self/maps", "r");
    if (limit < 0 || maps == NULL) {
        if (maps != NULL) {
            fclose(maps);
        }
        return -1;
    }
    long long n = 0;
    for (int ch; (ch = fgetc(maps)) != EOF;) {
        n += ch == '\n';
    }
    fclose(maps);
    return limit - n;
#else
    return -1;
#endif
}

int zipmoe_pages_resident(void * addr, size_t size) {
#if defined(ZIPMOE_MOVES_PAGES)
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    unsigned char in[1024];
    if (((uintptr_t) addr | size) & (page - 1) || size / page > sizeof(in) || mincore(addr, size, in) != 0) {
        return 0;
    }
    for (size_t i = 0; i < size / page; i++) {
        if (!(in[i] & 1)) {
            return 0;
        }
    }
    return 1;
#else
    (void) addr;
    (void) size;
    return 0;
#endif
}

#if defined(ZIPMOE_MOVES_PAGES)
// whether all of [addr, addr + size) is mapped (mincore fails on a gap)
static int still_mapped(void * addr, size_t size) {
    unsigned char in[64];
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    for (size_t off = 0; off < size; off += sizeof(in) * page) {
        const size_t n = size - off < sizeof(in) * page ? size - off : sizeof(in) * page;
        if (mincore((uint8_t *) addr + off, n, in) != 0) {
            return 0;
        }
    }
    return 1;
}
#endif

static atomic_int  g_moves_allowed = -1; // ggml_zipmoe_set_page_move_refusal
static atomic_bool g_refusal_taken_down;

void ggml_zipmoe_set_page_move_refusal(int allowed, bool taken_down) {
    atomic_store(&g_refusal_taken_down, taken_down);
    atomic_store(&g_moves_allowed, allowed < 0 ? -1 : allowed);
}

#if defined(ZIPMOE_MOVES_PAGES)
// whether a test refuses this move (ggml_zipmoe_set_page_move_refusal), taking dst down first if it asked
static int refused_by_test(void * dst, size_t size) {
    int allowed = atomic_load(&g_moves_allowed);
    while (allowed >= 0 && !atomic_compare_exchange_weak(&g_moves_allowed, &allowed, allowed - 1)) {
    }
    if (allowed != 0) {
        return 0; // none refused, or this one still allowed (the count down to 0 refuses the next, then none)
    }
    if (atomic_load(&g_refusal_taken_down)) {
        munmap(dst, size);
    }
    return 1;
}

// after a refused move: the kernel may have taken dst down first (a map count at its limit, strict
// overcommit). Mapped again, empty, never over a mapping someone made there meanwhile: 0, or
// ZIPMOE_MOVE_LOST where dst cannot be mapped again
static size_t after_refusal(void * dst, size_t size) {
#if defined(MAP_FIXED_NOREPLACE)
    const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE;
    void * again = mmap(dst, size, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (again == dst) {
        zipmoe_advise_huge_pages(dst, size);
        return 0;
    }
    if (again != MAP_FAILED) {
        munmap(again, size); // a kernel that took the address for a hint
    }
#endif
    // still mapped: the refusal came before the kernel took dst down
    return still_mapped(dst, size) ? 0 : ZIPMOE_MOVE_LOST;
}
#endif

size_t zipmoe_move_pages(void * src, void * dst, size_t size) {
#if defined(ZIPMOE_MOVES_PAGES)
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    if (((uintptr_t) src | (uintptr_t) dst | size) & (page - 1) || size == 0 || !zipmoe_can_move_pages()) {
        return 0;
    }
    if (refused_by_test(dst, size)) {
        return after_refusal(dst, size);
    }
    // DONTUNMAP leaves src mapped and empty (read again as zeros): the memory around it stays whole
    if (mremap(src, size, size, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, dst) == dst) {
        return size;
    }
    return after_refusal(dst, size);
#else
    (void) src;
    (void) dst;
    (void) size;
    return 0;
#endif
}
