/*
 * hybridstore._cext.keytable -- an exact-key object table, the C twin of
 * hybridstore.backends.keytable.PyKeyTable.
 *
 * It stands in for the accounting tier's dict[bytes, (nbytes, charged, meta)],
 * whose per-key Python work (hashing 17-byte keys into bytes objects, tuples,
 * dict probes) dominates batched puts and deletes of a few thousand page
 * keys.  Here a batch is one call over a buffer of packed keys (a uint8 array
 * of shape (n, width)) with no Python object made per key.
 * hybridstore.backends.keytable documents the API and picks this type when
 * it is built.
 *
 * Design
 * ------
 * - Keys are `width` bytes (8 to 65536; the store uses 17: a kind byte and a
 *   16-byte hash), fixed per table.  Every entry holds nbytes and charged
 *   (int64, >= 0) and meta: NULL for b"" or a strong reference to an exact
 *   bytes object (a bytes subclass is copied into one on the way in, so no
 *   Python code ever runs when a meta is released).
 * - One allocation of `capacity` slots, a power of two.  A slot is a 32-bit
 *   tag (the low half of the key's hash), an occupancy byte, the key bytes,
 *   padding to 8, then nbytes, charged and the meta pointer (24 bytes,
 *   8-aligned): 48 bytes for 17-byte keys, the tag sitting in what would be
 *   padding.  A probe reads the tag, the occupancy byte and the key, which
 *   sit together at the start of the slot, and compares the key only when
 *   the tag matches.  A fresh table is zero-filled (every slot empty).
 * - The hash is splitmix64's finalizer applied to the first and the last 8
 *   bytes of the key, mixed in sequence; the home slot is its low bits, so
 *   the tag also gives an entry's home when deletion and resizing move it
 *   (no rehashing; tables of more than 2**32 slots rehash).  Collisions probe
 *   linearly.  Bytes in between (only for width > 16) take part in equality
 *   but not in the hash: keys that differ only there share a probe chain,
 *   which is correct, just slower.  Hashed page keys differ in their first
 *   and last bytes.
 * - The load factor stays <= 0.7: an insert that would pass it doubles the
 *   table first (put_many sizes it once, up front, for len + n entries).
 *   Since 0.7 < 1 there is always an empty slot, which ends every probe.
 * - Deletion is backward-shift deletion, as in u64map.c: later entries of the
 *   cluster that may legally move into the hole do so, and the last hole is
 *   emptied.  No tombstones.  The table never shrinks on delete; clear()
 *   returns to the capacity the table was created with.
 * - put_many applies its rows one by one, exactly as a dict would, and keeps
 *   a journal of what each row replaced (or that it inserted).  When the sum
 *   of charge changes passes the budget, or would overflow int64, the
 *   journal is undone in reverse order, which restores the table exactly,
 *   repeated keys included; only a capacity grown for the batch remains.
 * - The batch loops compute each key's hash PREFETCH_AHEAD rows ahead (kept
 *   in a small ring) and prefetch its home slot and the next one (a 48-byte
 *   slot often straddles two cache lines, and an insert or a deletion looks
 *   past it), so the cache misses of consecutive keys overlap.  They are
 *   compiled twice: for 17-byte keys, where slot sizes, copies and compares
 *   are constants, and for any width (10-35% slower).
 * - The methods keep the GIL: the calls are short and the callers hold their
 *   own lock.  All arguments are converted (which may run Python code) before
 *   the table is touched, and no Python code runs while it is inconsistent.
 *
 * The table holds only exact bytes objects, which cannot form reference
 * cycles, so it is not tracked by the GC.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include "hybridstore/tables.h"

#define MIN_WIDTH 8
#define MAX_WIDTH 65536   /* keep slot arithmetic far from overflow */
#define STORE_WIDTH 17    /* the store's keys: the batch loops get a copy for this width */
#define TAG_OFFSET 0      /* uint32: the low 32 bits of the key's hash */
#define USED_OFFSET 4     /* occupancy byte: 0 empty, 1 used */
#define KEY_OFFSET 5      /* the key bytes */
#define PREFETCH_AHEAD 16 /* rows between a prefetch and its lookup; a power of two */
#define NOT_FOUND SIZE_MAX

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((p), 1, 1)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define PREFETCH(p) ((void)(p))
#define ALWAYS_INLINE inline
#endif


static inline uint64_t load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}


/* What an entry holds; it sits 8-aligned at VALUE_OFF(w) in its slot. */
typedef struct {
    int64_t nbytes;
    int64_t charged;
    PyObject *meta; /* NULL (b"") or a strong reference to an exact bytes object */
} Value;

/* Slot geometry for keys of w bytes (constants when w is). */
#define VALUE_OFF(w) (((size_t)KEY_OFFSET + (w) + 7) & ~(size_t)7)
#define SLOT_BYTES(w) (VALUE_OFF(w) + sizeof(Value))

/* ------------------------------------------------------------------------ */
/* the table                                                                 */

/*
 * The helpers below take the key width w as an argument, equal to t->width:
 * the batch loops are compiled twice, once with the constant STORE_WIDTH
 * (fixed-size copies and compares, no division) and once for any width.
 */

typedef struct {
    PyObject_HEAD
    unsigned char *slots; /* capacity * SLOT_BYTES(width) bytes */
    size_t mask;          /* capacity - 1 */
    size_t size;          /* entries */
    size_t max_fill;      /* max_fill_of(capacity) */
    size_t min_capacity;  /* capacity at creation; clear() returns to it */
    size_t width;         /* key bytes */
} KeyTableObject;

static inline size_t capacity_of(const KeyTableObject *t) { return t->mask + 1; }

static ALWAYS_INLINE unsigned char *slot_at(const KeyTableObject *t, size_t i, size_t w) {
    return t->slots + i * SLOT_BYTES(w);
}

static ALWAYS_INLINE int slot_used(const unsigned char *s) { return s[USED_OFFSET] != 0; }

static ALWAYS_INLINE uint32_t slot_tag(const unsigned char *s) {
    uint32_t tag;
    memcpy(&tag, s + TAG_OFFSET, sizeof tag);
    return tag;
}

static ALWAYS_INLINE Value *slot_value(unsigned char *s, size_t w) {
    return (Value *)(void *)(s + VALUE_OFF(w));
}

static ALWAYS_INLINE uint64_t hash_key(const unsigned char *key, size_t w) {
    return mix64(load64(key + w - 8) ^ mix64(load64(key)));
}

/* Home slot of the entry in slot s: its tag holds the hash's low 32 bits. */
static ALWAYS_INLINE size_t home_of_slot(const KeyTableObject *t, const unsigned char *s,
                                         size_t w) {
    if (t->mask <= UINT32_MAX) {
        return (size_t)slot_tag(s) & t->mask;
    }
    return (size_t)hash_key(s + KEY_OFFSET, w) & t->mask;
}

/*
 * Whether two keys of w bytes are equal: both 8-byte ends, then the middle
 * in 8-byte words (the last one may overlap the end word).
 */
static ALWAYS_INLINE int key_eq(const unsigned char *a, const unsigned char *b, size_t w) {
    if (load64(a) != load64(b) || load64(a + w - 8) != load64(b + w - 8)) {
        return 0;
    }
    for (size_t o = 8; o + 8 < w; o += 8) {
        if (load64(a + o) != load64(b + o)) {
            return 0;
        }
    }
    return 1;
}

/* Capacity for n entries (see table_capacity_for). */
static size_t capacity_for(const KeyTableObject *t, size_t n) {
    return table_capacity_for(n, SLOT_BYTES(t->width));
}

/* A fresh table of `capacity` empty slots, or NULL with MemoryError set. */
static unsigned char *new_slots(const KeyTableObject *t, size_t capacity) {
    unsigned char *slots = PyMem_Calloc(capacity, SLOT_BYTES(t->width));
    if (slots == NULL) {
        PyErr_NoMemory();
    }
    return slots;
}

/* Index of the slot that holds key (whose hash is h), or NOT_FOUND. */
static ALWAYS_INLINE size_t find_h(const KeyTableObject *t, const unsigned char *key,
                                   uint64_t h, size_t w) {
    size_t i = (size_t)h & t->mask;
    for (;;) {
        const unsigned char *s = slot_at(t, i, w);
        if (!slot_used(s)) {
            return NOT_FOUND;
        }
        if (slot_tag(s) == (uint32_t)h && key_eq(s + KEY_OFFSET, key, w)) {
            return i;
        }
        i = (i + 1) & t->mask;
    }
}

static size_t find(const KeyTableObject *t, const unsigned char *key) {
    return find_h(t, key, hash_key(key, t->width), t->width);
}

/* Index of the slot that holds key or, when absent, of the empty slot where it would go. */
static ALWAYS_INLINE size_t find_or_free_h(const KeyTableObject *t, const unsigned char *key,
                                           uint64_t h, size_t w) {
    size_t i = (size_t)h & t->mask;
    for (;;) {
        const unsigned char *s = slot_at(t, i, w);
        if (!slot_used(s) || (slot_tag(s) == (uint32_t)h && key_eq(s + KEY_OFFSET, key, w))) {
            return i;
        }
        i = (i + 1) & t->mask;
    }
}

/* Fill the empty slot s with key, whose hash is h (the caller sets the Value). */
static ALWAYS_INLINE void occupy(KeyTableObject *t, unsigned char *s, const unsigned char *key,
                                 uint64_t h, size_t w) {
    uint32_t tag = (uint32_t)h;
    memcpy(s + TAG_OFFSET, &tag, sizeof tag);
    s[USED_OFFSET] = 1;
    memcpy(s + KEY_OFFSET, key, w);
    t->size++;
}

/* Move every entry into a new table of `capacity` slots.  -1 on MemoryError. */
static int resize(KeyTableObject *t, size_t capacity) {
    const size_t w = t->width;
    unsigned char *slots = new_slots(t, capacity);
    if (slots == NULL) {
        return -1;
    }
    unsigned char *old = t->slots;
    size_t old_capacity = capacity_of(t);
    t->slots = slots;
    t->mask = capacity - 1;
    t->max_fill = max_fill_of(capacity);
    for (size_t j = 0; j < old_capacity; j++) {
        const unsigned char *src = old + j * SLOT_BYTES(w);
        if (slot_used(src)) {
            /* keys are distinct: the first free slot from home is the place */
            size_t i = home_of_slot(t, src, w);
            while (slot_used(slot_at(t, i, w))) {
                i = (i + 1) & t->mask;
            }
            memcpy(slot_at(t, i, w), src, SLOT_BYTES(w));
        }
    }
    PyMem_Free(old);
    return 0;
}

/* Grow, when needed, so that n entries fit.  -1 on MemoryError. */
static int reserve(KeyTableObject *t, size_t n) {
    if (n <= t->max_fill) {
        return 0;
    }
    size_t capacity = capacity_for(t, n);
    return capacity == 0 ? -1 : resize(t, capacity);
}

/*
 * Remove the entry in slot `hole` by backward-shift deletion: walk the
 * cluster after the hole and move each entry whose home slot is not
 * cyclically inside (hole, its slot] into the hole, which then moves to where
 * it came from.  The entry's meta reference is not released: read it before,
 * release it after.
 */
static ALWAYS_INLINE void erase(KeyTableObject *t, size_t hole, size_t w) {
    const size_t mask = t->mask;
    size_t j = hole;
    for (;;) {
        j = (j + 1) & mask;
        unsigned char *sj = slot_at(t, j, w);
        if (!slot_used(sj)) {
            break;
        }
        size_t home = home_of_slot(t, sj, w);
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            memcpy(slot_at(t, hole, w), sj, SLOT_BYTES(w));
            hole = j;
        }
    }
    slot_at(t, hole, w)[USED_OFFSET] = 0;
    t->size--;
}

/* ------------------------------------------------------------------------ */
/* argument conversion                                                       */

/* A Python int (or __index__ object) in [0, 2**63) -> *out.  -1 on error. */
static int count_from_object(PyObject *obj, const char *what, int64_t *out) {
    PyObject *num = PyNumber_Index(obj);
    if (num == NULL) {
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(num, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(num);
        return -1;
    }
    if (overflow < 0 || (overflow == 0 && v < 0)) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0, got %R", what, num);
    } else if (overflow > 0) {
        PyErr_Format(PyExc_OverflowError, "%s must be < 2**63 (int64), got %R", what, num);
    } else {
        Py_DECREF(num);
        *out = (int64_t)v;
        return 0;
    }
    Py_DECREF(num);
    return -1;
}

/*
 * meta -> *out: NULL for an empty bytes, else a new reference to an exact
 * bytes object (a subclass instance is copied).  -1 with TypeError otherwise.
 */
static int meta_from_object(PyObject *obj, PyObject **out) {
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "meta must be bytes, got %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyBytes_GET_SIZE(obj) == 0) {
        *out = NULL;
    } else if (PyBytes_CheckExact(obj)) {
        Py_INCREF(obj);
        *out = obj;
    } else {
        *out = PyBytes_FromStringAndSize(PyBytes_AS_STRING(obj), PyBytes_GET_SIZE(obj));
        if (*out == NULL) {
            return -1;
        }
    }
    return 0;
}

/* A key argument: its bytes, and the buffer view to release when one was taken. */
typedef struct {
    const unsigned char *buf;
    Py_ssize_t len;
    Py_buffer view;
    int has_view;
} KeyArg;

/* Bytes of a bytes-like key (TypeError otherwise, ValueError when not contiguous). */
static int key_arg(PyObject *obj, KeyArg *k) {
    k->has_view = 0;
    if (PyBytes_Check(obj)) {
        k->buf = (const unsigned char *)PyBytes_AS_STRING(obj);
        k->len = PyBytes_GET_SIZE(obj);
        return 0;
    }
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "KeyTable keys must be bytes-like, got %.200s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, &k->view, PyBUF_FULL_RO) < 0) {
        return -1;
    }
    if (!PyBuffer_IsContiguous(&k->view, 'C')) {
        PyErr_SetString(PyExc_ValueError, "KeyTable keys must be C-contiguous buffers");
        PyBuffer_Release(&k->view);
        return -1;
    }
    k->has_view = 1;
    k->buf = k->view.buf;
    k->len = k->view.len;
    return 0;
}

static void key_release(KeyArg *k) {
    if (k->has_view) {
        PyBuffer_Release(&k->view);
        k->has_view = 0;
    }
}

/* key_arg, then the width check (ValueError).  0 on success, the key to release. */
static int key_of_width(const KeyTableObject *t, PyObject *obj, KeyArg *k) {
    if (key_arg(obj, k) < 0) {
        return -1;
    }
    if ((size_t)k->len != t->width) {
        PyErr_Format(PyExc_ValueError, "KeyTable keys must be %zu bytes, got %zd", t->width,
                     k->len);
        key_release(k);
        return -1;
    }
    return 0;
}

/*
 * Rows of packed keys: any C-contiguous buffer whose length is a multiple of
 * the width (TypeError for a non-buffer, ValueError otherwise).  *n = rows.
 */
static int rows_arg(const KeyTableObject *t, PyObject *obj, Py_buffer *view, Py_ssize_t *n) {
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "rows must be a bytes-like buffer of %zu-byte keys (e.g. a uint8 array "
                     "of shape (n, %zu)), got %.200s",
                     t->width, t->width, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_FULL_RO) < 0) {
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyErr_SetString(PyExc_ValueError,
                        "rows must be C-contiguous; copy it with np.ascontiguousarray(x)");
    } else if ((size_t)view->len % t->width != 0) {
        PyErr_Format(PyExc_ValueError,
                     "rows holds %zd bytes, not a multiple of the key width %zu", view->len,
                     t->width);
    } else {
        *n = (Py_ssize_t)((size_t)view->len / t->width);
        return 0;
    }
    PyBuffer_Release(view);
    return -1;
}

/* A new (nbytes, charged, meta) tuple for v, or NULL. */
static PyObject *entry_tuple(const Value *v) {
    PyObject *meta = v->meta;
    if (meta == NULL) {
        meta = PyBytes_FromStringAndSize(NULL, 0);
        if (meta == NULL) {
            return NULL;
        }
    } else {
        Py_INCREF(meta);
    }
    return Py_BuildValue("(LLN)", (long long)v->nbytes, (long long)v->charged, meta);
}

/* a + b into *r; 1 (and *r untouched) when it would overflow int64. */
static inline int add_overflows(int64_t a, int64_t b, int64_t *r) {
    if ((b > 0 && a > INT64_MAX - b) || (b < 0 && a < INT64_MIN - b)) {
        return 1;
    }
    *r = a + b;
    return 0;
}

/*
 * Hashes of rows PREFETCH_AHEAD ahead of the one being applied, each home
 * slot prefetched when its hash is computed.  The table must not resize
 * between ring_start and the last ring_next.
 */
typedef struct {
    uint64_t h[PREFETCH_AHEAD];
} HashRing;

/*
 * Prefetch the home slot of hash h and the slot after it, to the last byte:
 * slots straddle cache lines, and inserts and erases read on past the home.
 */
static ALWAYS_INLINE void prefetch_slot(const KeyTableObject *t, uint64_t h, size_t w) {
    const unsigned char *s = slot_at(t, (size_t)h & t->mask, w);
    PREFETCH(s);
    PREFETCH(s + SLOT_BYTES(w) - 1);
    PREFETCH(s + 2 * SLOT_BYTES(w) - 1);
}

static ALWAYS_INLINE void ring_start(const KeyTableObject *t, HashRing *r,
                                     const unsigned char *keys, Py_ssize_t n, size_t w) {
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) {
        r->h[i] = hash_key(keys + (size_t)i * w, w);
        prefetch_slot(t, r->h[i], w);
    }
}

/* The hash of row i, after which the slot of row i + PREFETCH_AHEAD is prefetched. */
static ALWAYS_INLINE uint64_t ring_next(const KeyTableObject *t, HashRing *r,
                                        const unsigned char *keys, Py_ssize_t n,
                                        Py_ssize_t i, size_t w) {
    uint64_t *cell = &r->h[i & (PREFETCH_AHEAD - 1)];
    uint64_t h = *cell;
    if (i + PREFETCH_AHEAD < n) {
        *cell = hash_key(keys + (size_t)(i + PREFETCH_AHEAD) * w, w);
        prefetch_slot(t, *cell, w);
    }
    return h;
}

/* ------------------------------------------------------------------------ */
/* the batch loops                                                           */

/* What one row of put_many replaced: charged == -1 when the row inserted its key. */
typedef Value Undo;

/*
 * put_many's forward pass: set rows [0, n) to *nv (one meta reference taken
 * per row), journaling what each replaced.  The table must have room for n
 * more entries.  Returns the rows applied: n, or fewer when the running
 * delta would leave int64 (*overflowed = 1; that row is applied and counted
 * too, so that the undo covers it).
 */
static ALWAYS_INLINE Py_ssize_t apply_rows(KeyTableObject *t, const unsigned char *keys,
                                           Py_ssize_t n, size_t w, const Value *nv,
                                           Undo *journal, int64_t *delta_out,
                                           Py_ssize_t *added_out, int *overflowed) {
    int64_t delta = 0;
    Py_ssize_t added = 0, i = 0;
    HashRing ring;
    ring_start(t, &ring, keys, n, w);
    while (i < n) {
        const unsigned char *key = keys + (size_t)i * w;
        uint64_t h = ring_next(t, &ring, keys, n, i, w);
        unsigned char *s = slot_at(t, find_or_free_h(t, key, h, w), w);
        Value *v = slot_value(s, w);
        int64_t before;
        if (slot_used(s)) {
            journal[i] = *v; /* takes over the old meta reference */
            before = v->charged;
        } else {
            journal[i].charged = -1;
            journal[i].meta = NULL;
            occupy(t, s, key, h, w);
            added++;
            before = 0;
        }
        *v = *nv;
        Py_XINCREF(nv->meta);
        i++;
        if (add_overflows(delta, nv->charged - before, &delta)) {
            *overflowed = 1;
            break;
        }
    }
    *delta_out = delta;
    *added_out = added;
    return i;
}

static Py_ssize_t apply_rows_any(KeyTableObject *t, const unsigned char *keys, Py_ssize_t n,
                                 const Value *nv, Undo *journal, int64_t *delta,
                                 Py_ssize_t *added, int *overflowed) {
    if (t->width == STORE_WIDTH) {
        return apply_rows(t, keys, n, STORE_WIDTH, nv, journal, delta, added, overflowed);
    }
    return apply_rows(t, keys, n, t->width, nv, journal, delta, added, overflowed);
}

/* Undo rows applied-1 .. 0 of a put_many, newest first, so repeated keys unwind exactly. */
static void undo_rows(KeyTableObject *t, const unsigned char *keys, Py_ssize_t applied,
                      Undo *journal) {
    const size_t w = t->width;
    for (Py_ssize_t j = applied; j-- > 0;) {
        size_t i = find(t, keys + (size_t)j * w); /* present: row j put it there */
        Value *v = slot_value(slot_at(t, i, w), w);
        PyObject *cur = v->meta;
        if (journal[j].charged < 0) {
            erase(t, i, w);
        } else {
            *v = journal[j]; /* gives the old meta reference back */
        }
        Py_XDECREF(cur);
    }
}

/*
 * delete_many's loop: remove every key of rows [0, n) that is present.
 * *removed counts them; *lo and *hi (the high 64 bits) sum their charges.
 */
static ALWAYS_INLINE void delete_rows(KeyTableObject *t, const unsigned char *keys,
                                      Py_ssize_t n, size_t w, Py_ssize_t *removed_out,
                                      uint64_t *lo_out, uint64_t *hi_out) {
    Py_ssize_t removed = 0;
    uint64_t lo = 0, hi = 0;
    HashRing ring;
    ring_start(t, &ring, keys, n, w);
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *key = keys + (size_t)i * w;
        size_t at = find_h(t, key, ring_next(t, &ring, keys, n, i, w), w);
        if (at == NOT_FOUND) {
            continue;
        }
        const Value *v = slot_value(slot_at(t, at, w), w);
        PyObject *meta = v->meta;
        uint64_t charged = (uint64_t)v->charged;
        lo += charged;
        hi += lo < charged;
        erase(t, at, w);
        removed++;
        Py_XDECREF(meta); /* an exact bytes object: runs no Python code */
    }
    *removed_out = removed;
    *lo_out = lo;
    *hi_out = hi;
}

static void delete_rows_any(KeyTableObject *t, const unsigned char *keys, Py_ssize_t n,
                            Py_ssize_t *removed, uint64_t *lo, uint64_t *hi) {
    if (t->width == STORE_WIDTH) {
        delete_rows(t, keys, n, STORE_WIDTH, removed, lo, hi);
    } else {
        delete_rows(t, keys, n, t->width, removed, lo, hi);
    }
}

/* ------------------------------------------------------------------------ */
/* the KeyTable type                                                         */

static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"width", "capacity_hint", NULL};
    PyObject *width_obj;
    Py_ssize_t hint = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|n:KeyTable", kwlist, &width_obj,
                                     &hint)) {
        return NULL;
    }
    PyObject *num = PyNumber_Index(width_obj);
    if (num == NULL) {
        return NULL;
    }
    int overflow;
    long long width = PyLong_AsLongLongAndOverflow(num, &overflow);
    if (width == -1 && PyErr_Occurred()) {
        Py_DECREF(num);
        return NULL;
    }
    if (overflow != 0 || width < MIN_WIDTH || width > MAX_WIDTH) {
        PyErr_Format(PyExc_ValueError, "width must be in [%d, %d], got %R", MIN_WIDTH,
                     MAX_WIDTH, num);
        Py_DECREF(num);
        return NULL;
    }
    Py_DECREF(num);
    if (hint < 0) {
        PyErr_Format(PyExc_ValueError, "capacity_hint must be >= 0, got %zd", hint);
        return NULL;
    }
    KeyTableObject *t = (KeyTableObject *)type->tp_alloc(type, 0);
    if (t == NULL) {
        return NULL;
    }
    t->slots = NULL;
    t->size = 0;
    t->width = (size_t)width;
    size_t capacity = capacity_for(t, (size_t)hint);
    if (capacity == 0) {
        Py_DECREF(t);
        return NULL;
    }
    t->slots = new_slots(t, capacity);
    if (t->slots == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    t->mask = capacity - 1;
    t->max_fill = max_fill_of(capacity);
    t->min_capacity = capacity;
    return (PyObject *)t;
}

/* Release the meta of every entry of `slots` (capacity slots). */
static void release_metas(const KeyTableObject *t, unsigned char *slots, size_t capacity) {
    for (size_t i = 0; i < capacity; i++) {
        unsigned char *s = slots + i * SLOT_BYTES(t->width);
        if (slot_used(s)) {
            Py_XDECREF(slot_value(s, t->width)->meta);
        }
    }
}

static void KeyTable_dealloc(KeyTableObject *t) {
    if (t->slots != NULL) {
        release_metas(t, t->slots, capacity_of(t));
        PyMem_Free(t->slots);
    }
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t KeyTable_length(KeyTableObject *t) { return (Py_ssize_t)t->size; }

static int KeyTable_contains(KeyTableObject *t, PyObject *key_obj) {
    KeyArg k;
    if (key_arg(key_obj, &k) < 0) {
        return -1;
    }
    int found = (size_t)k.len == t->width && find(t, k.buf) != NOT_FOUND;
    key_release(&k);
    return found;
}

/* methods */

PyDoc_STRVAR(get_doc,
"get(key, /)\n--\n\n"
"(nbytes, charged, meta) of key, or None when it is absent.");

/* Slot index of key_obj in *i (NOT_FOUND when absent).  -1 on a bad key. */
static int lookup(KeyTableObject *t, PyObject *key_obj, size_t *i) {
    KeyArg k;
    if (key_of_width(t, key_obj, &k) < 0) {
        return -1;
    }
    *i = find(t, k.buf);
    key_release(&k);
    return 0;
}

static PyObject *KeyTable_get(KeyTableObject *t, PyObject *key_obj) {
    size_t i;
    if (lookup(t, key_obj, &i) < 0) {
        return NULL;
    }
    if (i == NOT_FOUND) {
        Py_RETURN_NONE;
    }
    return entry_tuple(slot_value(slot_at(t, i, t->width), t->width));
}

PyDoc_STRVAR(set_doc,
"set(key, nbytes, charged, meta=b'')\n--\n\n"
"Insert or replace key's entry; return the previous (nbytes, charged, meta)\n"
"or None.  nbytes and charged: ints in [0, 2**63); meta: bytes.");

static PyObject *KeyTable_set(KeyTableObject *t, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"key", "nbytes", "charged", "meta", NULL};
    PyObject *key_obj, *nbytes_obj, *charged_obj, *meta_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:set", kwlist, &key_obj,
                                     &nbytes_obj, &charged_obj, &meta_obj)) {
        return NULL;
    }
    KeyArg k;
    if (key_of_width(t, key_obj, &k) < 0) {
        return NULL;
    }
    Value nv;
    PyObject *res = NULL;
    nv.meta = NULL;
    if (count_from_object(nbytes_obj, "nbytes", &nv.nbytes) < 0 ||
        count_from_object(charged_obj, "charged", &nv.charged) < 0 ||
        (meta_obj != NULL && meta_from_object(meta_obj, &nv.meta) < 0)) {
        goto done;
    }
    const size_t w = t->width;
    size_t i = find(t, k.buf);
    if (i != NOT_FOUND) {
        Value *v = slot_value(slot_at(t, i, w), w);
        res = entry_tuple(v);
        if (res == NULL) {
            goto done;
        }
        PyObject *old = v->meta;
        *v = nv;
        nv.meta = NULL; /* the table owns it now */
        Py_XDECREF(old);
        goto done;
    }
    if (reserve(t, t->size + 1) < 0) {
        goto done;
    }
    uint64_t h = hash_key(k.buf, w);
    unsigned char *s = slot_at(t, find_or_free_h(t, k.buf, h, w), w);
    occupy(t, s, k.buf, h, w);
    *slot_value(s, w) = nv;
    nv.meta = NULL;
    res = Py_None;
    Py_INCREF(res);
done:
    Py_XDECREF(nv.meta);
    key_release(&k);
    return res;
}

PyDoc_STRVAR(pop_doc,
"pop(key, /)\n--\n\n"
"Remove key and return its (nbytes, charged, meta), or None when it is absent.");

static PyObject *KeyTable_pop(KeyTableObject *t, PyObject *key_obj) {
    size_t i;
    if (lookup(t, key_obj, &i) < 0) {
        return NULL;
    }
    if (i == NOT_FOUND) {
        Py_RETURN_NONE;
    }
    const Value *v = slot_value(slot_at(t, i, t->width), t->width);
    PyObject *res = entry_tuple(v);
    if (res == NULL) {
        return NULL;
    }
    PyObject *meta = v->meta;
    erase(t, i, t->width);
    Py_XDECREF(meta);
    return res;
}

PyDoc_STRVAR(put_many_doc,
"put_many(rows, nbytes, charged, meta, budget)\n--\n\n"
"Record every key of rows with (nbytes, charged, meta), as if set one by one;\n"
"return (added, delta), or None when delta > budget, in which case the table\n"
"is left exactly as it was.\n\n"
"rows: a C-contiguous buffer of packed width-byte keys (a uint8 array of\n"
"shape (n, width), a void array, bytes).  added: keys that were absent\n"
"before the call; delta: the sum over rows of charged minus the charge the\n"
"key had just before the row (0 for a new key), so a repeated key counts\n"
"once.  OverflowError (and nothing changed) when delta leaves int64.");

static PyObject *KeyTable_put_many(KeyTableObject *t, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"rows", "nbytes", "charged", "meta", "budget", NULL};
    PyObject *rows_obj, *nbytes_obj, *charged_obj, *meta_obj, *budget_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO:put_many", kwlist, &rows_obj,
                                     &nbytes_obj, &charged_obj, &meta_obj, &budget_obj)) {
        return NULL;
    }
    Py_buffer rv;
    Py_ssize_t n;
    if (rows_arg(t, rows_obj, &rv, &n) < 0) {
        return NULL;
    }
    PyObject *res = NULL, *meta = NULL;
    Undo *journal = NULL;
    Value nv;
    int64_t budget;
    int reject = 0; /* budget below INT64_MIN: nothing fits */
    if (count_from_object(nbytes_obj, "nbytes", &nv.nbytes) < 0 ||
        count_from_object(charged_obj, "charged", &nv.charged) < 0 ||
        meta_from_object(meta_obj, &meta) < 0) {
        goto done;
    }
    nv.meta = meta;
    PyObject *num = PyNumber_Index(budget_obj);
    if (num == NULL) {
        goto done;
    }
    int overflow;
    long long b = PyLong_AsLongLongAndOverflow(num, &overflow);
    Py_DECREF(num);
    if (b == -1 && PyErr_Occurred()) {
        goto done;
    }
    budget = overflow > 0 ? INT64_MAX : overflow < 0 ? INT64_MIN : (int64_t)b;
    reject = overflow < 0;

    if ((size_t)n > (size_t)PY_SSIZE_T_MAX / sizeof(Undo)) {
        PyErr_NoMemory();
        goto done;
    }
    journal = PyMem_Malloc((size_t)n * sizeof(Undo) + 1);
    if (journal == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (reserve(t, t->size + (size_t)n) < 0) {
        goto done;
    }
    const unsigned char *keys = rv.buf;
    int64_t delta;
    Py_ssize_t added;
    int overflowed = 0;
    Py_ssize_t applied = apply_rows_any(t, keys, n, &nv, journal, &delta, &added, &overflowed);
    if (overflowed || reject || delta > budget) {
        undo_rows(t, keys, applied, journal);
        if (overflowed) {
            PyErr_SetString(PyExc_OverflowError,
                            "put_many: the change in charged bytes overflows int64");
        } else {
            res = Py_None;
            Py_INCREF(res);
        }
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_XDECREF(journal[j].meta); /* metas the rows replaced */
    }
    res = Py_BuildValue("(nL)", added, (long long)delta);
done:
    PyMem_Free(journal);
    Py_XDECREF(meta);
    PyBuffer_Release(&rv);
    return res;
}

PyDoc_STRVAR(delete_many_doc,
"delete_many(rows, /)\n--\n\n"
"Remove every key of rows (as for put_many) that is present; absent and\n"
"repeated keys are ignored.  Return (removed, freed): the entries removed\n"
"and the sum of their charged.");

static PyObject *KeyTable_delete_many(KeyTableObject *t, PyObject *rows_obj) {
    Py_buffer rv;
    Py_ssize_t n;
    if (rows_arg(t, rows_obj, &rv, &n) < 0) {
        return NULL;
    }
    Py_ssize_t removed;
    uint64_t lo, hi; /* freed = hi * 2**64 + lo: charges are < 2**63 each */
    delete_rows_any(t, rv.buf, n, &removed, &lo, &hi);
    PyBuffer_Release(&rv);
    PyObject *freed = PyLong_FromUnsignedLongLong(lo);
    if (freed != NULL && hi != 0) {
        PyObject *h = PyLong_FromUnsignedLongLong(hi), *shift = PyLong_FromLong(64);
        PyObject *high = h && shift ? PyNumber_Lshift(h, shift) : NULL;
        PyObject *sum = high ? PyNumber_Add(high, freed) : NULL;
        Py_XDECREF(h);
        Py_XDECREF(shift);
        Py_XDECREF(high);
        Py_SETREF(freed, sum);
    }
    if (freed == NULL) {
        return NULL;
    }
    return Py_BuildValue("(nN)", removed, freed);
}

PyDoc_STRVAR(items_doc,
"items()\n--\n\n"
"A new list of (key, nbytes, charged, meta) tuples, in unspecified order.");

static PyObject *KeyTable_items(KeyTableObject *t, PyObject *noargs) {
    (void)noargs;
    PyObject *list = PyList_New((Py_ssize_t)t->size);
    if (list == NULL) {
        return NULL;
    }
    Py_ssize_t k = 0;
    for (size_t i = 0; i <= t->mask; i++) {
        unsigned char *s = slot_at(t, i, t->width);
        if (!slot_used(s)) {
            continue;
        }
        const Value *v = slot_value(s, t->width);
        PyObject *meta = v->meta != NULL ? v->meta : PyBytes_FromStringAndSize(NULL, 0);
        if (meta == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        if (v->meta != NULL) {
            Py_INCREF(meta);
        }
        PyObject *item = Py_BuildValue("(y#LLN)", (const char *)(s + KEY_OFFSET),
                                       (Py_ssize_t)t->width, (long long)v->nbytes,
                                       (long long)v->charged, meta);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, k++, item);
    }
    return list;
}

PyDoc_STRVAR(clear_doc,
"clear()\n--\n\n"
"Remove every entry and shrink the table back to its initial capacity.");

static PyObject *KeyTable_clear(KeyTableObject *t, PyObject *noargs) {
    (void)noargs;
    unsigned char *slots = new_slots(t, t->min_capacity);
    if (slots == NULL) {
        return NULL;
    }
    unsigned char *old = t->slots;
    size_t old_capacity = capacity_of(t);
    t->slots = slots;
    t->mask = t->min_capacity - 1;
    t->max_fill = max_fill_of(t->min_capacity);
    t->size = 0;
    release_metas(t, old, old_capacity);
    PyMem_Free(old);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(memory_bytes_doc,
"memory_bytes()\n--\n\n"
"Bytes this table holds: its slots plus the object header (the meta bytes\n"
"objects, usually shared, are not counted).");

static PyObject *KeyTable_memory_bytes(KeyTableObject *t, PyObject *noargs) {
    (void)noargs;
    return PyLong_FromSize_t((size_t)Py_TYPE(t)->tp_basicsize +
                             capacity_of(t) * SLOT_BYTES(t->width));
}

PyDoc_STRVAR(sizeof_doc,
"__sizeof__()\n--\n\n"
"Same as memory_bytes(): what sys.getsizeof reports.");

static PyObject *KeyTable_get_width(KeyTableObject *t, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(t->width);
}

static PyGetSetDef KeyTable_getset[] = {
    {"width", (getter)KeyTable_get_width, NULL, "Bytes in every key.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef KeyTable_methods[] = {
    {"get", (PyCFunction)KeyTable_get, METH_O, get_doc},
    {"set", (PyCFunction)(void (*)(void))KeyTable_set, METH_VARARGS | METH_KEYWORDS,
     set_doc},
    {"pop", (PyCFunction)KeyTable_pop, METH_O, pop_doc},
    {"put_many", (PyCFunction)(void (*)(void))KeyTable_put_many,
     METH_VARARGS | METH_KEYWORDS, put_many_doc},
    {"delete_many", (PyCFunction)KeyTable_delete_many, METH_O, delete_many_doc},
    {"items", (PyCFunction)KeyTable_items, METH_NOARGS, items_doc},
    {"clear", (PyCFunction)KeyTable_clear, METH_NOARGS, clear_doc},
    {"memory_bytes", (PyCFunction)KeyTable_memory_bytes, METH_NOARGS, memory_bytes_doc},
    {"__sizeof__", (PyCFunction)KeyTable_memory_bytes, METH_NOARGS, sizeof_doc},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods KeyTable_as_mapping = {
    .mp_length = (lenfunc)KeyTable_length,
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_contains = (objobjproc)KeyTable_contains,
};

PyDoc_STRVAR(KeyTable_doc,
"KeyTable(width, capacity_hint=0)\n--\n\n"
"Open-addressing table from width-byte keys to (nbytes, charged, meta).\n\n"
"width: key bytes, in [8, 65536].  capacity_hint: entries that fit without\n"
"a resize.  Keys are bytes-like objects of exactly width bytes (ValueError\n"
"otherwise; `key in t` is simply False for another length).  nbytes and\n"
"charged are ints in [0, 2**63); meta is bytes (b'' for none).  Methods:\n"
"get, set, pop, put_many, delete_many, items, clear, memory_bytes; len(t)\n"
"and `key in t`.");

static PyTypeObject KeyTable_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hybridstore._cext.keytable.KeyTable",
    .tp_basicsize = sizeof(KeyTableObject),
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_as_mapping = &KeyTable_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = KeyTable_doc,
    .tp_methods = KeyTable_methods,
    .tp_getset = KeyTable_getset,
    .tp_new = KeyTable_new,
};

/* ------------------------------------------------------------------------ */

static struct PyModuleDef keytable_module = {
    PyModuleDef_HEAD_INIT,
    "hybridstore._cext.keytable",
    "C twin of hybridstore.backends.keytable: an exact-key object table.\n\n"
    "Import KeyTable from hybridstore.backends.keytable; it falls back to a\n"
    "dict-based twin with the same API when this module is not built.",
    -1,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit_keytable(void) {
    if (PyType_Ready(&KeyTable_Type) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&keytable_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&KeyTable_Type);
    if (PyModule_AddObject(m, "KeyTable", (PyObject *)&KeyTable_Type) < 0) {
        Py_DECREF(&KeyTable_Type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
