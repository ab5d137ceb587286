"""Test-process memo of ``gguf.GGUFReader`` for large model files (test speed only; product code untouched).

``gguf.GGUFReader(path)`` parses every metadata field of the file into numpy views: for the default model
(SmolLM2-135M Q4_1, 98 MB, 49,152 tokens and 48,900 merges) that is 2.8..5 s per call on this 2-core machine
(measured 2026-12-02), and one engine load opens the file several times (weights in
``actors/worker/engine/gguf_loader.py``, token bytes in ``detokenizer.py``, control tokens in ``structured.py``,
``quant.py`` for ``auto``, and transformers' ``load_gguf_checkpoint`` for the reference model). Inside the pytest
process the parsed reader of an unchanged file is shared: the product code still runs every step on a real
``GGUFReader`` of the same bytes (opened read-only, ``mode="r"``), only the repeated parse is skipped.

Key: ``(realpath, size, mtime_ns)``, so a file rewritten at the same path is parsed again. Only files of at least
``MIN_BYTES`` are kept (the tiny test models parse in milliseconds and many are written per session), at most
``MAX_ENTRIES`` (least recently used dropped; one reader of the default model holds ~160 MB).
Other modes than the default ``"r"`` are never shared. ``ACTORSERVE_TEST_GGUF_MEMO=0`` turns the memo off.
"""

from __future__ import annotations

import os
from collections import OrderedDict

MIN_BYTES = 16 * 2**20
MAX_ENTRIES = 2


def install() -> None:
    """Replace ``gguf.GGUFReader`` by a memoizing subclass (idempotent)."""
    import gguf

    if os.environ.get("ACTORSERVE_TEST_GGUF_MEMO", "1") == "0":  # measure without the memo
        return
    if getattr(gguf.GGUFReader, "_actorserve_test_memo", False):
        return
    real = gguf.GGUFReader
    cache: OrderedDict[tuple, object] = OrderedDict()

    class MemoGGUFReader(real):  # a subclass, so isinstance checks against gguf.GGUFReader still hold
        _actorserve_test_memo = True

        def __new__(cls, path, mode="r"):
            key = _key(path) if mode == "r" else None
            if key is not None and key in cache:
                cache.move_to_end(key)
                return cache[key]
            reader = super().__new__(cls)
            real.__init__(reader, path, mode)
            if key is not None:
                cache[key] = reader
                while len(cache) > MAX_ENTRIES:
                    cache.popitem(last=False)
            return reader

        def __init__(self, path, mode="r"):  # parsed once in __new__
            pass

    MemoGGUFReader.__name__ = MemoGGUFReader.__qualname__ = "GGUFReader"
    gguf.GGUFReader = MemoGGUFReader
    gguf.gguf_reader.GGUFReader = MemoGGUFReader


def _key(path) -> tuple | None:
    """``(realpath, size, mtime_ns)`` of a file worth sharing, else None."""
    try:
        st = os.stat(path)
    except (OSError, TypeError, ValueError):
        return None
    if st.st_size < MIN_BYTES:
        return None
    return os.path.realpath(path), st.st_size, st.st_mtime_ns
