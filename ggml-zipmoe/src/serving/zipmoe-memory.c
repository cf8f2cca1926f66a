// Memory available to this process: MemAvailable and the limits of its memory cgroups (v1 and v2).
//
// A process's limit is its own cgroup's and its ancestors', not the root's: the cgroups are found
// through /proc/self/cgroup (the process's path in each hierarchy) and /proc/self/mountinfo (where
// each hierarchy is mounted, and which subtree a container's mount shows).

#define _GNU_SOURCE

#include "ggml-zipmoe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NO_LIMIT UINT64_MAX
// limits at or above this are "no limit" (v1 writes 2^63 rounded down to a page)
#define UNLIMITED_FROM (1ull << 60)

// opens root + dir + "/" + name (name NULL: root + dir) for reading; NULL if it cannot
static FILE * open_under(const char * root, const char * dir, const char * name) {
    char path[2048];
    const int n = snprintf(path, sizeof(path), "%s%s%s%s", root, dir, name ? "/" : "", name ? name : "");
    return n > 0 && (size_t) n < sizeof(path) ? fopen(path, "r") : NULL; // a cut path names another file
}

// 1 if the comma-separated list names the memory controller
static int lists_memory(const char * list) {
    char padded[1024];
    snprintf(padded, sizeof(padded), ",%s,", list);
    return strstr(padded, ",memory,") != NULL;
}

// the first unsigned number of a file ("max" and unreadable files: NO_LIMIT)
static uint64_t read_number(const char * root, const char * dir, const char * name) {
    FILE * f = open_under(root, dir, name);
    if (f == NULL) {
        return NO_LIMIT;
    }
    unsigned long long v = 0;
    const int ok = fscanf(f, "%llu", &v) == 1;
    fclose(f);
    return ok ? (uint64_t) v : NO_LIMIT;
}

// value of `key` in a "key value" file (memory.stat), or 0
static uint64_t read_key(const char * root, const char * dir, const char * file, const char * key) {
    FILE * f = open_under(root, dir, file);
    if (f == NULL) {
        return 0;
    }
    char name[128];
    unsigned long long v;
    uint64_t found = 0;
    while (fscanf(f, "%127s %llu", name, &v) == 2) {
        if (strcmp(name, key) == 0) {
            found = (uint64_t) v;
            break;
        }
    }
    fclose(f);
    return found;
}

static uint64_t mem_available_bytes(const char * root) {
    FILE * f = open_under(root, "/proc/meminfo", NULL);
    if (f == NULL) {
        return NO_LIMIT;
    }
    char line[256];
    uint64_t avail = NO_LIMIT;
    while (fgets(line, sizeof(line), f) != NULL) {
        unsigned long long kb;
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
            avail = (uint64_t) kb * 1024;
            break;
        }
    }
    fclose(f);
    return avail;
}

// mountinfo escapes blanks as \040 (octal); undo it in place
static void unescape(char * s) {
    char * out = s;
    for (char * p = s; *p; p++) {
        if (p[0] == '\\' && p[1] >= '0' && p[1] <= '7' && p[2] >= '0' && p[2] <= '7' && p[3] >= '0' && p[3] <= '7') {
            *out++ = (char) ((p[1] - '0') * 64 + (p[2] - '0') * 8 + (p[3] - '0'));
            p += 3;
        } else {
            *out++ = *p;
        }
    }
    *out = '\0';
}

// the mount point and mounted subtree of cgroup hierarchy `version` (1: the one with the memory
// controller); 0 if it is not mounted
static int find_mount(const char * root, int version, char * mount_point, size_t mp_size, char * mount_root,
                      size_t mr_size) {
    FILE * f = open_under(root, "/proc/self/mountinfo", NULL);
    if (f == NULL) {
        return 0;
    }
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof(line), f) != NULL) {
        // id parent major:minor root mount-point options [optional...] - fstype source super-options
        char * fields[6] = { 0 };
        char * save = NULL;
        char * tok = strtok_r(line, " \n", &save);
        for (int i = 0; i < 6 && tok != NULL; i++) {
            fields[i] = tok;
            tok = i < 5 ? strtok_r(NULL, " \n", &save) : tok;
        }
        if (fields[4] == NULL) {
            continue;
        }
        // skip the optional fields up to the separator
        char * sep = tok;
        while (sep != NULL && strcmp(sep, "-") != 0) {
            sep = strtok_r(NULL, " \n", &save);
        }
        char * fstype = sep ? strtok_r(NULL, " \n", &save) : NULL;
        char * source = fstype ? strtok_r(NULL, " \n", &save) : NULL;
        char * super  = source ? strtok_r(NULL, " \n", &save) : NULL;
        if (fstype == NULL) {
            continue;
        }
        int match = 0;
        if (version == 2) {
            match = strcmp(fstype, "cgroup2") == 0;
        } else if (strcmp(fstype, "cgroup") == 0 && super != NULL) {
            match = lists_memory(super);
        }
        if (match) {
            unescape(fields[3]);
            unescape(fields[4]);
            snprintf(mount_root, mr_size, "%s", fields[3]);
            snprintf(mount_point, mp_size, "%s", fields[4]);
            found = 1;
        }
    }
    fclose(f);
    return found;
}

// the process's path in hierarchy `version` from /proc/self/cgroup; 0 if it has none
static int own_path(const char * root, int version, char * out, size_t size) {
    FILE * f = open_under(root, "/proc/self/cgroup", NULL);
    if (f == NULL) {
        return 0;
    }
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof(line), f) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        char * c1 = strchr(line, ':');
        char * c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (c2 == NULL) {
            continue;
        }
        *c1 = *c2 = '\0';
        const char * id = line, * controllers = c1 + 1, * cg = c2 + 1;
        if (version == 2) {
            found = strcmp(id, "0") == 0 && controllers[0] == '\0';
        } else {
            found = lists_memory(controllers);
        }
        if (found) {
            snprintf(out, size, "%s", cg);
        }
    }
    fclose(f);
    return found;
}

// the folder of the process's cgroup inside the mount (a container's mount shows only its subtree)
static void cgroup_dir(const char * mount_point, const char * mount_root, const char * cg, char * out, size_t size) {
    const size_t n = strlen(mount_root);
    if (strcmp(mount_root, "/") == 0) {
        snprintf(out, size, "%s%s", mount_point, strcmp(cg, "/") == 0 ? "" : cg);
    } else if (strncmp(cg, mount_root, n) == 0 && (cg[n] == '/' || cg[n] == '\0')) {
        snprintf(out, size, "%s%s", mount_point, cg + n);
    } else {
        snprintf(out, size, "%s", mount_point); // the mount is the process's own subtree
    }
}

// a cgroup's usage beyond reclaimable page cache (shared memory is not reclaimable without swap)
static uint64_t pinned_usage(const char * root, const char * dir, int version) {
    const uint64_t usage = read_number(root, dir, version == 2 ? "memory.current" : "memory.usage_in_bytes");
    const uint64_t cache = read_key(root, dir, "memory.stat", version == 2 ? "file" : "total_cache");
    const uint64_t shmem = read_key(root, dir, "memory.stat", version == 2 ? "shmem" : "total_shmem");
    const uint64_t reclaimable = cache > shmem ? cache - shmem : 0;
    return usage != NO_LIMIT && usage > reclaimable ? usage - reclaimable : 0;
}

// a cgroup's own limit (NO_LIMIT when it has none)
static uint64_t own_limit(const char * root, const char * dir, int version) {
    uint64_t limit;
    if (version == 2) {
        const uint64_t max  = read_number(root, dir, "memory.max");
        const uint64_t high = read_number(root, dir, "memory.high");
        limit = max < high ? max : high;
    } else {
        limit = read_number(root, dir, "memory.limit_in_bytes");
    }
    return limit >= UNLIMITED_FROM ? NO_LIMIT : limit;
}

// remembers the cgroup leaving the least free memory
static void consider(struct ggml_zipmoe_memory * mem, uint64_t * best, uint64_t limit, uint64_t used, int version,
                     const char * dir) {
    if (limit == NO_LIMIT) {
        return;
    }
    const uint64_t free = limit > used ? limit - used : 0;
    if (free < *best) {
        *best = free;
        mem->cgroup_limit   = limit;
        mem->cgroup_used    = used;
        mem->cgroup_version = version;
        snprintf(mem->cgroup_path, sizeof(mem->cgroup_path), "%.*s", (int) sizeof(mem->cgroup_path) - 1, dir);
    }
}

int ggml_zipmoe_memory_available(const char * root, struct ggml_zipmoe_memory * mem) {
    if (mem == NULL) {
        return GGML_ZIPMOE_ERR_ARG;
    }
    root = root != NULL ? root : "";
    memset(mem, 0, sizeof(*mem));
    mem->mem_available = mem_available_bytes(root);
    mem->cgroup_limit  = NO_LIMIT;
    uint64_t best = NO_LIMIT;
    for (int version = 2; version >= 1; version--) {
        char mount_point[1024], mount_root[1024], cg[1024], dir[2048];
        if (!own_path(root, version, cg, sizeof(cg)) ||
            !find_mount(root, version, mount_point, sizeof(mount_point), mount_root, sizeof(mount_root))) {
            continue;
        }
        cgroup_dir(mount_point, mount_root, cg, dir, sizeof(dir));
        if (version == 1) {
            // the lowest limit of the cgroup and every ancestor, those outside the mount included
            const uint64_t hier = read_key(root, dir, "memory.stat", "hierarchical_memory_limit");
            consider(mem, &best, hier > 0 && hier < UNLIMITED_FROM ? hier : NO_LIMIT, pinned_usage(root, dir, 1), 1, dir);
        }
        // the process's cgroup and each ancestor up to the mount point
        const size_t top = strlen(mount_point);
        for (;;) {
            consider(mem, &best, own_limit(root, dir, version), pinned_usage(root, dir, version), version, dir);
            char * slash = strrchr(dir, '/');
            if (strlen(dir) <= top || slash == NULL || slash < dir + top) {
                break;
            }
            *slash = '\0'; // the parent (the mount point itself once slash == dir + top)
        }
    }
    mem->available = best < mem->mem_available ? best : mem->mem_available;
    return mem->mem_available == NO_LIMIT && best == NO_LIMIT ? GGML_ZIPMOE_ERR_IO : GGML_ZIPMOE_OK;
}
