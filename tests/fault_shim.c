// Test-only fault injector for expert chunk reads, loaded with LD_PRELOAD by tests/test_faults.py.
//
// It wraps pread(2) on file descriptors whose path contains $ZIPMOE_FAULT_MATCH. The file named by
// $ZIPMOE_FAULT_CONTROL arms it: "SEQ N KIND" makes the N-th such read after the file last changed
// (SEQ tells one arming from the next) fail once, as KIND says:
//   eio    the read fails with EIO
//   short  the read returns its first byte only, and the next read of that descriptor returns 0
//          (end of file): a file shorter than its index (an O_DIRECT read asks for whole blocks,
//          so any larger part, half say, may still hold the whole chunk)
//   flip   the read returns the data with its first byte's low bit flipped
// Reads after the faulty one are left alone until the control file changes again. In-process,
// ctypes.CDLL(None) reaches the counters below.

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static pthread_mutex_t fault_lock = PTHREAD_MUTEX_INITIALIZER;
static char            armed_by[128];   // the control file's content last seen
static long            countdown;       // matching reads left before the fault; 0: none armed
static int             fault_kind;      // 0 eio, 1 short, 2 flip
static int             eof_fd = -1;     // "short": this descriptor's next read returns 0
static long            n_reads;         // matching reads since the process started
static long            n_fired;         // faults injected

long zipmoe_fault_reads(void) { return n_reads; }
long zipmoe_fault_fired(void) { return n_fired; }

static int matches(int fd) {
    const char * want = getenv("ZIPMOE_FAULT_MATCH");
    char link[64], path[4096];
    if (want == NULL) {
        return 0;
    }
    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    const ssize_t n = readlink(link, path, sizeof(path) - 1);
    if (n < 0) {
        return 0;
    }
    path[n] = '\0';
    return strstr(path, want) != NULL;
}

// re-arms when the control file's content changed (called under fault_lock)
static void poll_control(void) {
    const char * name = getenv("ZIPMOE_FAULT_CONTROL");
    FILE * f = name != NULL ? fopen(name, "r") : NULL;
    if (f == NULL) {
        return;
    }
    char text[128] = "";
    const size_t n = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[n] = '\0';
    if (strcmp(text, armed_by) == 0) {
        return;
    }
    snprintf(armed_by, sizeof(armed_by), "%s", text);
    long seq = 0, at = 0;
    char kind[16] = "";
    if (sscanf(text, "%ld %ld %15s", &seq, &at, kind) == 3) {
        countdown  = at;
        fault_kind = strcmp(kind, "short") == 0 ? 1 : strcmp(kind, "flip") == 0 ? 2 : 0;
    }
}

ssize_t pread(int fd, void * buf, size_t count, off_t offset) {
    static ssize_t (*real_pread)(int, void *, size_t, off_t);
    if (real_pread == NULL) {
        real_pread = (ssize_t (*)(int, void *, size_t, off_t)) dlsym(RTLD_NEXT, "pread");
    }
    if (!matches(fd)) {
        return real_pread(fd, buf, count, offset);
    }
    pthread_mutex_lock(&fault_lock);
    poll_control();
    n_reads++;
    const int at_eof = fd == eof_fd;
    if (at_eof) {
        eof_fd = -1;
    }
    const int fire = !at_eof && countdown > 0 && --countdown == 0;
    const int kind = fault_kind;
    if (fire) {
        n_fired++;
        if (kind == 1) {
            eof_fd = fd;
        }
    }
    pthread_mutex_unlock(&fault_lock);
    if (at_eof) {
        return 0;
    }
    if (!fire) {
        return real_pread(fd, buf, count, offset);
    }
    if (kind == 0) {
        errno = EIO;
        return -1;
    }
    const ssize_t got = real_pread(fd, buf, count, offset);
    if (got <= 0) {
        return got;
    }
    if (kind == 1) {
        return 1;
    }
    ((unsigned char *) buf)[0] ^= 1;
    return got;
}
