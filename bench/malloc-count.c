/* Counts heap allocations for bench-gatt. bench/gatt.sh builds this into a shared object and LD_PRELOADs it; the
 * benchmark finds blebridge_malloc_count() with dlsym and prints allocations per decode. Forwarding to glibc's
 * __libc_* entry points keeps every allocation in the same allocator, so free() needs no interposing. */
#include <stddef.h>

extern void *__libc_malloc(size_t size);
extern void *__libc_calloc(size_t count, size_t size);
extern void *__libc_realloc(void *pointer, size_t size);

static unsigned long allocations;

void *malloc(size_t size) {
    __atomic_fetch_add(&allocations, 1, __ATOMIC_RELAXED);
    return __libc_malloc(size);
}

void *calloc(size_t count, size_t size) {
    __atomic_fetch_add(&allocations, 1, __ATOMIC_RELAXED);
    return __libc_calloc(count, size);
}

void *realloc(void *pointer, size_t size) {
    __atomic_fetch_add(&allocations, 1, __ATOMIC_RELAXED);
    return __libc_realloc(pointer, size);
}

unsigned long blebridge_malloc_count(void) { return __atomic_load_n(&allocations, __ATOMIC_RELAXED); }
