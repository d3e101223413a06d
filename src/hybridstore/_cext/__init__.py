"""The compiled extensions, built by setup.py from the C sources in ``native/``.

Nothing but the five shared objects lives here (``hashing``, ``u64map``,
``keytable``, ``trie``, ``gather``); they are imported in exactly one place,
:mod:`hybridstore._native`, which picks each one or its pure-Python twin.
Do not import them directly.  The sources and their design notes:
``native/README.md`` in the repository.
"""
