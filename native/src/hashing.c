/*
 * hybridstore._cext.hashing -- the C twin of hybridstore.index.keys.
 *
 * Computes the 128-bit chained prefix keys of hybridstore.  The algorithm is
 * specified in hybridstore/index/keys.py; this file and the numpy twin there
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
 * All arithmetic is on uint64 with wraparound.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include "hybridstore/buffers.h"
#include "hybridstore/tables.h"

#define P1 UINT64_C(0x9E3779B185EBCA87)
#define P2 UINT64_C(0xC2B2AE3D27D4EB4F)
#define P3 UINT64_C(0x165667B19E3779F9)
#define P4 UINT64_C(0x85EBCA77C2B2AE63)
#define P5 UINT64_C(0x27D4EB2F165667C5)
#define ID_NTOK_TAG (UINT64_C(1) << 40)


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
 * Sums of the per-token terms of one block: a = sum mix64(x ^ P1),
 * b = sum mix64(x ^ P2) with x = t[i] + ((i + 1) << 32).
 *
 * Scalar form: unrolled by four with independent accumulators (the sums are
 * commutative), which keeps the eight multiply chains of one iteration in
 * flight together.  It runs at about one 64-bit multiply per cycle.
 */
static inline void block_sums_scalar(const uint32_t *t, size_t n, uint64_t *pa, uint64_t *pb) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    uint64_t b0 = 0, b1 = 0, b2 = 0, b3 = 0;
    size_t i = 0;
    const uint64_t step = UINT64_C(1) << 32;
    uint64_t pos = step; /* (i + 1) << 32 */
    for (; i + 4 <= n; i += 4) {
        uint64_t x0 = (uint64_t)t[i] + pos;
        uint64_t x1 = (uint64_t)t[i + 1] + pos + step;
        uint64_t x2 = (uint64_t)t[i + 2] + pos + 2 * step;
        uint64_t x3 = (uint64_t)t[i + 3] + pos + 3 * step;
        a0 += mix64(x0 ^ P1);
        b0 += mix64(x0 ^ P2);
        a1 += mix64(x1 ^ P1);
        b1 += mix64(x1 ^ P2);
        a2 += mix64(x2 ^ P1);
        b2 += mix64(x2 ^ P2);
        a3 += mix64(x3 ^ P1);
        b3 += mix64(x3 ^ P2);
        pos += 4 * step;
    }
    for (; i < n; i++) {
        uint64_t x = (uint64_t)t[i] + pos;
        a0 += mix64(x ^ P1);
        b0 += mix64(x ^ P2);
        pos += step;
    }
    *pa = (a0 + a1) + (a2 + a3);
    *pb = (b0 + b1) + (b2 + b3);
}

/*
 * Vector form: a plain reduction loop that the compiler vectorizes when the
 * enclosing function is compiled for a SIMD target (8 lanes of vpmullq with
 * AVX-512DQ).  Same result as block_sums_scalar: wrapping sums commute.
 */
static inline void block_sums_vector(const uint32_t *t, size_t n, uint64_t *pa, uint64_t *pb) {
    uint64_t a = 0, b = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t x = (uint64_t)t[i] + ((uint64_t)(i + 1) << 32);
        a += mix64(x ^ P1);
        b += mix64(x ^ P2);
    }
    *pa = a;
    *pb = b;
}

/* ------------------------------------------------------------------------ */
/* kernels (plain C; compiled once per instruction-set target below)        */

/* Chained keys of ceil(n / bs) blocks; 16 bytes of output per block. */
#define DEFINE_CHAIN_KERNEL(NAME, ATTR, SUMS)                                   \
    static ATTR void NAME(const uint32_t *t, size_t n, size_t bs, uint64_t lo,  \
                          uint64_t hi, unsigned char *out) {                    \
        size_t k = 0;                                                           \
        for (size_t start = 0; start < n; start += bs, k++) {                   \
            size_t len = (n - start < bs) ? n - start : bs;                     \
            uint64_t a, b;                                                      \
            SUMS(t + start, len, &a, &b);                                       \
            finalize(lo, hi, a, b, (uint64_t)len, &lo, &hi);                    \
            store_le64(out + 16 * k, lo);                                       \
            store_le64(out + 16 * k + 8, hi);                                   \
        }                                                                       \
    }

/*
 * Key of every prefix of one block.  Works in chunks: per-token terms
 * (vectorizable), a running sum (serial but one add per term), then the
 * per-offset finalize (vectorizable: c only depends on the offset).
 */
#define PREFIX_CHUNK 256
#define DEFINE_PREFIX_KERNEL(NAME, ATTR)                                        \
    static ATTR void NAME(const uint32_t *t, size_t n, uint64_t plo,            \
                          uint64_t phi, unsigned char *out) {                   \
        uint64_t ta[PREFIX_CHUNK], tb[PREFIX_CHUNK];                            \
        const uint64_t pbase = plo ^ rotl64(phi, 29);                           \
        const uint64_t hbase = phi + P4;                                        \
        uint64_t a = 0, b = 0;                                                  \
        for (size_t i0 = 0; i0 < n; i0 += PREFIX_CHUNK) {                       \
            size_t m = (n - i0 < PREFIX_CHUNK) ? n - i0 : PREFIX_CHUNK;         \
            for (size_t i = 0; i < m; i++) {                                    \
                uint64_t x = (uint64_t)t[i0 + i] + ((uint64_t)(i0 + i + 1) << 32); \
                ta[i] = mix64(x ^ P1);                                          \
                tb[i] = mix64(x ^ P2);                                          \
            }                                                                   \
            for (size_t i = 0; i < m; i++) {                                    \
                a += ta[i];                                                     \
                ta[i] = a;                                                      \
                b += tb[i];                                                     \
                tb[i] = b;                                                      \
            }                                                                   \
            unsigned char *o = out + 16 * i0;                                   \
            for (size_t i = 0; i < m; i++) {                                    \
                uint64_t c = mix64(pbase ^ ((uint64_t)(i0 + i + 1) * P3));      \
                store_le64(o + 16 * i, mix64(ta[i] ^ c));                       \
                store_le64(o + 16 * i + 8, mix64(tb[i] + c + hbase));           \
            }                                                                   \
        }                                                                       \
    }

DEFINE_CHAIN_KERNEL(chain_kernel_scalar, , block_sums_scalar)
DEFINE_PREFIX_KERNEL(prefix_kernel_scalar, )

typedef void (*chain_kernel_fn)(const uint32_t *, size_t, size_t, uint64_t, uint64_t,
                                unsigned char *);
typedef void (*prefix_kernel_fn)(const uint32_t *, size_t, uint64_t, uint64_t,
                                 unsigned char *);

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
DEFINE_CHAIN_KERNEL(chain_kernel_avx512, HS_AVX512, block_sums_vector)
DEFINE_PREFIX_KERNEL(prefix_kernel_avx512, HS_AVX512)
DEFINE_CHAIN_KERNEL(chain_kernel_avx2, HS_AVX2, block_sums_vector)
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

/* ------------------------------------------------------------------------ */
/* chain_tokens(tokens_u32, block_size, plo, phi) -> bytearray             */

PyDoc_STRVAR(chain_tokens_doc,
"chain_tokens(tokens, block_size, plo, phi) -> bytearray\n\n"
"Chained block keys of a uint32 token buffer: one (lo, hi) little-endian\n"
"uint64 pair per block of block_size tokens (the last block may be partial).\n"
"Block 0's parent is (plo, phi); block k's parent is block k-1's key.");

static PyObject *chain_tokens(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    Py_ssize_t block_size;
    unsigned long long plo, phi;
    if (!PyArg_ParseTuple(args, "OnKK:chain_tokens", &obj, &block_size, &plo, &phi)) {
        return NULL;
    }
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", block_size);
        return NULL;
    }
    Py_buffer view;
    if (get_int_buffer(obj, &view, 4, "tokens") < 0) {
        return NULL;
    }
    size_t n = (size_t)(view.len / 4);
    size_t bs = (size_t)block_size;
    size_t nblocks = n / bs + (n % bs != 0);
    unsigned char *out = NULL;
    PyObject *res = new_key_bytes(nblocks, &out);
    if (res == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint32_t *t = (const uint32_t *)view.buf;
    Py_BEGIN_ALLOW_THREADS
    chain_kernel(t, n, bs, (uint64_t)plo, (uint64_t)phi, out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return res;
}

/* ------------------------------------------------------------------------ */
/* prefix_keys(tokens_u32, plo, phi) -> bytearray                          */

PyDoc_STRVAR(prefix_keys_doc,
"prefix_keys(tokens, plo, phi) -> bytearray\n\n"
"Key of every prefix tokens[:j+1] of ONE block under parent (plo, phi):\n"
"one (lo, hi) little-endian uint64 pair per token.");

static PyObject *prefix_keys(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    unsigned long long plo, phi;
    if (!PyArg_ParseTuple(args, "OKK:prefix_keys", &obj, &plo, &phi)) {
        return NULL;
    }
    Py_buffer view;
    if (get_int_buffer(obj, &view, 4, "tokens") < 0) {
        return NULL;
    }
    size_t n = (size_t)(view.len / 4);
    unsigned char *out = NULL;
    PyObject *res = new_key_bytes(n, &out);
    if (res == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint32_t *t = (const uint32_t *)view.buf;
    Py_BEGIN_ALLOW_THREADS
    prefix_kernel(t, n, (uint64_t)plo, (uint64_t)phi, out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return res;
}

/* ------------------------------------------------------------------------ */
/* chain_ids(ids_u64, block_size, last_tokens, plo, phi) -> bytearray      */

PyDoc_STRVAR(chain_ids_doc,
"chain_ids(ids, block_size, last_tokens, plo, phi) -> bytearray\n\n"
"Chained id_hash over a uint64 buffer of block ids.  Every block counts\n"
"block_size tokens except the last, which counts last_tokens (pass -1 for\n"
"block_size).  One (lo, hi) little-endian uint64 pair per id.");

static PyObject *chain_ids(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    Py_ssize_t block_size, last_tokens;
    unsigned long long plo, phi;
    if (!PyArg_ParseTuple(args, "OnnKK:chain_ids", &obj, &block_size, &last_tokens,
                          &plo, &phi)) {
        return NULL;
    }
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", block_size);
        return NULL;
    }
    if (last_tokens < 0) {
        last_tokens = block_size;
    }
    Py_buffer view;
    if (get_int_buffer(obj, &view, 8, "ids") < 0) {
        return NULL;
    }
    size_t n = (size_t)(view.len / 8);
    unsigned char *out = NULL;
    PyObject *res = new_key_bytes(n, &out);
    if (res == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint64_t *ids = (const uint64_t *)view.buf;
    Py_BEGIN_ALLOW_THREADS
    uint64_t lo = (uint64_t)plo, hi = (uint64_t)phi;
    const uint64_t nfull = (uint64_t)block_size + ID_NTOK_TAG;
    const uint64_t nlast = (uint64_t)last_tokens + ID_NTOK_TAG;
    for (size_t k = 0; k < n; k++) {
        uint64_t id = ids[k];
        uint64_t a = mix64(id ^ P1);
        uint64_t b = mix64(id ^ P5);
        finalize(lo, hi, a, b, (k + 1 == n) ? nlast : nfull, &lo, &hi);
        store_le64(out + 16 * k, lo);
        store_le64(out + 16 * k + 8, hi);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
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
    if (PyModule_AddIntConstant(m, "ABI_VERSION", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
