/* Buffer helpers shared by hybridstore's C extensions (hashing, trie, gather, u64map).
 *
 * Header-only: each extension is its own shared object, so the helpers are
 * static functions compiled into each of them.  Include after Python.h.
 */
#ifndef HYBRIDSTORE_BUFFERS_H
#define HYBRIDSTORE_BUFFERS_H

#include <string.h>

/*
 * 'i' when fmt names a native-order signed integer type, 'u' for unsigned,
 * 0 otherwise (the integer formats the other extensions accept, by kind).
 */
static inline char native_int_kind(const char *fmt) {
    if (fmt == NULL) {
        return 'u'; /* no format given: unsigned bytes */
    }
    if (*fmt == '@' || *fmt == '=') {
        fmt++;
    } else if (*fmt == '<' || *fmt == '>' || *fmt == '!') {
#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && \
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        if (*fmt != '<') {
            return 0;
        }
#else
        if (*fmt == '<') {
            return 0;
        }
#endif
        fmt++;
    }
    if (fmt[0] == '\0' || fmt[1] != '\0') {
        return 0;
    }
    if (strchr("bhilqn", fmt[0]) != NULL) {
        return 'i';
    }
    if (strchr("BHILQN", fmt[0]) != NULL) {
        return 'u';
    }
    return 0;
}

/* 1 when fmt names a native-order integer type of any size, else 0. */
static inline int is_native_int_format(const char *fmt) {
    return native_int_kind(fmt) != 0;
}

/* Get a C-contiguous buffer of integer items of itemsize bytes, with extra
 * PyBUF_* flags (PyBUF_WRITABLE for outputs). 0 on success. */
static inline int get_int_buffer_flags(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize,
                                const char *what, int extra) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | extra) < 0) {
        return -1;
    }
    if (view->itemsize != itemsize || !is_native_int_format(view->format) ||
        view->len % itemsize != 0) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a C-contiguous buffer of native-order %zd-byte "
                     "integers (got format %s, itemsize %zd); convert it with "
                     "hybridstore.index.keys.as_token_array or "
                     "np.ascontiguousarray(x, dtype=np.uint%d)",
                     what, itemsize, view->format ? view->format : "B",
                     view->itemsize, (int)(itemsize * 8));
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A read-only C-contiguous buffer of integer items of itemsize bytes. */
static inline int get_int_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize,
                          const char *what) {
    return get_int_buffer_flags(obj, view, itemsize, what, 0);
}

#endif /* HYBRIDSTORE_BUFFERS_H */
