// How memory whose pages were moved in reads, against memory written in place: the question behind
// ZIPMOE_MOVE_BLOCK (ggml-zipmoe/src/cache/zipmoe-cache-impl.h). A store's entries (11 MB apart, at no
// particular alignment) give their pages to a slot region by mremap(MREMAP_DONTUNMAP), in 4 KiB pages
// or in whole 2 MiB blocks; then the region is summed six times, as the graph reads a slot.
//
//   cc -O2 -march=native -o /tmp/page_moves bench/page_moves.c && /tmp/page_moves 3000
//
// prints, for each way, the time of the moves, the read rates and the process's huge pages mapped whole
// (AnonHugePages: the source's and the region's together). Linux 5.7+.

#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BLOCK ((uintptr_t) 2 << 20)
#define PAGE  ((uintptr_t) 4096)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void huge_pages(void) {
    FILE * f = fopen("/proc/self/smaps_rollup", "r");
    char   line[256];
    while (f != NULL && fgets(line, sizeof(line), f)) {
        if (strstr(line, "AnonHugePages")) {
            printf("  %s", line);
        }
    }
    if (f != NULL) {
        fclose(f);
    }
}

// way 0: the region written in place; 1: moved in 4 KiB pages; 2: moved in whole 2 MiB blocks
static int run(size_t bytes, int way) {
    const size_t entry = 11 * 1024 * 1024 + 12345;
    const size_t map   = bytes + 8 * BLOCK;
    uint8_t * src = mmap(NULL, 2 * map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint8_t * dst = mmap(NULL, map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (src == MAP_FAILED || dst == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    madvise(src, 2 * map, MADV_HUGEPAGE);
    madvise(dst, map, MADV_HUGEPAGE);
    uint8_t * region = (uint8_t *) (((uintptr_t) dst + BLOCK - 1) & ~(BLOCK - 1)) + (way == 1 ? 5 * PAGE : 0);
    const char * name[] = { "written in place", "moved in 4 KiB pages", "moved in 2 MiB blocks" };
    printf("%s:\n", name[way]);
    if (way == 0) {
        memset(region, 1, bytes);
    } else {
        memset(src, 1, 2 * bytes);
        size_t    done = 0;
        uint8_t * e    = src + 777 * 16; // entries at no particular alignment
        const double t0 = now();
        while (done < bytes) {
            const uintptr_t unit = way == 2 ? BLOCK : PAGE;
            const uintptr_t lo = ((uintptr_t) e + unit - 1) & ~(unit - 1), hi = ((uintptr_t) e + entry) & ~(unit - 1);
            size_t n = hi - lo;
            n = done + n > bytes ? (bytes - done) & ~(unit - 1) : n;
            if (n == 0) {
                break;
            }
            if (mremap((void *) lo, n, n, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, region + done) == MAP_FAILED) {
                perror("mremap");
                return 1;
            }
            done += n;
            e += entry;
        }
        printf("  moved %.1f MB in %.3f s\n", done / 1e6, now() - t0);
        bytes = done;
    }
    uint64_t sum = 0;
    for (int r = 0; r < 6; r++) {
        const double t0 = now();
        for (size_t i = 0; i < bytes / 8; i++) {
            sum += ((const uint64_t *) region)[i];
        }
        printf("  read %.2f GB/s\n", bytes / (now() - t0) / 1e9);
    }
    huge_pages();
    return sum == 0; // every word is 0x0101...: never 0
}

int main(int argc, char ** argv) {
    const size_t bytes = (size_t) (argc > 1 ? atol(argv[1]) : 1000) << 20;
    for (int way = 0; way < 3; way++) {
        fflush(stdout);
        const pid_t pid = fork(); // each way in a process of its own: its memory and huge pages alone
        if (pid == 0) {
            return run(bytes, way);
        }
        int status = 1;
        waitpid(pid, &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            return 1;
        }
    }
    return 0;
}
