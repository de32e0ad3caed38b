// See include/mosquitto_io.h. read(2), write(2), close(2) and socketpair(2) are defined here for the whole process
// (the executable's definitions come first in the dynamic linker's search, so libmosquitto's calls land here too);
// anything that is not an attached socket goes to the system call unchanged.
#define _GNU_SOURCE
#include "mosquitto_io.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { CAPACITY = 16384, TABLE_SIZE = 4096 };

struct mosquitto_io_buffer {
    // Reading: the loop thread's only.
    size_t start, end;
    unsigned long long fills, reads;
    // Writing: any thread, under `lock`. `fd` is -1 while detached (nothing is sent then).
    pthread_mutex_t lock;
    int fd;
    int holding;
    size_t pending;
    unsigned long long kept, flushes;
    unsigned char in[CAPACITY];
    unsigned char out[CAPACITY];
};

// Attached buffers by descriptor. Written by attach, detach and close (any thread); read by read(2) and write(2).
static _Atomic(mosquitto_io_buffer *) table[TABLE_SIZE];

// Descriptors whose writes are dropped (a socket pair's write end that nothing reads). Set by socketpair(2) on a
// thread that asked for it, cleared by close(2).
static _Atomic(unsigned char) silenced[TABLE_SIZE];
static _Atomic(unsigned long long) dropped;
static _Thread_local int silencing;
static _Thread_local int silenced_last = -1;
// The read end of the last socket pair made by this thread while capturing (mosquitto_io_capture_socketpair).
static _Thread_local int capturing;
static _Thread_local int captured_read = -1;

int mosquitto_io_silence_socketpair(int on) {
    int last = silenced_last;
    silencing = on;
    if (on) silenced_last = -1;
    return last;
}

int mosquitto_io_capture_socketpair(int on) {
    int last = captured_read;
    capturing = on;
    if (on) captured_read = -1;
    return last;
}

int mosquitto_io_is_silenced(int fd) {
    return fd >= 0 && fd < TABLE_SIZE && atomic_load_explicit(&silenced[fd], memory_order_acquire);
}

unsigned long long mosquitto_io_dropped_writes(void) { return atomic_load_explicit(&dropped, memory_order_relaxed); }

int socketpair(int domain, int type, int protocol, int sv[2]) {
    int result = (int)syscall(SYS_socketpair, domain, type, protocol, sv);
    if (result == 0 && capturing) {
        captured_read = sv[0];
        capturing = 0;  // one pair per request
    }
    if (result == 0 && silencing && sv[1] >= 0 && sv[1] < TABLE_SIZE) {
        atomic_store_explicit(&silenced[sv[1]], 1, memory_order_release);
        silenced_last = sv[1];
        silencing = 0;  // one pair per request
    }
    return result;
}

static mosquitto_io_buffer *lookup(int fd) {
    return (fd >= 0 && fd < TABLE_SIZE) ? atomic_load_explicit(&table[fd], memory_order_acquire) : NULL;
}

mosquitto_io_buffer *mosquitto_io_buffer_new(void) {
    mosquitto_io_buffer *buffer = calloc(1, sizeof(mosquitto_io_buffer));
    if (buffer == NULL) return NULL;
    if (pthread_mutex_init(&buffer->lock, NULL) != 0) {
        free(buffer);
        return NULL;
    }
    buffer->fd = -1;
    return buffer;
}

void mosquitto_io_buffer_free(mosquitto_io_buffer *buffer) {
    if (buffer == NULL) return;
    pthread_mutex_destroy(&buffer->lock);
    free(buffer);
}

int mosquitto_io_attach(int fd, mosquitto_io_buffer *buffer) {
    if (fd < 0 || fd >= TABLE_SIZE || buffer == NULL) return -1;
    buffer->start = buffer->end = 0;
    pthread_mutex_lock(&buffer->lock);
    buffer->fd = fd;
    buffer->pending = 0;
    pthread_mutex_unlock(&buffer->lock);
    atomic_store_explicit(&table[fd], buffer, memory_order_release);
    return 0;
}

// Sends what is kept; 0 when all of it left, else -1 with errno (EAGAIN: the socket is full for now).
static int flush_locked(mosquitto_io_buffer *buffer) {
    if (buffer->fd < 0) {
        buffer->pending = 0;
        return 0;
    }
    size_t done = 0;
    int result = 0;
    while (done < buffer->pending) {
        ssize_t n = syscall(SYS_write, buffer->fd, buffer->out + done, buffer->pending - done);
        if (n < 0) {
            if (errno == EINTR) continue;
            result = -1;
            break;
        }
        buffer->flushes++;
        done += (size_t)n;
    }
    if (done > 0) {
        memmove(buffer->out, buffer->out + done, buffer->pending - done);
        buffer->pending -= done;
    }
    return result;
}

void mosquitto_io_detach(int fd, mosquitto_io_buffer *buffer) {
    if (fd < 0 || fd >= TABLE_SIZE || buffer == NULL) return;
    pthread_mutex_lock(&buffer->lock);
    if (buffer->fd == fd && lookup(fd) == buffer) {
        int saved = errno;
        (void)flush_locked(buffer);  // best effort: the connection is ending
        errno = saved;
        buffer->fd = -1;
        buffer->pending = 0;
    }
    mosquitto_io_buffer *expected = buffer;
    atomic_compare_exchange_strong_explicit(&table[fd], &expected, NULL, memory_order_acq_rel, memory_order_acquire);
    pthread_mutex_unlock(&buffer->lock);
}

int mosquitto_io_is_attached(int fd) { return lookup(fd) != NULL; }

size_t mosquitto_io_buffered(const mosquitto_io_buffer *buffer) { return buffer->end - buffer->start; }

void mosquitto_io_hold(mosquitto_io_buffer *buffer) {
    pthread_mutex_lock(&buffer->lock);
    buffer->holding = 1;
    pthread_mutex_unlock(&buffer->lock);
}

size_t mosquitto_io_release(mosquitto_io_buffer *buffer) {
    pthread_mutex_lock(&buffer->lock);
    buffer->holding = 0;
    int saved = errno;
    (void)flush_locked(buffer);  // what stays is sent by mosquitto_io_flush when the socket is writable
    errno = saved;
    size_t left = buffer->pending;
    pthread_mutex_unlock(&buffer->lock);
    return left;
}

// Sends what is kept; returns the bytes still waiting (the socket is full for now), or (size_t)-1 when it failed.
static size_t send_locked(mosquitto_io_buffer *buffer) {
    if (flush_locked(buffer) != 0 && errno != EAGAIN && errno != EWOULDBLOCK) return (size_t)-1;
    return buffer->pending;
}

size_t mosquitto_io_flush(mosquitto_io_buffer *buffer) {
    pthread_mutex_lock(&buffer->lock);
    // Held: it leaves at release (the loop thread must not cut a hold short because it woke up meanwhile).
    size_t left = buffer->holding ? buffer->pending : send_locked(buffer);
    int saved = errno;
    pthread_mutex_unlock(&buffer->lock);
    errno = saved;
    return left;
}

size_t mosquitto_io_send_kept(mosquitto_io_buffer *buffer) {
    pthread_mutex_lock(&buffer->lock);
    size_t left = send_locked(buffer);
    int saved = errno;
    pthread_mutex_unlock(&buffer->lock);
    errno = saved;
    return left;
}

size_t mosquitto_io_waiting(mosquitto_io_buffer *buffer) {
    pthread_mutex_lock(&buffer->lock);
    size_t waiting = buffer->holding ? 0 : buffer->pending;
    pthread_mutex_unlock(&buffer->lock);
    return waiting;
}

size_t mosquitto_io_pending(mosquitto_io_buffer *buffer) {
    pthread_mutex_lock(&buffer->lock);
    size_t pending = buffer->pending;
    pthread_mutex_unlock(&buffer->lock);
    return pending;
}

unsigned long long mosquitto_io_fills(const mosquitto_io_buffer *buffer) { return buffer->fills; }

unsigned long long mosquitto_io_reads(const mosquitto_io_buffer *buffer) { return buffer->reads; }

unsigned long long mosquitto_io_kept_writes(mosquitto_io_buffer *buffer) {
    pthread_mutex_lock(&buffer->lock);
    unsigned long long kept = buffer->kept;
    pthread_mutex_unlock(&buffer->lock);
    return kept;
}

unsigned long long mosquitto_io_flushes(mosquitto_io_buffer *buffer) {
    pthread_mutex_lock(&buffer->lock);
    unsigned long long flushes = buffer->flushes;
    pthread_mutex_unlock(&buffer->lock);
    return flushes;
}

ssize_t read(int fd, void *destination, size_t count) {
    mosquitto_io_buffer *buffer = lookup(fd);
    if (buffer == NULL) return syscall(SYS_read, fd, destination, count);
    if (count == 0) return 0;
    buffer->reads++;
    if (buffer->start == buffer->end) {
        // A large body goes straight to its destination; anything else fills the buffer with what has come.
        if (count >= CAPACITY) return syscall(SYS_read, fd, destination, count);
        ssize_t received = recv(fd, buffer->in, CAPACITY, MSG_DONTWAIT);
        if (received <= 0) return received;  // 0: end of stream; -1: errno says why (EAGAIN: nothing yet)
        buffer->fills++;
        buffer->start = 0;
        buffer->end = (size_t)received;
    }
    size_t available = buffer->end - buffer->start;
    size_t n = count < available ? count : available;
    memcpy(destination, buffer->in + buffer->start, n);
    buffer->start += n;
    return (ssize_t)n;
}

// Keeps `count` bytes for the next flush (the caller checked that they fit).
static ssize_t keep_locked(mosquitto_io_buffer *buffer, const void *source, size_t count) {
    memcpy(buffer->out + buffer->pending, source, count);
    buffer->pending += count;
    buffer->kept++;
    return (ssize_t)count;
}

ssize_t write(int fd, const void *source, size_t count) {
    if (fd >= 0 && fd < TABLE_SIZE && atomic_load_explicit(&silenced[fd], memory_order_acquire)) {
        atomic_fetch_add_explicit(&dropped, 1, memory_order_relaxed);
        return (ssize_t)count;
    }
    mosquitto_io_buffer *buffer = lookup(fd);
    if (buffer == NULL) return syscall(SYS_write, fd, source, count);
    pthread_mutex_lock(&buffer->lock);
    ssize_t result;
    if (buffer->fd != fd) {
        result = syscall(SYS_write, fd, source, count);  // detached since the look-up
    } else if (buffer->holding && buffer->pending + count <= CAPACITY) {
        result = keep_locked(buffer, source, count);
    } else if (buffer->pending > 0 && flush_locked(buffer) != 0) {
        // What was kept must leave first, and the socket is full (or failed: errno says so).
        if ((errno == EAGAIN || errno == EWOULDBLOCK) && buffer->pending + count <= CAPACITY) {
            result = keep_locked(buffer, source, count);
        } else {
            result = -1;
        }
    } else {
        result = syscall(SYS_write, fd, source, count);
    }
    int saved = errno;
    pthread_mutex_unlock(&buffer->lock);
    errno = saved;
    return result;
}

int close(int fd) {
    if (fd >= 0 && fd < TABLE_SIZE) atomic_store_explicit(&silenced[fd], 0, memory_order_release);
    mosquitto_io_buffer *buffer =
        (fd >= 0 && fd < TABLE_SIZE) ? atomic_exchange_explicit(&table[fd], NULL, memory_order_acq_rel) : NULL;
    if (buffer == NULL) return (int)syscall(SYS_close, fd);
    // Under the write lock: no write of what was kept can reach the number once the kernel hands it out again.
    pthread_mutex_lock(&buffer->lock);
    if (buffer->fd == fd) {
        buffer->fd = -1;
        buffer->pending = 0;
    }
    int result = (int)syscall(SYS_close, fd);
    int saved = errno;
    pthread_mutex_unlock(&buffer->lock);
    errno = saved;
    return result;
}
