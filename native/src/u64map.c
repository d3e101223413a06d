/*
 * hybridstore._cext.u64map -- a compact hash map from uint64 keys to int32
 * values, the C twin of hybridstore.index.u64map.PyU64Map.
 *
 * It stands in for a dict[int, int] that maps the low 64 bits of a 128-bit
 * block key to a node id, where the dict costs ~100 bytes per entry in Python
 * int objects and table slots.  hybridstore.index.u64map documents the API
 * and picks this type when it is built.
 *
 * Design
 * ------
 * - One allocation of `capacity` slots, a power of two.  A slot is 12 packed
 *   bytes: the key (uint64) then the value (int32), read and written with
 *   memcpy (plain unaligned loads on x86-64), so a probe mostly touches one
 *   cache line and a slot costs 12 bytes: 17-34 bytes per entry between the
 *   0.35 and 0.7 load factors the table moves between.
 * - Occupancy lives in the value: values are >= 0 and -1 marks an empty slot,
 *   so every uint64, 0 and 2**64-1 included, is a valid key.  A fresh table
 *   is memset to 0xFF (value -1 everywhere).
 * - The home slot is splitmix64's finalizer of the key masked to the
 *   capacity: keys that differ only in their high bits (e.g. multiples of
 *   2**40) still spread.  Collisions probe linearly.
 * - The load factor stays <= 0.7: an insert that would pass it doubles the
 *   table first (set_many sizes it once, up front, for len + n entries).
 *   Since 0.7 < 1 there is always an empty slot, which ends every probe.
 * - Deletion is backward-shift deletion: later entries of the cluster that
 *   may legally move into the hole do so, and the last hole is emptied.  No
 *   tombstones, so lookups stay as fast after many deletes as before.
 *   The table never shrinks on delete; clear() returns to the capacity the
 *   map was created with.
 * - Every structural change (new key, delete, resize, clear) bumps a version
 *   counter; an iterator that sees it change raises RuntimeError, like a
 *   dict that changed size during iteration.
 * - The batch methods take any buffer-protocol object (numpy arrays) of the
 *   right item type; see get_typed_buffer.  They keep the GIL: the calls are
 *   short and the callers hold their own lock.  get_many / prefix_many
 *   prefetch the home slot of the key PREFETCH_AHEAD positions ahead, so
 *   the cache misses of consecutive lookups overlap (~20% faster on 2048
 *   fresh keys once the table outgrows the caches).
 *
 * The map holds no Python objects, so it is not tracked by the GC.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include "hybridstore/buffers.h"
#include "hybridstore/tables.h"

#define SLOT_BYTES 12    /* uint64 key + int32 value, packed */
#define VALUE_OFFSET 8
#define EMPTY (-1)       /* value of an empty slot */
#define MISSING (-1)     /* what get_many writes for a missing key */
#define PREFETCH_AHEAD 16 /* keys between a prefetch and its lookup */
#define ITEMSIZE(n) (1u << (n)) /* bit of an accepted buffer item size */

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((p), 0, 1)
#else
#define PREFETCH(p) ((void)(p))
#endif


static inline uint64_t slot_key(const unsigned char *s) {
    uint64_t k;
    memcpy(&k, s, sizeof k);
    return k;
}

static inline int32_t slot_value(const unsigned char *s) {
    int32_t v;
    memcpy(&v, s + VALUE_OFFSET, sizeof v);
    return v;
}

static inline void slot_set(unsigned char *s, uint64_t key, int32_t value) {
    memcpy(s, &key, sizeof key);
    memcpy(s + VALUE_OFFSET, &value, sizeof value);
}

static inline void slot_set_value(unsigned char *s, int32_t value) {
    memcpy(s + VALUE_OFFSET, &value, sizeof value);
}


/* ------------------------------------------------------------------------ */
/* the table                                                                 */

typedef struct {
    PyObject_HEAD
    unsigned char *slots; /* capacity * SLOT_BYTES bytes */
    size_t mask;          /* capacity - 1 */
    size_t size;          /* entries */
    size_t max_fill;      /* max_fill_of(capacity) */
    size_t min_capacity;  /* capacity at creation; clear() returns to it */
    uint64_t version;     /* bumped on every structural change */
} U64MapObject;

static inline size_t capacity_of(const U64MapObject *m) { return m->mask + 1; }

static inline unsigned char *slot_at(const U64MapObject *m, size_t i) {
    return m->slots + i * SLOT_BYTES;
}

static inline size_t home_of(const U64MapObject *m, uint64_t key) {
    return (size_t)mix64(key) & m->mask;
}

/* Capacity for n entries (see table_capacity_for). */
static size_t capacity_for(size_t n) { return table_capacity_for(n, SLOT_BYTES); }

/* A fresh table of `capacity` empty slots, or NULL with MemoryError set. */
static unsigned char *new_slots(size_t capacity) {
    unsigned char *slots = PyMem_Malloc(capacity * SLOT_BYTES);
    if (slots == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memset(slots, 0xFF, capacity * SLOT_BYTES); /* every value -1: empty */
    return slots;
}

/* Slot that holds key, or NULL. */
static inline unsigned char *find(const U64MapObject *m, uint64_t key) {
    size_t i = home_of(m, key);
    for (;;) {
        unsigned char *s = slot_at(m, i);
        if (slot_value(s) == EMPTY) {
            return NULL;
        }
        if (slot_key(s) == key) {
            return s;
        }
        i = (i + 1) & m->mask;
    }
}

/* Slot that holds key or, when absent, the empty slot where it would go. */
static inline unsigned char *find_or_free(const U64MapObject *m, uint64_t key) {
    size_t i = home_of(m, key);
    for (;;) {
        unsigned char *s = slot_at(m, i);
        if (slot_value(s) == EMPTY || slot_key(s) == key) {
            return s;
        }
        i = (i + 1) & m->mask;
    }
}

/* Move every entry into a new table of `capacity` slots.  -1 on MemoryError. */
static int resize(U64MapObject *m, size_t capacity) {
    unsigned char *slots = new_slots(capacity);
    if (slots == NULL) {
        return -1;
    }
    unsigned char *old = m->slots;
    size_t old_capacity = capacity_of(m);
    m->slots = slots;
    m->mask = capacity - 1;
    m->max_fill = max_fill_of(capacity);
    m->version++;
    for (size_t j = 0; j < old_capacity; j++) {
        const unsigned char *src = old + j * SLOT_BYTES;
        if (slot_value(src) != EMPTY) {
            memcpy(find_or_free(m, slot_key(src)), src, SLOT_BYTES);
        }
    }
    PyMem_Free(old);
    return 0;
}

/* Grow, when needed, so that n entries fit.  -1 on MemoryError. */
static int reserve(U64MapObject *m, size_t n) {
    if (n <= m->max_fill) {
        return 0;
    }
    size_t capacity = capacity_for(n);
    return capacity == 0 ? -1 : resize(m, capacity);
}

/* m[key] = value (value >= 0).  -1 on MemoryError, leaving m unchanged. */
static int put(U64MapObject *m, uint64_t key, int32_t value) {
    unsigned char *s = find_or_free(m, key);
    if (slot_value(s) != EMPTY) {
        slot_set_value(s, value);
        return 0;
    }
    if (m->size + 1 > m->max_fill) {
        if (reserve(m, m->size + 1) < 0) {
            return -1;
        }
        s = find_or_free(m, key);
    }
    slot_set(s, key, value);
    m->size++;
    m->version++;
    return 0;
}

/*
 * Remove the entry in slot s by backward-shift deletion: walk the cluster
 * after the hole and move each entry whose home slot is not cyclically inside
 * (hole, its slot] into the hole, which then moves to where it came from.
 */
static void erase(U64MapObject *m, unsigned char *s) {
    const size_t mask = m->mask;
    size_t hole = (size_t)(s - m->slots) / SLOT_BYTES;
    size_t j = hole;
    for (;;) {
        j = (j + 1) & mask;
        unsigned char *sj = slot_at(m, j);
        if (slot_value(sj) == EMPTY) {
            break;
        }
        size_t home = home_of(m, slot_key(sj));
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            memcpy(slot_at(m, hole), sj, SLOT_BYTES);
            hole = j;
        }
    }
    slot_set_value(slot_at(m, hole), EMPTY);
    m->size--;
    m->version++;
}

/* ------------------------------------------------------------------------ */
/* argument conversion                                                       */

/* A Python int (or __index__ object) in [0, 2**64) -> *key.  -1 on error. */
static int key_from_object(PyObject *obj, uint64_t *key) {
    PyObject *num = PyNumber_Index(obj);
    if (num == NULL) {
        return -1;
    }
    unsigned long long k = PyLong_AsUnsignedLongLong(num);
    if (k == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Format(PyExc_OverflowError,
                         "U64Map keys must be ints in [0, 2**64), got %R", num);
        }
        Py_DECREF(num);
        return -1;
    }
    Py_DECREF(num);
    *key = (uint64_t)k;
    return 0;
}

/* Set the error for an int value outside [0, 2**31): ValueError when negative. */
static void value_range_error(PyObject *value, int negative) {
    PyErr_Format(negative ? PyExc_ValueError : PyExc_OverflowError,
                 "U64Map values must be ints in [0, 2**31) (-1 marks an empty "
                 "slot), got %R", value);
}

/* A Python int (or __index__ object) in [0, 2**31) -> *value.  -1 on error. */
static int value_from_object(PyObject *obj, int32_t *value) {
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
    if (overflow != 0 || v < 0 || v > INT32_MAX) {
        value_range_error(num, overflow < 0 || (overflow == 0 && v < 0));
        Py_DECREF(num);
        return -1;
    }
    Py_DECREF(num);
    *value = (int32_t)v;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* buffer helpers                                                            */


/*
 * Get a 1-D C-contiguous buffer of native integers for argument `what`.
 * `itemsizes` is a mask of accepted item sizes (ITEMSIZE(4) | ITEMSIZE(8)),
 * `kinds` the accepted kinds ("iu" = signed or unsigned); `desc` and `dtype`
 * name them in the TypeError.  With `writable`,
 * the buffer must be writable.  The buffer is requested as memoryview()
 * does (PyBUF_FULL_RO) and checked here, so every exporter fails the same
 * way: TypeError for a wrong item type, ValueError for a wrong shape, a
 * non-contiguous layout or a read-only output.  0 on success; on error the
 * view is released.
 */
static int get_typed_buffer(PyObject *obj, Py_buffer *view, const char *what,
                            unsigned itemsizes, const char *kinds, const char *desc,
                            const char *dtype, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FULL_RO) < 0) {
        return -1;
    }
    char kind = native_int_kind(view->format);
    if (kind == 0 || strchr(kinds, kind) == NULL || view->itemsize < 1 ||
        view->itemsize > 8 || !(itemsizes & ITEMSIZE(view->itemsize))) {
        PyErr_Format(PyExc_TypeError,
                     "%s must hold native-order %s (got buffer format '%s', itemsize "
                     "%zd); convert it with np.ascontiguousarray(x, dtype=%s)",
                     what, desc, view->format ? view->format : "B", view->itemsize,
                     dtype);
    } else if (view->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be 1-D, got %d dimensions", what,
                     view->ndim);
    } else if (!PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be C-contiguous; copy it with np.ascontiguousarray(x)",
                     what);
    } else if (writable && view->readonly) {
        PyErr_Format(PyExc_ValueError, "%s must be writable, got a read-only buffer",
                     what);
    } else {
        return 0;
    }
    PyBuffer_Release(view);
    return -1;
}

/* Keys: 8-byte integers, read as uint64 (int64 keys are taken bit for bit). */
static int get_keys(PyObject *obj, Py_buffer *view) {
    return get_typed_buffer(obj, view, "keys", ITEMSIZE(8), "iu",
                            "8-byte integers (uint64)", "np.uint64", 0);
}

/* The output of get_many / prefix_many: writable int64, as long as keys. */
static int get_out(PyObject *obj, Py_buffer *view, const Py_buffer *keys) {
    if (get_typed_buffer(obj, view, "out", ITEMSIZE(8), "i", "int64", "np.int64", 1) < 0) {
        return -1;
    }
    if (view->shape[0] != keys->shape[0]) {
        PyErr_Format(PyExc_ValueError, "out has %zd items but keys has %zd",
                     view->shape[0], keys->shape[0]);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* the U64Map type                                                           */

static PyTypeObject U64MapIter_Type;

static PyObject *U64Map_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"capacity_hint", NULL};
    Py_ssize_t hint = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|n:U64Map", kwlist, &hint)) {
        return NULL;
    }
    if (hint < 0) {
        PyErr_Format(PyExc_ValueError, "capacity_hint must be >= 0, got %zd", hint);
        return NULL;
    }
    size_t capacity = capacity_for((size_t)hint);
    if (capacity == 0) {
        return NULL;
    }
    U64MapObject *m = (U64MapObject *)type->tp_alloc(type, 0);
    if (m == NULL) {
        return NULL;
    }
    m->slots = new_slots(capacity);
    if (m->slots == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    m->mask = capacity - 1;
    m->size = 0;
    m->max_fill = max_fill_of(capacity);
    m->min_capacity = capacity;
    m->version = 0;
    return (PyObject *)m;
}

static void U64Map_dealloc(U64MapObject *m) {
    PyMem_Free(m->slots);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static size_t memory_bytes_of(const U64MapObject *m) {
    return (size_t)Py_TYPE(m)->tp_basicsize + capacity_of(m) * SLOT_BYTES;
}

/* mapping protocol */

static Py_ssize_t U64Map_length(U64MapObject *m) { return (Py_ssize_t)m->size; }

static PyObject *U64Map_subscript(U64MapObject *m, PyObject *key_obj) {
    uint64_t key;
    if (key_from_object(key_obj, &key) < 0) {
        return NULL;
    }
    const unsigned char *s = find(m, key);
    if (s == NULL) {
        PyErr_SetObject(PyExc_KeyError, key_obj);
        return NULL;
    }
    return PyLong_FromLong(slot_value(s));
}

static int U64Map_ass_subscript(U64MapObject *m, PyObject *key_obj, PyObject *value_obj) {
    uint64_t key;
    if (key_from_object(key_obj, &key) < 0) {
        return -1;
    }
    if (value_obj == NULL) { /* del m[key] */
        unsigned char *s = find(m, key);
        if (s == NULL) {
            PyErr_SetObject(PyExc_KeyError, key_obj);
            return -1;
        }
        erase(m, s);
        return 0;
    }
    int32_t value;
    if (value_from_object(value_obj, &value) < 0) {
        return -1;
    }
    return put(m, key, value);
}

static int U64Map_contains(U64MapObject *m, PyObject *key_obj) {
    uint64_t key;
    if (key_from_object(key_obj, &key) < 0) {
        return -1;
    }
    return find(m, key) != NULL;
}

static PyObject *U64Map_iter(U64MapObject *m);

/* methods */

PyDoc_STRVAR(get_doc,
"get(key, default=None, /)\n--\n\n"
"m[key] when key is present, else default.");

static PyObject *U64Map_get(U64MapObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "get expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    uint64_t key;
    if (key_from_object(args[0], &key) < 0) {
        return NULL;
    }
    const unsigned char *s = find(m, key);
    if (s != NULL) {
        return PyLong_FromLong(slot_value(s));
    }
    PyObject *dflt = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(dflt);
    return dflt;
}

PyDoc_STRVAR(pop_doc,
"pop(key[, default], /)\n--\n\n"
"Remove key and return its value.  When key is missing, return default,\n"
"or raise KeyError when no default is given.");

static PyObject *U64Map_pop(U64MapObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "pop expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    uint64_t key;
    if (key_from_object(args[0], &key) < 0) {
        return NULL;
    }
    unsigned char *s = find(m, key);
    if (s == NULL) {
        if (nargs == 2) {
            Py_INCREF(args[1]);
            return args[1];
        }
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    int32_t value = slot_value(s);
    erase(m, s);
    return PyLong_FromLong(value);
}

PyDoc_STRVAR(clear_doc,
"clear()\n--\n\n"
"Remove every entry and shrink the table back to its initial capacity.");

static PyObject *U64Map_clear(U64MapObject *m, PyObject *noargs) {
    (void)noargs;
    unsigned char *slots = new_slots(m->min_capacity);
    if (slots == NULL) {
        return NULL;
    }
    PyMem_Free(m->slots);
    m->slots = slots;
    m->mask = m->min_capacity - 1;
    m->max_fill = max_fill_of(m->min_capacity);
    m->size = 0;
    m->version++;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(items_doc,
"items()\n--\n\n"
"A new list of (key, value) tuples, in unspecified order.");

static PyObject *U64Map_items(U64MapObject *m, PyObject *noargs) {
    (void)noargs;
    PyObject *list = PyList_New((Py_ssize_t)m->size);
    if (list == NULL) {
        return NULL;
    }
    Py_ssize_t k = 0;
    for (size_t i = 0; i <= m->mask; i++) {
        const unsigned char *s = slot_at(m, i);
        int32_t value = slot_value(s);
        if (value == EMPTY) {
            continue;
        }
        PyObject *item = Py_BuildValue("(Kl)", (unsigned long long)slot_key(s),
                                       (long)value);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, k++, item);
    }
    return list;
}

PyDoc_STRVAR(get_many_doc,
"get_many(keys, out, /)\n--\n\n"
"For each i, out[i] = m[keys[i]], or -1 when keys[i] is missing.\n\n"
"keys: 1-D C-contiguous buffer of 8-byte integers (np.uint64; int64 is\n"
"read bit for bit).  out: writable 1-D C-contiguous int64 buffer of the\n"
"same length.  Returns None.");

/*
 * get_many and prefix_many: look keys up in order into out; with stop_at_miss,
 * stop at the first missing key and return how many were found (Python int),
 * else write MISSING for missing keys and return None.
 */
static PyObject *lookup_many(U64MapObject *m, PyObject *const *args, Py_ssize_t nargs,
                             const char *name, int stop_at_miss) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s expected 2 arguments, got %zd", name, nargs);
        return NULL;
    }
    Py_buffer kv, ov;
    if (get_keys(args[0], &kv) < 0) {
        return NULL;
    }
    if (get_out(args[1], &ov, &kv) < 0) {
        PyBuffer_Release(&kv);
        return NULL;
    }
    const uint64_t *keys = kv.buf;
    int64_t *out = ov.buf;
    Py_ssize_t n = kv.shape[0];
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            PREFETCH(slot_at(m, home_of(m, keys[i + PREFETCH_AHEAD])));
        }
        const unsigned char *s = find(m, keys[i]);
        if (s == NULL && stop_at_miss) {
            break;
        }
        out[i] = s == NULL ? MISSING : slot_value(s);
    }
    PyBuffer_Release(&ov);
    PyBuffer_Release(&kv);
    if (stop_at_miss) {
        return PyLong_FromSsize_t(i);
    }
    Py_RETURN_NONE;
}

static PyObject *U64Map_get_many(U64MapObject *m, PyObject *const *args,
                                 Py_ssize_t nargs) {
    return lookup_many(m, args, nargs, "get_many", 0);
}

PyDoc_STRVAR(prefix_many_doc,
"prefix_many(keys, out, /)\n--\n\n"
"Look keys up in order until the first missing one; return the count k of\n"
"leading keys found.  out[:k] receives their values; out[k:] is untouched.\n"
"Arguments as for get_many.");

static PyObject *U64Map_prefix_many(U64MapObject *m, PyObject *const *args,
                                    Py_ssize_t nargs) {
    return lookup_many(m, args, nargs, "prefix_many", 1);
}

/*
 * Item i of a buffer of 4- or 8-byte native integers of the given kind, as
 * int64; a uint64 above INT64_MAX reads as INT64_MAX (it is only range-checked).
 */
static int64_t read_value(const Py_buffer *vv, char kind, Py_ssize_t i) {
    if (vv->itemsize == 4) {
        return kind == 'i' ? (int64_t)((const int32_t *)vv->buf)[i]
                           : (int64_t)((const uint32_t *)vv->buf)[i];
    }
    if (kind == 'i') {
        return ((const int64_t *)vv->buf)[i];
    }
    uint64_t u = ((const uint64_t *)vv->buf)[i];
    return u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)u;
}

/* Set the error for values[i], which lies outside [0, 2**31). */
static void bad_value_item(const Py_buffer *vv, char kind, Py_ssize_t i) {
    int64_t v = read_value(vv, kind, i);
    PyObject *bad = kind == 'u' && vv->itemsize == 8
                        ? PyLong_FromUnsignedLongLong(((const uint64_t *)vv->buf)[i])
                        : PyLong_FromLongLong(v);
    if (bad != NULL) {
        value_range_error(bad, v < 0);
        Py_DECREF(bad);
    }
}

PyDoc_STRVAR(set_many_doc,
"set_many(keys, values, /)\n--\n\n"
"m[keys[i]] = values[i] for each i in order (a repeated key keeps its last\n"
"value).  keys as for get_many; values: 1-D C-contiguous buffer of 4- or\n"
"8-byte integers of the same length, each in [0, 2**31).  Every value is\n"
"checked before anything is stored (ValueError for a negative one,\n"
"OverflowError for one >= 2**31), and the table is sized once, up front,\n"
"for len(m) + len(keys) entries.");

static PyObject *U64Map_set_many(U64MapObject *m, PyObject *const *args,
                                 Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "set_many expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    Py_buffer kv, vv;
    if (get_keys(args[0], &kv) < 0) {
        return NULL;
    }
    if (get_typed_buffer(args[1], &vv, "values", ITEMSIZE(4) | ITEMSIZE(8), "iu",
                         "4- or 8-byte integers", "np.int32", 0) < 0) {
        PyBuffer_Release(&kv);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t n = kv.shape[0];
    if (vv.shape[0] != n) {
        PyErr_Format(PyExc_ValueError, "values has %zd items but keys has %zd",
                     vv.shape[0], n);
        goto done;
    }
    const char kind = native_int_kind(vv.format);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v = read_value(&vv, kind, i);
        if (v < 0 || v > INT32_MAX) {
            bad_value_item(&vv, kind, i);
            goto done;
        }
    }
    if (reserve(m, m->size + (size_t)n) < 0) {
        goto done;
    }
    const uint64_t *keys = kv.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        (void)put(m, keys[i], (int32_t)read_value(&vv, kind, i)); /* reserved: no resize */
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&vv);
    PyBuffer_Release(&kv);
    return res;
}

PyDoc_STRVAR(delete_many_doc,
"delete_many(keys, /)\n--\n\n"
"Remove every key of keys (as for get_many) that is present; return how\n"
"many entries were removed.");

static PyObject *U64Map_delete_many(U64MapObject *m, PyObject *keys_obj) {
    Py_buffer kv;
    if (get_keys(keys_obj, &kv) < 0) {
        return NULL;
    }
    const uint64_t *keys = kv.buf;
    Py_ssize_t n = kv.shape[0], removed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char *s = find(m, keys[i]);
        if (s != NULL) {
            erase(m, s);
            removed++;
        }
    }
    PyBuffer_Release(&kv);
    return PyLong_FromSsize_t(removed);
}

PyDoc_STRVAR(memory_bytes_doc,
"memory_bytes()\n--\n\n"
"Bytes this map holds: its table plus the object header.");

static PyObject *U64Map_memory_bytes(U64MapObject *m, PyObject *noargs) {
    (void)noargs;
    return PyLong_FromSize_t(memory_bytes_of(m));
}

PyDoc_STRVAR(sizeof_doc,
"__sizeof__()\n--\n\n"
"Same as memory_bytes(): what sys.getsizeof reports.");

static PyMethodDef U64Map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))U64Map_get, METH_FASTCALL, get_doc},
    {"pop", (PyCFunction)(void (*)(void))U64Map_pop, METH_FASTCALL, pop_doc},
    {"clear", (PyCFunction)U64Map_clear, METH_NOARGS, clear_doc},
    {"items", (PyCFunction)U64Map_items, METH_NOARGS, items_doc},
    {"get_many", (PyCFunction)(void (*)(void))U64Map_get_many, METH_FASTCALL,
     get_many_doc},
    {"prefix_many", (PyCFunction)(void (*)(void))U64Map_prefix_many, METH_FASTCALL,
     prefix_many_doc},
    {"set_many", (PyCFunction)(void (*)(void))U64Map_set_many, METH_FASTCALL,
     set_many_doc},
    {"delete_many", (PyCFunction)U64Map_delete_many, METH_O, delete_many_doc},
    {"memory_bytes", (PyCFunction)U64Map_memory_bytes, METH_NOARGS, memory_bytes_doc},
    {"__sizeof__", (PyCFunction)U64Map_memory_bytes, METH_NOARGS, sizeof_doc},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods U64Map_as_mapping = {
    .mp_length = (lenfunc)U64Map_length,
    .mp_subscript = (binaryfunc)U64Map_subscript,
    .mp_ass_subscript = (objobjargproc)U64Map_ass_subscript,
};

static PySequenceMethods U64Map_as_sequence = {
    .sq_contains = (objobjproc)U64Map_contains,
};

PyDoc_STRVAR(U64Map_doc,
"U64Map(capacity_hint=0)\n--\n\n"
"Open-addressing hash map from uint64 keys to int32 values >= 0.\n\n"
"Keys are ints in [0, 2**64) (OverflowError otherwise, TypeError for\n"
"non-ints); values are ints in [0, 2**31) (ValueError when negative,\n"
"OverflowError when too large).  capacity_hint entries fit without a\n"
"resize.  Supports m[k], m[k] = v, del m[k], k in m, len(m), iteration\n"
"over the keys (unspecified order), get, pop, clear, items and the batch\n"
"methods get_many, prefix_many, set_many and delete_many over numpy\n"
"arrays.  12 bytes per slot at a load factor of at most 0.7.");

static PyTypeObject U64Map_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hybridstore._cext.u64map.U64Map",
    .tp_basicsize = sizeof(U64MapObject),
    .tp_dealloc = (destructor)U64Map_dealloc,
    .tp_as_sequence = &U64Map_as_sequence,
    .tp_as_mapping = &U64Map_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = U64Map_doc,
    .tp_iter = (getiterfunc)U64Map_iter,
    .tp_methods = U64Map_methods,
    .tp_new = U64Map_new,
};

/* ------------------------------------------------------------------------ */
/* key iterator                                                              */

typedef struct {
    PyObject_HEAD
    U64MapObject *map; /* NULL once exhausted */
    size_t pos;        /* next slot to look at */
    uint64_t version;  /* map->version when the iterator was made */
} U64MapIterObject;

static PyObject *U64Map_iter(U64MapObject *m) {
    U64MapIterObject *it = PyObject_New(U64MapIterObject, &U64MapIter_Type);
    if (it == NULL) {
        return NULL;
    }
    Py_INCREF(m);
    it->map = m;
    it->pos = 0;
    it->version = m->version;
    return (PyObject *)it;
}

static void U64MapIter_dealloc(U64MapIterObject *it) {
    Py_XDECREF(it->map);
    PyObject_Free(it);
}

static PyObject *U64MapIter_next(U64MapIterObject *it) {
    U64MapObject *m = it->map;
    if (m == NULL) {
        return NULL;
    }
    if (m->version != it->version) {
        PyErr_SetString(PyExc_RuntimeError, "U64Map changed size during iteration");
        return NULL;
    }
    for (; it->pos <= m->mask; it->pos++) {
        const unsigned char *s = slot_at(m, it->pos);
        if (slot_value(s) != EMPTY) {
            it->pos++;
            return PyLong_FromUnsignedLongLong(slot_key(s));
        }
    }
    it->map = NULL;
    Py_DECREF(m);
    return NULL;
}

static PyTypeObject U64MapIter_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hybridstore._cext.u64map.U64MapIterator",
    .tp_basicsize = sizeof(U64MapIterObject),
    .tp_dealloc = (destructor)U64MapIter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)U64MapIter_next,
};

/* ------------------------------------------------------------------------ */

static struct PyModuleDef u64map_module = {
    PyModuleDef_HEAD_INIT,
    "hybridstore._cext.u64map",
    "C twin of hybridstore.index.u64map: a compact uint64 -> int32 hash map.\n\n"
    "Import U64Map from hybridstore.index.u64map; it falls back to a dict-based\n"
    "twin with the same API when this module is not built.",
    -1,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit_u64map(void) {
    if (PyType_Ready(&U64Map_Type) < 0 || PyType_Ready(&U64MapIter_Type) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&u64map_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&U64Map_Type);
    if (PyModule_AddObject(m, "U64Map", (PyObject *)&U64Map_Type) < 0) {
        Py_DECREF(&U64Map_Type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
