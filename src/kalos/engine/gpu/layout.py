"""The GPU engine's word layouts, declared once: the staging header, the gather table, and
the slot server's control words.

Nothing else knows a word index. The host code reads and writes these words through the
names below; the kernels (:mod:`kalos.engine.gpu.kernels.common`) turn the same names into
``tl.constexpr`` offsets, and the loader checks the kernels' offsets against this module
(:func:`check_kernel_layout`) before the engine uses them. Every word is 8 bytes (int64 or
float64), so an offset is a field's byte offset divided by 8::

    staging area (page-locked host; its device copy is the same words)
    word 0              +------------------------------------------------------+
                        | header (HEADER_DTYPE, 16 words)                       |
                        |   n, nq, k, has_ns, ns, since, until, max_norm,       |
                        |   k_out, row_err8, own_filters, spare[5]              |
    word 16             +------------------------------------------------------+
    + 16 * j            | gather table row j (TABLE_DTYPE, 16 words)            |
                        |   query_at, ids_at, scores_at, scale,                 |
                        |   slot_word, seq, slot, since, until, ns, spare[6]    |
                        +------------------------------------------------------+
                        | queries float32[max_batch, dim] (the engine's own)    |
                        +------------------------------------------------------+

``k`` is ``min(k, n)`` (the rows a query can fill), ``k_out`` the columns written (past
``k`` they are padding). A table row's ``slot_word``, ``seq`` and ``slot`` are written only by
the slot server's waiting kernels, for the final kernel that publishes each answer in its
slot. The filter (namespace, created_at window ``[since, until)``) is the header's for every
query of the batch (the engine's own searches: one filter a batch), or each query's own in its
table row (``ns``, ``since``, ``until``: a slot server's round, whose clients each ask in
their own namespace and window) where the header's ``own_filters`` has the bit OWN_WINDOWS
(the windows) or OWN_NAMESPACES (the namespaces); the waiting kernels write those (and the
host, for a sweep's pass of agents: ``TorchEngine.search_places_start``), and the table's
words are read only then. A table row's ``ns`` is NS_ALL for all namespaces.
``row_err8`` is
the 8-bit rows' error per unit of query norm (:mod:`kalos.engine.gpu.bounds`), in the
header so that adds after a CUDA graph's capture are covered.

The slot server's control words: HOST_CONTROL_DTYPE (page-locked host, the sweep reads and
writes them) and DEVICE_CONTROL_DTYPE (device memory, the kernels' own).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

__all__ = [
    "HEADER_DTYPE", "TABLE_DTYPE", "HOST_CONTROL_DTYPE", "DEVICE_CONTROL_DTYPE", "NAME_ENTRY_DTYPE",
    "HEADER", "TABLE", "HOST_CONTROL", "DEVICE_CONTROL", "NAME_ENTRY", "HDR_WORDS", "TAB_WORDS", "HCTL_WORDS",
    "CTL_WORDS",
    "kernel_constants", "check_kernel_layout",
]

HEADER_DTYPE = np.dtype([
    ("n", "<i8"),  # rows in use
    ("nq", "<i8"),  # queries in this batch (0: the kernels after the stage-in do nothing)
    ("k", "<i8"),  # min(k, n)
    ("has_ns", "<i8"),  # 1: only rows of namespace ns
    ("ns", "<i8"),
    ("since", "<f8"),  # created_at window [since, until): -inf / inf when open
    ("until", "<f8"),
    ("max_norm", "<f8"),  # the largest row norm ever written (the 16-bit certificate)
    ("k_out", "<i8"),  # result columns to write
    ("row_err8", "<f8"),  # the 8-bit rows' error per unit of query norm
    ("own_filters", "<i8"),  # OWN_WINDOWS | OWN_NAMESPACES: each query's are its table row's
    ("spare", "<i8", (5,)),
])

TABLE_DTYPE = np.dtype([
    ("query_at", "<i8"),  # float32 element offset of the query in the source buffer
    ("ids_at", "<i8"),  # int64 element offset of its ids in the result buffer
    ("scores_at", "<i8"),  # float32 element offset of its scores
    ("scale", "<f8"),  # applied to the query (float64), or written by the stage-in (NORM)
    ("slot_word", "<i8"),  # slot server: the slot's word offset in the segment
    ("seq", "<i8"),  # slot server: the request's req_seq
    ("slot", "<i8"),  # slot server: the slot's index
    ("since", "<f8"),  # with the header's own_filters: this query's created_at window [since,
    ("until", "<f8"),  # until), -inf / inf when open,
    ("ns", "<i8"),  # and its namespace id (NS_ALL: all namespaces)
    ("spare", "<i8", (6,)),  # (a row is a power of two of words: the kernels load it as one tile)
])

HOST_CONTROL_DTYPE = np.dtype([
    ("stop", "<i8"),  # the host asks the waiting kernel to stop
    ("answers", "<i8"),  # requests the kernels answered, over all launches
    ("demand", "<i8"),  # the kernels: servable requests pending when the latest round took its own
    ("expect", "<i8"),  # the host: how many requests a batch round waits for (its window aside)
    ("stopped", "<i8"),  # 1 once a round found the server stopped
    ("t_wait", "<i8"),  # the GPU's clock (ns): the latest round began to wait,
    ("t_staged", "<i8"),  # staged a request,
    ("t_published", "<i8"),  # published its answer,
    ("t_seen", "<i8"),  # first saw a request
    ("k_wanted", "<i8"),  # the kernels: the largest k of a pending single recall past the smallest
    #                       k bucket (the host queues rounds of the bucket that serves it; 0: none)
])

DEVICE_CONTROL_DTYPE = np.dtype([
    ("stopped", "<i8"),  # every later round does nothing
    ("turn", "<i8"),  # the round-robin turn among the slots
    ("answers", "<i8"),
])

#: A name in the slot server's namespace lookup (``SlotGraphServer``'s NS_IDS buffer: the
#: NSMAX rows' ids, then the entry of the name the kernels found last, then one entry a slot
#: for the name it named last; a ``length`` of -1 is no name).
NAME_ENTRY_DTYPE = np.dtype([
    ("name", "<i8", (8,)),  # the namespace's name, zero-padded
    ("length", "<i8"),  # its length in bytes
    ("id", "<i8"),  # its namespace id
    ("spare", "<i8", (6,)),  # (16 words: a power of two the kernels load in one range)
])


def _words(dtype: np.dtype) -> SimpleNamespace:
    """Field name -> word index (8-byte words), and ``words``: the dtype's size in words."""
    if dtype.itemsize % 8:
        raise AssertionError(f"{dtype} is not a whole number of 8-byte words")
    fields = {}
    for name, (field_dtype, offset) in dtype.fields.items():
        if offset % 8 or field_dtype.base.itemsize != 8:
            raise AssertionError(f"field {name} is not an aligned 8-byte word")
        fields[name] = offset // 8
    return SimpleNamespace(words=dtype.itemsize // 8, **fields)


#: The header's own_filters bits, and a table row's ns for all namespaces (no namespace id
#: takes it: ids are int32).
OWN_WINDOWS, OWN_NAMESPACES, NS_ALL = 1, 2, -(2**62)

HEADER = _words(HEADER_DTYPE)
TABLE = _words(TABLE_DTYPE)
HOST_CONTROL = _words(HOST_CONTROL_DTYPE)
DEVICE_CONTROL = _words(DEVICE_CONTROL_DTYPE)
NAME_ENTRY = _words(NAME_ENTRY_DTYPE)
HDR_WORDS = HEADER.words
TAB_WORDS = TABLE.words
HCTL_WORDS = HOST_CONTROL.words
CTL_WORDS = DEVICE_CONTROL.words

_PREFIXES = (("H_", HEADER), ("T_", TABLE), ("HCTL_", HOST_CONTROL), ("CTL_", DEVICE_CONTROL),
             ("NE_", NAME_ENTRY))


def kernel_constants() -> dict[str, int]:
    """The kernels' constexpr names and the offsets this declaration gives them:
    ``H_<field>`` header words, ``T_<field>`` table words, ``HCTL_`` / ``CTL_`` control words
    (upper case; the spare words have none), ``NE_`` a name entry's words, ``HDR_WORDS`` and
    ``TAB_WORDS`` (the table starts after the header), ``NE_WORDS``."""
    out = {"HDR_WORDS": HDR_WORDS, "TAB_WORDS": TAB_WORDS, "NE_WORDS": NAME_ENTRY.words, "OWN_WINDOWS": OWN_WINDOWS,
           "OWN_NAMESPACES": OWN_NAMESPACES, "NS_ALL": NS_ALL}
    for prefix, words in _PREFIXES:
        out.update({prefix + name.upper(): at for name, at in vars(words).items()
                    if name not in ("words", "spare", "unused")})
    return out


def check_kernel_layout(kernels) -> None:
    """Raises AssertionError unless every offset the kernel module ``kernels`` holds agrees
    with this declaration (a kernel module built from another version of it, say)."""
    for name, at in kernel_constants().items():
        value = getattr(kernels, name, None)
        value = getattr(value, "value", value)  # a tl.constexpr
        if value != at:
            raise AssertionError(f"the kernels' {name} is {value}, the host's layout says {at}")
