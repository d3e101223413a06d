"""Optional C accelerators for hybridstore.

Everything in this package has a pure-Python (numpy) twin that computes the
same results bit for bit; the C code only makes it faster.  Nothing here is
imported directly by users: the public modules pick the native version when
its extension is built and fall back to the twin otherwise.

``_hashing`` (``_hashing.c``)
    The chained 128-bit prefix keys.  Its twin and public API live in
    :mod:`hybridstore.index.keys`, whose module docstring specifies the hash.
    The extension takes any C-contiguous integer buffer of the right item
    size (uint32 token ids, uint64 block ids), releases the GIL while it
    hashes and returns a ``bytearray`` of packed little-endian ``(lo, hi)``
    uint64 pairs that ``keys.py`` wraps with ``np.frombuffer``.  It does not
    validate id ranges: go through :mod:`hybridstore.index.keys`.

Building: ``python setup.py build_ext --inplace`` (or any pip install of the
package) compiles it with a C11 compiler; when none is available the build
prints a notice and the twin is used.  ``hybridstore.index.keys.BACKEND``
says which implementation is active and ``keys.force_python()`` selects the
twin for tests and benchmarks.
"""
