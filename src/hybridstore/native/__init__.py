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

``_u64map`` (``_u64map.c``)
    ``U64Map``, a compact open-addressing hash map from uint64 keys to int32
    values (12 bytes a slot) with batch lookups over numpy arrays; the index
    maps block keys to node ids with it.  Its twin, ``PyU64Map``, and the API
    documentation live in :mod:`hybridstore.index.u64map`, which exports the
    native type as ``U64Map`` when it is built (``u64map.NATIVE``).

``_keytable`` (``_keytable.c``)
    ``KeyTable``, an open-addressing table from fixed-width byte keys (the
    17-byte object keys) to ``(nbytes, charged, meta)``, for the accounting
    tier.  Its batch methods take a whole buffer of packed keys (a uint8
    array of shape ``(n, width)``): ``put_many`` records them against a
    budget and undoes the batch exactly when it does not fit,
    ``delete_many`` removes them and sums what they were charged.  Its twin,
    ``PyKeyTable``, and the API documentation live in
    :mod:`hybridstore.backends.keytable`, which exports the native type as
    ``KeyTable`` when it is built (``keytable.NATIVE``).

``_trie`` (``_trie.c``)
    The index's walks up parent links: ``collect`` (remove empty childless
    pages bottom-up after evictions and releases) and ``path`` (a node's
    ancestors), over the index's columns in place.  Their twins are
    ``HybridIndex._collect_py`` / ``_path_py`` in :mod:`hybridstore.index.trie`
    (the property tests run the index with both).

``_gather`` (``_gather.c``)
    ``gather``: one entry of many objects copied into the rows of a
    page-major buffer (``store.load`` into a batch), without the GIL;
    ``scatter``: the reverse (``store.put_kv_batch``).  Their twins and API:
    :func:`hybridstore.backends.gather.gather_rows` / ``scatter_rows``.

``_buffers.h``
    The integer-buffer checks the other extensions share (``_keytable``
    reads its keys as raw bytes and does not include it).

``_tables.h``
    What the two hash tables and the hashing share: ``mix64`` (splitmix64's
    finalizer, part of the prefix-key specification), the 0.7 load factor
    and the power-of-two capacity for a number of entries.

Building: ``python setup.py build_ext --inplace`` (or any pip install of the
package) compiles them with a C11 compiler; when none is available the build
prints a notice and the twins are used.  ``hybridstore.index.keys.BACKEND``
says which hashing implementation is active and ``keys.force_python()``
selects the twin for tests and benchmarks.
"""
