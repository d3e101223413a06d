/* hybridstore._cext.trie: compiled hot paths of hybridstore.index.trie.
 *
 * The index keeps its page nodes as columns (numpy arrays, and an
 * array('i') of parent links).  This module walks those columns in C where
 * Python would visit one node per interpreter round trip:
 *
 *   collect(starts, parent, tiers, deps, pins, nchild, block) -> bytearray
 *       From each start node, remove nodes that hold no bytes (tiers == 0),
 *       that no retained checkpoint needs (deps == 0), that no live plan pins
 *       (pins == 0) and that have no children (nchild == 0), climbing to the
 *       parent while the parent becomes such a node.  A removed node gets
 *       parent -1 and block -2, and its parent one child less.  Returns the
 *       removed ids as packed native int64 (the caller drops their keys from
 *       the key map and recycles the ids).  Node 0 is the root: never removed.
 *
 *   path(parent, nid) -> bytearray
 *       The ids from nid up to (excluding) the root, following parent links
 *       (stops at a node without a parent: one restored after a reopen), as
 *       packed native int64.
 *
 * HybridIndex._collect_py and HybridIndex._path_py are the Python twins
 * (the same loops), used when this extension is not built.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include "hybridstore/buffers.h"

PyDoc_STRVAR(collect_doc,
"collect(starts, parent, tiers, deps, pins, nchild, block) -> bytearray\n\n"
"Remove empty childless nodes from each start upwards; returns their ids\n"
"as packed int64.  starts: int64; parent, deps, pins, nchild, block: int32\n"
"(parent, nchild, block are written); tiers: uint8.");

static PyObject *collect(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[7];
    if (!PyArg_ParseTuple(args, "OOOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &objs[6])) {
        return NULL;
    }
    static const Py_ssize_t sizes[7] = {8, 4, 1, 4, 4, 4, 4};
    static const int writable[7] = {0, 1, 0, 0, 0, 1, 1};
    static const char *names[7] = {"starts", "parent", "tiers", "deps", "pins", "nchild",
                                   "block"};
    Py_buffer v[7];
    int got = 0;
    PyObject *res = NULL;
    for (; got < 7; got++) {
        if (get_int_buffer_flags(objs[got], &v[got], sizes[got], names[got],
                                 writable[got] ? PyBUF_WRITABLE : 0) < 0) {
            goto done;
        }
    }
    Py_ssize_t n = v[1].len / 4;
    for (int i = 2; i < 7; i++) {
        if (v[i].len / sizes[i] < n) {
            PyErr_Format(PyExc_ValueError, "%s holds fewer nodes than parent", names[i]);
            goto done;
        }
    }
    const int64_t *starts = (const int64_t *)v[0].buf;
    Py_ssize_t nstarts = v[0].len / 8;
    int32_t *parent = (int32_t *)v[1].buf;
    const uint8_t *tiers = (const uint8_t *)v[2].buf;
    const int32_t *deps = (const int32_t *)v[3].buf;
    const int32_t *pins = (const int32_t *)v[4].buf;
    int32_t *nchild = (int32_t *)v[5].buf;
    int32_t *block = (int32_t *)v[6].buf;

    Py_ssize_t cap = nstarts > 16 ? nstarts : 16, count = 0;
    int64_t *out = PyMem_Malloc((size_t)cap * sizeof(int64_t));
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nstarts; i++) {
        int64_t nid = starts[i];
        if (nid >= n) {
            PyErr_Format(PyExc_IndexError, "start node %lld is outside the index",
                         (long long)nid);
            PyMem_Free(out);
            goto done;
        }
        while (nid > 0 && tiers[nid] == 0 && deps[nid] == 0 && pins[nid] == 0 &&
               nchild[nid] == 0 && block[nid] != -2) {
            if (count == cap) {
                cap *= 2;
                int64_t *grown = PyMem_Realloc(out, (size_t)cap * sizeof(int64_t));
                if (grown == NULL) {
                    PyMem_Free(out);
                    PyErr_NoMemory();
                    goto done;
                }
                out = grown;
            }
            out[count++] = nid;
            int32_t up = parent[nid];
            parent[nid] = -1;
            block[nid] = -2;
            if (up < 0) {
                break;
            }
            if (up >= n) {
                PyErr_Format(PyExc_IndexError, "node %lld has parent %d outside the index",
                             (long long)nid, up);
                PyMem_Free(out);
                goto done;
            }
            nchild[up] -= 1;
            nid = up;
        }
    }
    res = PyByteArray_FromStringAndSize((const char *)out, (Py_ssize_t)(count * 8));
    PyMem_Free(out);
done:
    for (int i = 0; i < got; i++) {
        PyBuffer_Release(&v[i]);
    }
    return res;
}

PyDoc_STRVAR(path_doc,
"path(parent, nid) -> bytearray\n\n"
"Node ids from nid up to (excluding) the root 0, as packed int64.");

static PyObject *path(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    Py_ssize_t nid;
    if (!PyArg_ParseTuple(args, "On", &obj, &nid)) {
        return NULL;
    }
    Py_buffer v;
    if (get_int_buffer(obj, &v, 4, "parent") < 0) {
        return NULL;
    }
    const int32_t *parent = (const int32_t *)v.buf;
    Py_ssize_t n = v.len / 4, count = 0;
    for (Py_ssize_t cur = nid; cur > 0; cur = parent[cur]) {
        if (cur >= n || count > n) {   /* out of range, or a cycle: a corrupt index */
            PyBuffer_Release(&v);
            PyErr_Format(PyExc_IndexError, "the parent links from node %zd leave the index",
                         nid);
            return NULL;
        }
        count++;
    }
    PyObject *res = PyByteArray_FromStringAndSize(NULL, count * 8);
    if (res != NULL) {
        int64_t *out = (int64_t *)PyByteArray_AS_STRING(res);
        Py_ssize_t i = 0;
        for (Py_ssize_t cur = nid; cur > 0; cur = parent[cur]) {
            out[i++] = cur;
        }
    }
    PyBuffer_Release(&v);
    return res;
}

static PyMethodDef trie_methods[] = {
    {"collect", collect, METH_VARARGS, collect_doc},
    {"path", path, METH_VARARGS, path_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef trie_module = {
    PyModuleDef_HEAD_INIT,
    "hybridstore._cext.trie",
    "C hot paths of hybridstore.index.trie (see HybridIndex._collect_many).",
    -1,
    trie_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit_trie(void) { return PyModule_Create(&trie_module); }
