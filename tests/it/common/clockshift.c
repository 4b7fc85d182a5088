// A clock step for the tests: shifts the wall clock (CLOCK_REALTIME, gettimeofday,
// time) of the process it is preloaded into by the signed number of microseconds in
// the first 8 bytes of the file CLOCKSHIFT_FILE, read on every call (the file is
// mapped), so a test steps a running server's clock by writing the file. Monotonic
// clocks are untouched, as an NTP step leaves them.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static volatile int64_t *shift;
static int (*real_clock_gettime)(clockid_t, struct timespec *);
static int (*real_gettimeofday)(struct timeval *, void *);

__attribute__((constructor)) static void init(void) {
    real_clock_gettime = dlsym(RTLD_NEXT, "clock_gettime");
    real_gettimeofday = dlsym(RTLD_NEXT, "gettimeofday");
    const char *path = getenv("CLOCKSHIFT_FILE");
    if (!path) return;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return;
    void *p = mmap(NULL, 8, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p != MAP_FAILED) shift = p;
}

static int64_t offset_us(void) { return shift ? *shift : 0; }

static int is_wall(clockid_t id) {
    return id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    if (!real_clock_gettime) real_clock_gettime = dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real_clock_gettime(id, ts);
    if (rc == 0 && is_wall(id)) {
        int64_t ns = (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec + offset_us() * 1000;
        ts->tv_sec = ns / 1000000000;
        ts->tv_nsec = ns % 1000000000;
    }
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    if (!real_gettimeofday) real_gettimeofday = dlsym(RTLD_NEXT, "gettimeofday");
    int rc = real_gettimeofday(tv, tz);
    if (rc == 0 && tv) {
        int64_t us = (int64_t)tv->tv_sec * 1000000 + tv->tv_usec + offset_us();
        tv->tv_sec = us / 1000000;
        tv->tv_usec = us % 1000000;
    }
    return rc;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
