/*
 * hybridstore._cext.hashing -- the C twin of hybridstore.index.keys.
 *
 * Computes the 128-bit chained prefix keys of hybridstore, keyed by the lane
 * multipliers of a store's secret.  The algorithm is specified in
 * hybridstore/index/keys.py; this file and the numpy twin there
 * must agree bit for bit (tests/index/test_keys.py checks it).
 *
 * Inputs are any C-contiguous buffer (buffer protocol) whose items are
 * unsigned or signed integers of the right size: 4 bytes for token ids,
 * 8 bytes for block ids.  The caller (keys.py) validates ranges; here the
 * items are read as uint32 / uint64.  Results are returned as a ``bytearray``
 * of packed little-endian uint64 pairs (lo, hi), one pair per key, which the
 * Python side wraps (writable, no copy) with
 * ``np.frombuffer(..., "<u8").reshape(-1, 2)``.  The GIL is released around
 * every hashing loop.
 *
 * The token kernels are compiled for the baseline target and, on x86-64 with
 * GCC/clang, also for AVX2 and AVX-512; the widest the CPU supports is chosen
 * at import (get_kernel(); set_kernel() overrides it for tests and
 * benchmarks).  All give identical keys.
 *
 * All arithmetic is on uint64: wrapping in finalize, and exact (no overflow
 * by construction) in the multilinear lane sums mod 2**61 - 1.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include "hybridstore/buffers.h"
#include "hybridstore/tables.h"

#define P3 UINT64_C(0x165667B19E3779F9)
#define P4 UINT64_C(0x85EBCA77C2B2AE63)
#define ID_NTOK_TAG (UINT64_C(1) << 40)
#define PRIME ((UINT64_C(1) << 61) - 1)
#define M32 UINT64_C(0xFFFFFFFF)
#define M29 ((UINT64_C(1) << 29) - 1)


static inline uint64_t rotl64(uint64_t x, unsigned r) {
    return (x << r) | (x >> (64u - r));
}

static inline void store_le64(unsigned char *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && \
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &v, 8);
#else
    for (int k = 0; k < 8; k++) {
        p[k] = (unsigned char)(v >> (8 * k));
    }
#endif
}

/* finalize(plo, phi, a, b, n) -> (lo, hi) */
static inline void finalize(uint64_t plo, uint64_t phi, uint64_t a, uint64_t b,
                            uint64_t n, uint64_t *lo, uint64_t *hi) {
    uint64_t c = mix64(plo ^ rotl64(phi, 29) ^ (n * P3));
    *lo = mix64(a ^ c);
    *hi = mix64(b + c + phi + P4);
}

/*
 * The lane multipliers of the store's secret, split in 32-bit halves:
 * ra[i] = ah[i] * 2**32 + al[i] (ah < 2**29), rb likewise.  A (4, rows)
 * uint32 table from hybridstore.index.keys.HashKey.
 */
struct lanes {
    const uint32_t *al, *ah, *bl, *bh;
};

/*
 * (s0 + (s1 + s2) * 2**32 + s3 * 2**64) mod p for p = 2**61 - 1, from the four
 * partial sums of 32-bit parts (each < 2**49): 2**61 = 1 and 2**64 = 8 (mod p).
 * Same as keys._reduce_sums.
 */
static inline uint64_t reduce_sums(uint64_t s0, uint64_t s1, uint64_t s2, uint64_t s3) {
    uint64_t q = s1 + s2;
    uint64_t v = s0 + ((q & M29) << 32) + (q >> 29) + (s3 << 3);
    v = (v & PRIME) + (v >> 61);
    return v >= PRIME ? v - PRIME : v;
}

/*
 * One block's multilinear sums a = sum t[i] * ra[i], b = sum t[i] * rb[i]
 * (mod p).  Each product is taken from 32-bit halves (t * al < 2**64,
 * t * ah < 2**61) and its 32-bit parts go to four plain uint64 sums, which
 * cannot overflow for n <= 65536: no 128-bit arithmetic, and a loop the
 * compiler vectorizes (vpmuludq) on every SIMD target.
 */
static inline void block_sums(const uint32_t *t, size_t n, const struct lanes *L,
                              uint64_t *pa, uint64_t *pb) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    uint64_t b0 = 0, b1 = 0, b2 = 0, b3 = 0;
    const uint32_t *al = L->al, *ah = L->ah, *bl = L->bl, *bh = L->bh;
    for (size_t i = 0; i < n; i++) {
        uint64_t x = t[i];
        uint64_t u = x * al[i], v = x * ah[i];
        a0 += u & M32;
        a1 += u >> 32;
        a2 += v & M32;
        a3 += v >> 32;
        u = x * bl[i];
        v = x * bh[i];
        b0 += u & M32;
        b1 += u >> 32;
        b2 += v & M32;
        b3 += v >> 32;
    }
    *pa = reduce_sums(a0, a1, a2, a3);
    *pb = reduce_sums(b0, b1, b2, b3);
}

/* ------------------------------------------------------------------------ */
/* kernels (plain C; compiled once per instruction-set target below)        */

/* Chained keys of ceil(n / bs) blocks; 16 bytes of output per block. */
#define DEFINE_CHAIN_KERNEL(NAME, ATTR)                                         \
    static ATTR void NAME(const uint32_t *t, size_t n, size_t bs, uint64_t lo,  \
                          uint64_t hi, const struct lanes *L,                   \
                          unsigned char *out) {                                 \
        size_t k = 0;                                                           \
        for (size_t start = 0; start < n; start += bs, k++) {                   \
            size_t len = (n - start < bs) ? n - start : bs;                     \
            uint64_t a, b;                                                      \
            block_sums(t + start, len, L, &a, &b);                              \
            finalize(lo, hi, a, b, (uint64_t)len, &lo, &hi);                    \
            store_le64(out + 16 * k, lo);                                       \
            store_le64(out + 16 * k + 8, hi);                                   \
        }                                                                       \
    }

/*
 * Key of every prefix of one block.  Works in chunks: the running partial
 * sums (serial, a few adds per token) reduced at every offset, then the
 * per-offset finalize (vectorizable: c only depends on the offset).
 */
#define PREFIX_CHUNK 256
#define DEFINE_PREFIX_KERNEL(NAME, ATTR)                                        \
    static ATTR void NAME(const uint32_t *t, size_t n, uint64_t plo,            \
                          uint64_t phi, const struct lanes *L,                  \
                          unsigned char *out) {                                 \
        uint64_t ta[PREFIX_CHUNK], tb[PREFIX_CHUNK];                            \
        const uint64_t pbase = plo ^ rotl64(phi, 29);                           \
        const uint64_t hbase = phi + P4;                                        \
        uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;                                \
        uint64_t b0 = 0, b1 = 0, b2 = 0, b3 = 0;                                \
        for (size_t i0 = 0; i0 < n; i0 += PREFIX_CHUNK) {                       \
            size_t m = (n - i0 < PREFIX_CHUNK) ? n - i0 : PREFIX_CHUNK;         \
            for (size_t i = 0; i < m; i++) {                                    \
                size_t j = i0 + i;                                              \
                uint64_t x = t[j];                                              \
                uint64_t u = x * L->al[j], v = x * L->ah[j];                    \
                a0 += u & M32;                                                  \
                a1 += u >> 32;                                                  \
                a2 += v & M32;                                                  \
                a3 += v >> 32;                                                  \
                u = x * L->bl[j];                                               \
                v = x * L->bh[j];                                               \
                b0 += u & M32;                                                  \
                b1 += u >> 32;                                                  \
                b2 += v & M32;                                                  \
                b3 += v >> 32;                                                  \
                ta[i] = reduce_sums(a0, a1, a2, a3);                            \
                tb[i] = reduce_sums(b0, b1, b2, b3);                            \
            }                                                                   \
            unsigned char *o = out + 16 * i0;                                   \
            for (size_t i = 0; i < m; i++) {                                    \
                uint64_t c = mix64(pbase ^ ((uint64_t)(i0 + i + 1) * P3));      \
                store_le64(o + 16 * i, mix64(ta[i] ^ c));                       \
                store_le64(o + 16 * i + 8, mix64(tb[i] + c + hbase));           \
            }                                                                   \
        }                                                                       \
    }

DEFINE_CHAIN_KERNEL(chain_kernel_scalar, )
DEFINE_PREFIX_KERNEL(prefix_kernel_scalar, )

typedef void (*chain_kernel_fn)(const uint32_t *, size_t, size_t, uint64_t, uint64_t,
                                const struct lanes *, unsigned char *);
typedef void (*prefix_kernel_fn)(const uint32_t *, size_t, uint64_t, uint64_t,
                                 const struct lanes *, unsigned char *);

static chain_kernel_fn chain_kernel = chain_kernel_scalar;
static prefix_kernel_fn prefix_kernel = prefix_kernel_scalar;
static const char *kernel_name = "scalar";

/*
 * x86-64 with GCC or clang: also compile the kernels for AVX2 and AVX-512
 * and pick one at import time from what the CPU (and OS) support.  The
 * baseline build flags stay portable; only these functions use the wider
 * instructions, and only on CPUs that have them.
 */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HS_X86_DISPATCH 1
#define HS_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))
#define HS_AVX2 __attribute__((target("avx2")))
DEFINE_CHAIN_KERNEL(chain_kernel_avx512, HS_AVX512)
DEFINE_PREFIX_KERNEL(prefix_kernel_avx512, HS_AVX512)
DEFINE_CHAIN_KERNEL(chain_kernel_avx2, HS_AVX2)
DEFINE_PREFIX_KERNEL(prefix_kernel_avx2, HS_AVX2)
#endif

struct kernel_set {
    const char *name;
    chain_kernel_fn chain;
    prefix_kernel_fn prefix;
    int (*supported)(void);
};

static int always_supported(void) { return 1; }

#ifdef HS_X86_DISPATCH
static int avx512_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
}

static int avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
#endif

/* Widest first. */
static const struct kernel_set kernel_sets[] = {
#ifdef HS_X86_DISPATCH
    {"avx512", chain_kernel_avx512, prefix_kernel_avx512, avx512_supported},
    {"avx2", chain_kernel_avx2, prefix_kernel_avx2, avx2_supported},
#endif
    {"scalar", chain_kernel_scalar, prefix_kernel_scalar, always_supported},
};
#define N_KERNEL_SETS (sizeof(kernel_sets) / sizeof(kernel_sets[0]))

static void use_kernel_set(const struct kernel_set *ks) {
    chain_kernel = ks->chain;
    prefix_kernel = ks->prefix;
    kernel_name = ks->name;
}

static void select_kernels(void) {
    for (size_t i = 0; i < N_KERNEL_SETS; i++) {
        if (kernel_sets[i].supported()) {
            use_kernel_set(&kernel_sets[i]);
            return;
        }
    }
}

/* ------------------------------------------------------------------------ */
/* buffer helpers                                                            */

/* is_native_int_format, get_int_buffer: hybridstore/buffers.h */

static PyObject *new_key_bytes(size_t nkeys, unsigned char **out) {
    if (nkeys > (size_t)PY_SSIZE_T_MAX / 16) {
        return PyErr_NoMemory();
    }
    PyObject *res = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(nkeys * 16));
    if (res != NULL) {
        *out = (unsigned char *)PyByteArray_AS_STRING(res);
    }
    return res;
}

/*
 * The lane table: a C-contiguous (4, rows) buffer of 4-byte integers with
 * rows >= need.  0 on success (release *view afterwards).
 */
static int get_lanes(PyObject *obj, Py_buffer *view, size_t need, struct lanes *L) {
    if (get_int_buffer(obj, view, 4, "table") < 0) {
        return -1;
    }
    size_t rows = (size_t)(view->len / 16);
    if ((size_t)view->len != rows * 16 || rows < need) {
        PyErr_Format(PyExc_ValueError,
                     "table must hold 4 rows of at least %zu multipliers, got %zd bytes; "
                     "pass HashKey.table of a key with positions >= the block size",
                     need, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    const uint32_t *base = (const uint32_t *)view->buf;
    L->al = base;
    L->ah = base + rows;
    L->bl = base + 2 * rows;
    L->bh = base + 3 * rows;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* chain_tokens(tokens_u32, block_size, plo, phi, table) -> bytearray      */

PyDoc_STRVAR(chain_tokens_doc,
"chain_tokens(tokens, block_size, plo, phi, table) -> bytearray\n\n"
"Chained block keys of a uint32 token buffer: one (lo, hi) little-endian\n"
"uint64 pair per block of block_size tokens (the last block may be partial).\n"
"Block 0's parent is (plo, phi); block k's parent is block k-1's key.\n"
"table: the (4, rows) uint32 lane multipliers (HashKey.table), rows >= block_size.");

static PyObject *chain_tokens(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj, *tobj;
    Py_ssize_t block_size;
    unsigned long long plo, phi;
    if (!PyArg_ParseTuple(args, "OnKKO:chain_tokens", &obj, &block_size, &plo, &phi, &tobj)) {
        return NULL;
    }
    if (block_size < 1 || block_size > 65536) {
        PyErr_Format(PyExc_ValueError, "block_size must be in [1, 65536], got %zd", block_size);
        return NULL;
    }
    Py_buffer view, tview;
    struct lanes L;
    if (get_lanes(tobj, &tview, (size_t)block_size, &L) < 0) {
        return NULL;
    }
    if (get_int_buffer(obj, &view, 4, "tokens") < 0) {
        PyBuffer_Release(&tview);
        return NULL;
    }
    size_t n = (size_t)(view.len / 4);
    size_t bs = (size_t)block_size;
    size_t nblocks = n / bs + (n % bs != 0);
    unsigned char *out = NULL;
    PyObject *res = new_key_bytes(nblocks, &out);
    if (res != NULL) {
        const uint32_t *t = (const uint32_t *)view.buf;
        Py_BEGIN_ALLOW_THREADS
        chain_kernel(t, n, bs, (uint64_t)plo, (uint64_t)phi, &L, out);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    PyBuffer_Release(&tview);
    return res;
}

/* ------------------------------------------------------------------------ */
/* prefix_keys(tokens_u32, plo, phi, table) -> bytearray                   */

PyDoc_STRVAR(prefix_keys_doc,
"prefix_keys(tokens, plo, phi, table) -> bytearray\n\n"
"Key of every prefix tokens[:j+1] of ONE block under parent (plo, phi):\n"
"one (lo, hi) little-endian uint64 pair per token.  table: the (4, rows)\n"
"uint32 lane multipliers, rows >= len(tokens).");

static PyObject *prefix_keys(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj, *tobj;
    unsigned long long plo, phi;
    if (!PyArg_ParseTuple(args, "OKKO:prefix_keys", &obj, &plo, &phi, &tobj)) {
        return NULL;
    }
    Py_buffer view, tview;
    if (get_int_buffer(obj, &view, 4, "tokens") < 0) {
        return NULL;
    }
    size_t n = (size_t)(view.len / 4);
    struct lanes L;
    if (n > 65536) {
        PyErr_Format(PyExc_ValueError, "one block has at most 65536 tokens, got %zu", n);
        PyBuffer_Release(&view);
        return NULL;
    }
    if (get_lanes(tobj, &tview, n, &L) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned char *out = NULL;
    PyObject *res = new_key_bytes(n, &out);
    if (res != NULL) {
        const uint32_t *t = (const uint32_t *)view.buf;
        Py_BEGIN_ALLOW_THREADS
        prefix_kernel(t, n, (uint64_t)plo, (uint64_t)phi, &L, out);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    PyBuffer_Release(&tview);
    return res;
}

/* ------------------------------------------------------------------------ */
/* chain_ids(ids_u64, block_size, last_tokens, plo, phi, table) -> bytearray */

PyDoc_STRVAR(chain_ids_doc,
"chain_ids(ids, block_size, last_tokens, plo, phi, table) -> bytearray\n\n"
"Chained id_hash over a uint64 buffer of block ids (each hashed as the block\n"
"of its two 32-bit halves).  Every block counts block_size tokens except the\n"
"last, which counts last_tokens (pass -1 for block_size).  One (lo, hi)\n"
"little-endian uint64 pair per id.  table: the lane multipliers, rows >= 2.");

static PyObject *chain_ids(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj, *tobj;
    Py_ssize_t block_size, last_tokens;
    unsigned long long plo, phi;
    if (!PyArg_ParseTuple(args, "OnnKKO:chain_ids", &obj, &block_size, &last_tokens,
                          &plo, &phi, &tobj)) {
        return NULL;
    }
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", block_size);
        return NULL;
    }
    if (last_tokens < 0) {
        last_tokens = block_size;
    }
    Py_buffer view, tview;
    struct lanes L;
    if (get_lanes(tobj, &tview, 2, &L) < 0) {
        return NULL;
    }
    if (get_int_buffer(obj, &view, 8, "ids") < 0) {
        PyBuffer_Release(&tview);
        return NULL;
    }
    size_t n = (size_t)(view.len / 8);
    unsigned char *out = NULL;
    PyObject *res = new_key_bytes(n, &out);
    if (res != NULL) {
        const uint64_t *ids = (const uint64_t *)view.buf;
        Py_BEGIN_ALLOW_THREADS
        uint64_t lo = (uint64_t)plo, hi = (uint64_t)phi;
        const uint64_t nfull = (uint64_t)block_size + ID_NTOK_TAG;
        const uint64_t nlast = (uint64_t)last_tokens + ID_NTOK_TAG;
        for (size_t k = 0; k < n; k++) {
            uint32_t halves[2] = {(uint32_t)(ids[k] & M32), (uint32_t)(ids[k] >> 32)};
            uint64_t a, b;
            block_sums(halves, 2, &L, &a, &b);
            finalize(lo, hi, a, b, (k + 1 == n) ? nlast : nfull, &lo, &hi);
            store_le64(out + 16 * k, lo);
            store_le64(out + 16 * k + 8, hi);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    PyBuffer_Release(&tview);
    return res;
}

/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(available_kernels_doc,
"available_kernels() -> tuple[str, ...]\n\n"
"Token-kernel variants this CPU can run, widest first (e.g. 'avx512',\n"
"'avx2', 'scalar').  All give identical keys.");

static PyObject *available_kernels(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    PyObject *names = PyList_New(0);
    if (names == NULL) {
        return NULL;
    }
    for (size_t i = 0; i < N_KERNEL_SETS; i++) {
        if (!kernel_sets[i].supported()) {
            continue;
        }
        PyObject *name = PyUnicode_FromString(kernel_sets[i].name);
        if (name == NULL || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(names);
            return NULL;
        }
        Py_DECREF(name);
    }
    PyObject *res = PyList_AsTuple(names);
    Py_DECREF(names);
    return res;
}

PyDoc_STRVAR(get_kernel_doc,
"get_kernel() -> str\n\nName of the token-kernel variant in use.");

static PyObject *get_kernel(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(kernel_name);
}

PyDoc_STRVAR(set_kernel_doc,
"set_kernel(name) -> str\n\n"
"Use the token-kernel variant `name` (one of available_kernels()) from now\n"
"on, process-wide; returns the previous name.  For tests and benchmarks.");

static PyObject *set_kernel(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s:set_kernel", &name)) {
        return NULL;
    }
    for (size_t i = 0; i < N_KERNEL_SETS; i++) {
        if (strcmp(kernel_sets[i].name, name) == 0) {
            if (!kernel_sets[i].supported()) {
                PyErr_Format(PyExc_ValueError,
                             "kernel %s is not supported by this CPU; pick one of "
                             "available_kernels()", name);
                return NULL;
            }
            PyObject *prev = PyUnicode_FromString(kernel_name);
            if (prev != NULL) {
                use_kernel_set(&kernel_sets[i]);
            }
            return prev;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown kernel %s; pick one of available_kernels()",
                 name);
    return NULL;
}

static PyMethodDef hashing_methods[] = {
    {"chain_tokens", chain_tokens, METH_VARARGS, chain_tokens_doc},
    {"prefix_keys", prefix_keys, METH_VARARGS, prefix_keys_doc},
    {"chain_ids", chain_ids, METH_VARARGS, chain_ids_doc},
    {"available_kernels", available_kernels, METH_NOARGS, available_kernels_doc},
    {"get_kernel", get_kernel, METH_NOARGS, get_kernel_doc},
    {"set_kernel", set_kernel, METH_VARARGS, set_kernel_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hashing_module = {
    PyModuleDef_HEAD_INIT,
    "hybridstore._cext.hashing",
    "C twin of hybridstore.index.keys: chained 128-bit prefix keys.\n\n"
    "Use hybridstore.index.keys; it validates input and falls back to an\n"
    "identical numpy implementation when this module is not built.",
    -1,
    hashing_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit_hashing(void) {
    PyObject *m = PyModule_Create(&hashing_module);
    if (m == NULL) {
        return NULL;
    }
    select_kernels();
    if (PyModule_AddIntConstant(m, "ABI_VERSION", 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
