/* hybridstore._cext.gather: one call copies an entry of many objects to or from rows.
 *
 *   gather(sources, which, offsets, rows, entry_offset, nbytes, dst, dst_stride)
 *       For every i: copy nbytes from sources[which[i]] at offsets[i] +
 *       entry_offset to dst at rows[i] * dst_stride.  sources: a sequence of
 *       byte buffers (the host pool's arenas, a load's own read buffer);
 *       which, offsets, rows: int64 arrays of one length; dst: a writable
 *       C-contiguous buffer.
 *   scatter(dests, which, offsets, rows, entry_offset, nbytes, src, src_stride)
 *       The reverse: src at rows[i] * src_stride to dests[which[i]] at
 *       offsets[i] + entry_offset (dests writable).
 *
 * Bounds are checked before anything is copied; the copies run without the
 * GIL.  store.load gathers one tensor entry of every page of a plan into a
 * page-major staging buffer with one call, and store.put_kv_batch scatters
 * the rows of a page-major batch into the pool slots of a run of new pages,
 * instead of a Python copy per page.  hybridstore.backends.gather holds the
 * numpy twins (gather_rows, scatter_rows).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include "hybridstore/buffers.h"

PyDoc_STRVAR(gather_doc,
"gather(sources, which, offsets, rows, entry_offset, nbytes, dst, dst_stride) -> None\n\n"
"dst[rows[i] * dst_stride : + nbytes] = sources[which[i]][offsets[i] + entry_offset : + nbytes]\n"
"for every i; which, offsets, rows are int64 buffers of one length.");

PyDoc_STRVAR(scatter_doc,
"scatter(dests, which, offsets, rows, entry_offset, nbytes, src, src_stride) -> None\n\n"
"dests[which[i]][offsets[i] + entry_offset : + nbytes] = src[rows[i] * src_stride : + nbytes]\n"
"for every i; which, offsets, rows are int64 buffers of one length.");

/*
 * Both directions: sources_obj is the sequence of object buffers (the sources
 * of a gather, the destinations of a scatter), dst_obj the one row-major
 * buffer (the destination of a gather, the source of a scatter).
 */
static PyObject *copy_rows(PyObject *args, int scatter) {
    PyObject *sources_obj, *which_obj, *offsets_obj, *rows_obj, *dst_obj;
    Py_ssize_t entry_off, nbytes, stride;
    if (!PyArg_ParseTuple(args, scatter ? "OOOOnnOn:scatter" : "OOOOnnOn:gather", &sources_obj,
                          &which_obj, &offsets_obj, &rows_obj, &entry_off, &nbytes, &dst_obj,
                          &stride)) {
        return NULL;
    }
    if (entry_off < 0 || nbytes < 0 || stride < nbytes) {
        PyErr_Format(PyExc_ValueError,
                     "entry_offset and nbytes must be >= 0 and %s >= nbytes",
                     scatter ? "src_stride" : "dst_stride");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(sources_obj, scatter ? "dests must be a sequence of buffers"
                                                         : "sources must be a sequence of buffers");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t nsrc = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *src = PyMem_Calloc((size_t)(nsrc > 0 ? nsrc : 1), sizeof(Py_buffer));
    Py_buffer idx[3], dst;
    int got_src = 0, got_idx = 0, got_dst = 0;
    PyObject *res = NULL;
    if (src == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got_src < nsrc; got_src++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got_src), &src[got_src],
                               PyBUF_C_CONTIGUOUS | (scatter ? PyBUF_WRITABLE : 0)) < 0) {
            goto done;
        }
    }
    PyObject *idx_obj[3] = {which_obj, offsets_obj, rows_obj};
    static const char *idx_name[3] = {"which", "offsets", "rows"};
    for (; got_idx < 3; got_idx++) {
        if (get_int_buffer(idx_obj[got_idx], &idx[got_idx], 8, idx_name[got_idx]) < 0) {
            goto done;
        }
    }
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | (scatter ? 0 : PyBUF_WRITABLE)) < 0) {
        goto done;
    }
    got_dst = 1;
    Py_ssize_t n = idx[0].len / 8;
    if (idx[1].len / 8 != n || idx[2].len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "which, offsets and rows must have one length");
        goto done;
    }
    const int64_t *which = idx[0].buf, *offsets = idx[1].buf, *rows = idx[2].buf;
    for (Py_ssize_t i = 0; i < n; i++) {   /* every bound first: nothing copied on error */
        if (which[i] < 0 || which[i] >= nsrc) {
            PyErr_Format(PyExc_IndexError, "which[%zd] = %lld names no source", i,
                         (long long)which[i]);
            goto done;
        }
        /* subtraction forms: no signed overflow on hostile offsets */
        if (offsets[i] < 0 || src[which[i]].len < entry_off + nbytes ||
            offsets[i] > src[which[i]].len - entry_off - nbytes) {
            PyErr_Format(PyExc_IndexError, scatter ? "offsets[%zd] writes past its dest"
                                                   : "offsets[%zd] reads past its source", i);
            goto done;
        }
        if (rows[i] < 0 || dst.len < nbytes ||
            (stride > 0 && rows[i] > (dst.len - nbytes) / stride)) {
            PyErr_Format(PyExc_IndexError, scatter ? "rows[%zd] = %lld reads past src"
                                                   : "rows[%zd] = %lld writes past dst", i,
                         (long long)rows[i]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        char *row = (char *)dst.buf + rows[i] * stride;
        char *obj = (char *)src[which[i]].buf + offsets[i] + entry_off;
        if (scatter) {
            memcpy(obj, row, (size_t)nbytes);
        } else {
            memcpy(row, obj, (size_t)nbytes);
        }
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    if (got_dst) {
        PyBuffer_Release(&dst);
    }
    for (int i = 0; i < got_idx; i++) {
        PyBuffer_Release(&idx[i]);
    }
    for (int i = 0; i < got_src; i++) {
        PyBuffer_Release(&src[i]);
    }
    PyMem_Free(src);
    Py_DECREF(seq);
    return res;
}

static PyObject *gather(PyObject *self, PyObject *args) {
    (void)self;
    return copy_rows(args, 0);
}

static PyObject *scatter(PyObject *self, PyObject *args) {
    (void)self;
    return copy_rows(args, 1);
}

static PyMethodDef gather_methods[] = {
    {"gather", gather, METH_VARARGS, gather_doc},
    {"scatter", scatter, METH_VARARGS, scatter_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef gather_module = {
    PyModuleDef_HEAD_INIT,
    "hybridstore._cext.gather",
    "Batched row gather / scatter for store.load / put_kv_batch (see hybridstore.backends.gather).",
    -1,
    gather_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit_gather(void) { return PyModule_Create(&gather_module); }
