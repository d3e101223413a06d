/* Helpers shared by hybridstore's C hash tables (u64map, keytable) and hashing.
 *
 * Header-only: each extension is its own shared object, so the helpers are
 * static inline functions compiled into each of them.  Include after Python.h.
 */
#ifndef HYBRIDSTORE_TABLES_H
#define HYBRIDSTORE_TABLES_H

#include <stdint.h>

#define TABLE_MIN_CAPACITY 8

/* splitmix64's finalizer: a bijection on uint64 whose low bits depend on all bits.
 * Part of the prefix-key specification in hashing.c: do not change it. */
static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= UINT64_C(0xBF58476D1CE4E5B9);
    x ^= x >> 27;
    x *= UINT64_C(0x94D049BB133111EB);
    x ^= x >> 31;
    return x;
}

/* Largest number of entries a table of `capacity` slots may hold (load 0.7). */
static inline size_t max_fill_of(size_t capacity) {
    return capacity / 10 * 7 + capacity % 10 * 7 / 10;
}

/*
 * Smallest power-of-two capacity >= TABLE_MIN_CAPACITY that holds n entries at
 * a load factor <= 0.7 in slots of slot_bytes.  0 (with MemoryError set) when
 * no such table fits in memory at all.
 */
static inline size_t table_capacity_for(size_t n, size_t slot_bytes) {
    size_t cap = TABLE_MIN_CAPACITY;
    while (max_fill_of(cap) < n) {
        if (cap > (size_t)PY_SSIZE_T_MAX / (2 * slot_bytes)) {
            PyErr_NoMemory();
            return 0;
        }
        cap *= 2;
    }
    return cap;
}

#endif /* HYBRIDSTORE_TABLES_H */
