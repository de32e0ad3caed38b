// Linux interfaces that Swift's Glibc module does not export: epoll(7), for the notification reader (one wake-up
// for the sockets that are ready, whatever the number of sockets registered), and recvmmsg(2), which reads every
// queued notification of a socket in one call (Glibc declares it, and struct mmsghdr, only under _GNU_SOURCE).
// Also the two clock primitives of the loops that gather work under load (the notify reader, the MQTT loop), and
// mallopt(3)'s arena limit (malloc.h is not in the Glibc module), prctl(2)'s thread name, the two ends of the
// wake-up sockets the I/O threads sleep on, and FIONREAD (ioctl(2) is variadic, which Swift does not import).
#include <errno.h>
#include <malloc.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/// struct mmsghdr of recvmmsg(2), under a name of its own (same layout).
struct clinux_mmsghdr {
    struct msghdr msg_hdr;
    unsigned int msg_len;
};

/// recvmmsg(2).
int clinux_recvmmsg(int sockfd, struct clinux_mmsghdr *msgvec, unsigned int vlen, int flags,
                    struct timespec *timeout) __asm__("recvmmsg");

/// CLOCK_MONOTONIC, in nanoseconds.
static inline unsigned long long clinux_monotonic_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (unsigned long long)now.tv_sec * 1000000000ULL + (unsigned long long)now.tv_nsec;
}

/// Sleeps `ns` nanoseconds (under a second), resuming after a signal for the time that is left.
static inline void clinux_sleep_ns(unsigned long long ns) {
    struct timespec pause = {0, (long)ns}, left;
    while (nanosleep(&pause, &left) != 0 && errno == EINTR) pause = left;
}

/// mallopt(M_ARENA_MAX, arenas): how many malloc arenas glibc may create (by default 8 per core, one per thread that
/// allocates while another holds an arena). Returns 1 on success.
static inline int clinux_limit_malloc_arenas(int arenas) { return mallopt(M_ARENA_MAX, arenas); }

/// Names the calling thread, as ps -L, top -H and /proc/PID/task/TID/comm show it (PR_SET_NAME: at most 15 bytes,
/// longer names are cut). Glibc declares pthread_setname_np only under _GNU_SOURCE.
static inline void clinux_name_thread(const char *name) { prctl(PR_SET_NAME, (unsigned long)name, 0, 0, 0); }

/// Writes the one byte that wakes a thread waiting on the reading end of a non-blocking wake-up socket (a full
/// socket already wakes it, so a failed write is no loss).
static inline void clinux_poke_wake_socket(int fd) {
    unsigned char one = 1;
    ssize_t written = write(fd, &one, 1);
    (void)written;
}

/// How many bytes a socket has to read now (FIONREAD), or -1 when that cannot be told.
static inline int clinux_readable_bytes(int fd) {
    int bytes = 0;
    return ioctl(fd, FIONREAD, &bytes) == 0 ? bytes : -1;
}

/// Reads the reading end of a non-blocking wake-up socket empty, so that epoll stops reporting it.
static inline void clinux_drain_wake_socket(int fd) {
    unsigned char buffer[256];
    while (read(fd, buffer, sizeof buffer) == (ssize_t)sizeof buffer) {}
}
