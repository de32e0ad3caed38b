// See include/mosquitto_io.h. read(2) and close(2) are defined here for the whole process (the executable's
// definitions come first in the dynamic linker's search, so libmosquitto's calls land here too); anything that is
// not an attached socket goes to the system call unchanged.
#define _GNU_SOURCE
#include "mosquitto_io.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { CAPACITY = 16384, TABLE_SIZE = 4096 };

struct mosquitto_io_buffer {
    size_t start, end;
    unsigned long long fills, reads;
    unsigned char bytes[CAPACITY];
};

// Attached buffers by descriptor. Written by attach, detach and close (any thread); read by read(2).
static _Atomic(mosquitto_io_buffer *) table[TABLE_SIZE];

mosquitto_io_buffer *mosquitto_io_buffer_new(void) { return calloc(1, sizeof(mosquitto_io_buffer)); }

void mosquitto_io_buffer_free(mosquitto_io_buffer *buffer) { free(buffer); }

int mosquitto_io_attach(int fd, mosquitto_io_buffer *buffer) {
    if (fd < 0 || fd >= TABLE_SIZE || buffer == NULL) return -1;
    buffer->start = buffer->end = 0;
    atomic_store_explicit(&table[fd], buffer, memory_order_release);
    return 0;
}

void mosquitto_io_detach(int fd, mosquitto_io_buffer *buffer) {
    if (fd < 0 || fd >= TABLE_SIZE) return;
    mosquitto_io_buffer *expected = buffer;
    atomic_compare_exchange_strong_explicit(&table[fd], &expected, NULL, memory_order_acq_rel, memory_order_acquire);
}

int mosquitto_io_is_attached(int fd) {
    return fd >= 0 && fd < TABLE_SIZE && atomic_load_explicit(&table[fd], memory_order_acquire) != NULL;
}

size_t mosquitto_io_buffered(const mosquitto_io_buffer *buffer) { return buffer->end - buffer->start; }

unsigned long long mosquitto_io_fills(const mosquitto_io_buffer *buffer) { return buffer->fills; }

unsigned long long mosquitto_io_reads(const mosquitto_io_buffer *buffer) { return buffer->reads; }

ssize_t read(int fd, void *destination, size_t count) {
    mosquitto_io_buffer *buffer =
        (fd >= 0 && fd < TABLE_SIZE) ? atomic_load_explicit(&table[fd], memory_order_acquire) : NULL;
    if (buffer == NULL) return syscall(SYS_read, fd, destination, count);
    if (count == 0) return 0;
    buffer->reads++;
    if (buffer->start == buffer->end) {
        // A large body goes straight to its destination; anything else fills the buffer with what has come.
        if (count >= CAPACITY) return syscall(SYS_read, fd, destination, count);
        ssize_t received = recv(fd, buffer->bytes, CAPACITY, MSG_DONTWAIT);
        if (received <= 0) return received;  // 0: end of stream; -1: errno says why (EAGAIN: nothing yet)
        buffer->fills++;
        buffer->start = 0;
        buffer->end = (size_t)received;
    }
    size_t available = buffer->end - buffer->start;
    size_t n = count < available ? count : available;
    memcpy(destination, buffer->bytes + buffer->start, n);
    buffer->start += n;
    return (ssize_t)n;
}

int close(int fd) {
    if (fd >= 0 && fd < TABLE_SIZE) atomic_store_explicit(&table[fd], NULL, memory_order_release);
    return (int)syscall(SYS_close, fd);
}
