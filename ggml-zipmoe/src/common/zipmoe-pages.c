// Pages of the memory the cache writes (slots, stores): given back to the system when nothing reads
// them any more, and for memory written the first time, transparent huge pages where the
// kernel offers them on request (/sys/kernel/mm/transparent_hugepage/enabled "madvise"). A first
// write of 3 GB ran at 0.84-1.79 GB/s in 4 KiB pages and 2.72-3.53 GB/s in 2 MiB ones on the bench VM
// (BENCHMARKS, "Re-plans that decode C into F, a clean decode rate, and huge pages"); later writes
// ran alike. Only the 2 MiB-aligned pieces within [addr, addr + size) can be huge; a MADV_DONTNEED of
// part of one splits it.

#include "common/zipmoe-impl.h"

#include <stdint.h>
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
