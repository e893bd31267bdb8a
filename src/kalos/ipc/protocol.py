"""The byte layout of a Kalos shared-memory segment, declared once.

Nothing outside this module knows an offset. A segment is one header followed by
``n_slots`` equal slots; every slot belongs to one client at a time, so each word has exactly
one writer and no compare-and-swap is ever needed::

    offset 0              +--------------------------------------------------+
                          | header (HEADER_DTYPE), padded to one page         |
                          |   magic, version, sizes, epoch, heartbeat,       |
                          |   sidecar_sleeping, clients                       |
    header_size           +--------------------------------------------------+
    + i * slot_size       | slot i                                           |
                          |   request  (REQUEST_DTYPE, written by the client) |
                          |     req_seq, op, k, n_queries, flags, since,     |
                          |     until, client_sleeping, namespace,           |
                          |     where_handle                                 |
                          |   response (RESPONSE_DTYPE, written by sidecar)  |
                          |     resp_seq, status, n_results, message         |
                          |   queries  float32[max_batch, dim]   (client)    |
                          |   ids      int64  [max_batch, max_k] (sidecar)   |
                          |   scores   float32[max_batch, max_k] (sidecar)   |
                          +--------------------------------------------------+

A request is pending while ``req_seq != resp_seq``. The client fills the request and query
rows, then increments ``req_seq``; the sidecar answers by writing the result rows and the
response, then storing ``resp_seq = req_seq``. A slot handed to a client starts with both at
``rest_seq(generation)``: the slot's generation (how many times it changed hands) in the high
bits, 0 in the low ``SEQ_COUNTER_BITS``. So no sequence number of one client is ever one of
the slot's previous client (a GPU kernel that keeps serving while clients come and go cannot
mistake one for the other), and a ``req_seq`` whose counter is 0 is not a request (a GPU kernel
polling the slots ignores it; a client would need 2**40 requests on one connection to reach
one). Sequence numbers exceed 2**53: compare them as Python ints, never through a float (older
NumPy compares a ``uint64`` with a Python int that way). Why those stores become visible in that order
to the other process is argued in :mod:`kalos.ipc.sync`.

Every slot and every area starts on a 64-byte boundary (no false sharing between the
client's request line and the sidecar's response line) and slots are whole pages, so the
result areas can be page-locked for the GPU independently.
"""
from __future__ import annotations

import dataclasses
import enum
import mmap

import numpy as np

from kalos.errors import ProtocolMismatch

__all__ = [
    "MAGIC",
    "VERSION",
    "Op",
    "RequestFlag",
    "NAMESPACE_BYTES",
    "MESSAGE_BYTES",
    "HEADER_DTYPE",
    "REQUEST_DTYPE",
    "RESPONSE_DTYPE",
    "Layout",
    "HeaderView",
    "SlotView",
    "SlotColumns",
    "SlotWords",
    "SEQ_COUNTER_BITS",
    "rest_seq",
]

MAGIC = int.from_bytes(b"KALOSSHM", "little")

#: Low bits of a sequence number that count one client's requests; the rest are the slot's generation.
SEQ_COUNTER_BITS = 40


def rest_seq(generation: int) -> int:
    """``req_seq`` and ``resp_seq`` of a slot just handed to a client (``generation``: how many
    times the slot changed hands, modulo the bits left above the counter)."""
    return (int(generation) % (1 << (64 - SEQ_COUNTER_BITS))) << SEQ_COUNTER_BITS
# 3: the namespace field grew from 64 to 256 bytes (names of up to 255 UTF-8 bytes, issue 22),
# and the request's where_handle.
VERSION = 3
NAMESPACE_BYTES = 256
MESSAGE_BYTES = 192
_LINE = 64
_PAGE = mmap.PAGESIZE


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class Op(enum.IntEnum):
    RECALL = 1
    PING = 2  # answered without touching the engine: the bare channel round trip


class RequestFlag(enum.IntFlag):
    ALL_NAMESPACES = 1
    HAS_SINCE = 2
    HAS_UNTIL = 4
    # ``where_handle`` names a where clause the client registered over the control socket
    # (the clause itself, JSON of any length, never crosses the slot).
    HAS_WHERE = 8


HEADER_DTYPE = np.dtype(
    {
        "names": [
            "magic", "version", "header_size", "slot_size", "n_slots", "dim", "max_k",
            "max_batch", "epoch", "heartbeat_ns", "sidecar_pid", "sidecar_sleeping", "clients",
        ],
        "formats": ["<u8", "<u4", "<u4", "<u8", "<u4", "<u4", "<u4", "<u4", "<u8", "<u8", "<u4", "<u4", "<u4"],
        "offsets": [0, 8, 12, 16, 24, 28, 32, 36, 40, 48, 56, 64, 68],
        "itemsize": 128,
    }
)

REQUEST_DTYPE = np.dtype(
    {
        "names": ["req_seq", "op", "k", "n_queries", "flags", "since", "until", "client_sleeping",
                  "namespace_len", "namespace", "where_handle"],
        "formats": ["<u8", "<u4", "<u4", "<u4", "<u4", "<f8", "<f8", "<u4", "<u4", f"S{NAMESPACE_BYTES}", "<u8"],
        "offsets": [0, 8, 12, 16, 20, 24, 32, 40, 44, 48, _align(48 + NAMESPACE_BYTES, 8)],
        "itemsize": _align(_align(48 + NAMESPACE_BYTES, 8) + 8, _LINE),
    }
)

#: The request words that say what kind of request a slot holds, in their order in memory
#: (``SlotColumns.kind``).
REQUEST_KIND_FIELDS = ("op", "k", "n_queries", "flags")

RESPONSE_DTYPE = np.dtype(
    {
        "names": ["resp_seq", "status", "n_results", "message_len", "message"],
        "formats": ["<u8", "<u4", "<u4", "<u4", f"S{MESSAGE_BYTES}"],
        "offsets": [0, 8, 12, 16, 64],
        "itemsize": 64 + MESSAGE_BYTES,
    }
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every offset and size of a segment, derived from four numbers."""

    n_slots: int
    dim: int
    max_k: int
    max_batch: int

    @property
    def header_size(self) -> int:
        return _align(HEADER_DTYPE.itemsize, _PAGE)

    @property
    def request_offset(self) -> int:
        return 0

    @property
    def response_offset(self) -> int:
        return _align(REQUEST_DTYPE.itemsize, _LINE)

    @property
    def queries_offset(self) -> int:
        return _align(self.response_offset + RESPONSE_DTYPE.itemsize, _LINE)

    @property
    def ids_offset(self) -> int:
        return _align(self.queries_offset + 4 * self.max_batch * self.dim, _LINE)

    @property
    def scores_offset(self) -> int:
        return _align(self.ids_offset + 8 * self.max_batch * self.max_k, _LINE)

    @property
    def slot_size(self) -> int:
        return _align(self.scores_offset + 4 * self.max_batch * self.max_k, _PAGE)

    @property
    def size(self) -> int:
        return self.header_size + self.n_slots * self.slot_size

    def slot_offset(self, slot: int) -> int:
        if not 0 <= slot < self.n_slots:
            raise ProtocolMismatch(f"slot {slot} is outside the segment's {self.n_slots} slots")
        return self.header_size + slot * self.slot_size

    def write_header(self, buf: memoryview, *, epoch: int, pid: int) -> None:
        header = np.ndarray((), HEADER_DTYPE, buf, 0)
        header["version"] = VERSION
        header["header_size"] = self.header_size
        header["slot_size"] = self.slot_size
        header["n_slots"] = self.n_slots
        header["dim"] = self.dim
        header["max_k"] = self.max_k
        header["max_batch"] = self.max_batch
        header["epoch"] = epoch
        header["sidecar_pid"] = pid
        header["magic"] = MAGIC  # last: a reader that sees the magic sees the sizes

    @classmethod
    def read_header(cls, buf: memoryview, *, source: str) -> "Layout":
        """The layout a segment declares, after checking magic, version and sizes."""
        if len(buf) < HEADER_DTYPE.itemsize:
            raise ProtocolMismatch(f"{source}: {len(buf)} bytes is too small for a Kalos segment header")
        header = np.ndarray((), HEADER_DTYPE, buf, 0)
        if int(header["magic"]) != MAGIC:
            raise ProtocolMismatch(f"{source}: not a Kalos segment (magic {int(header['magic']):#x}, expected {MAGIC:#x})")
        if int(header["version"]) != VERSION:
            raise ProtocolMismatch(
                f"{source}: segment protocol version {int(header['version'])}, this client speaks {VERSION}; "
                "upgrade the older of client and sidecar"
            )
        layout = cls(int(header["n_slots"]), int(header["dim"]), int(header["max_k"]), int(header["max_batch"]))
        declared = (int(header["header_size"]), int(header["slot_size"]))
        if declared != (layout.header_size, layout.slot_size) or len(buf) < layout.size:
            raise ProtocolMismatch(
                f"{source}: segment sizes disagree with its header (header/slot {declared}, "
                f"expected {(layout.header_size, layout.slot_size)}; {len(buf)} bytes mapped, {layout.size} needed)"
            )
        return layout


@dataclasses.dataclass(frozen=True)
class SlotWords:
    """Where a GPU kernel that serves slots by itself finds each field, in 8-byte words.

    Word offsets are from the start of a slot; ``queries`` / ``scores`` are float32 element
    offsets and ``ids`` an int64 element offset from the start of the slot. Two 32-bit fields
    share each of the words ``op_k`` (op low, k high), ``nq_flags`` (n_queries low, flags high)
    and ``status_n`` (status low, n_results high), little-endian.
    """

    req_seq: int
    op_k: int
    nq_flags: int
    since: int  # float64
    until: int  # float64
    ns_len: int  # namespace_len in the high half of this word
    ns_bytes: int  # the namespace's NAMESPACE_BYTES bytes start at this word
    resp_seq: int
    status_n: int
    queries: int
    ids: int
    scores: int

    @classmethod
    def of(cls, layout: "Layout") -> "SlotWords":
        def word(dtype: np.dtype, base: int, low: str, high: str | None = None) -> int:
            off = base + dtype.fields[low][1]
            if off % 8 or (high is not None and dtype.fields[high][1] != dtype.fields[low][1] + 4):
                raise AssertionError(f"{low}/{high} do not share one aligned 8-byte word")
            return off // 8

        req, resp = layout.request_offset, layout.response_offset
        ns_len_at = req + REQUEST_DTYPE.fields["namespace_len"][1]
        ns_at = req + REQUEST_DTYPE.fields["namespace"][1]
        if ns_len_at % 8 != 4 or ns_at % 8:
            raise AssertionError("namespace_len must be the high half of a word, namespace word-aligned")
        return cls(
            req_seq=word(REQUEST_DTYPE, req, "req_seq"),
            op_k=word(REQUEST_DTYPE, req, "op", "k"),
            nq_flags=word(REQUEST_DTYPE, req, "n_queries", "flags"),
            since=word(REQUEST_DTYPE, req, "since"),
            until=word(REQUEST_DTYPE, req, "until"),
            ns_len=ns_len_at // 8,
            ns_bytes=ns_at // 8,
            resp_seq=word(RESPONSE_DTYPE, resp, "resp_seq"),
            status_n=word(RESPONSE_DTYPE, resp, "status", "n_results"),
            queries=layout.queries_offset // 4,
            ids=layout.ids_offset // 8,
            scores=layout.scores_offset // 4,
        )


def _scalar_views(buf: memoryview, base: int, dtype: np.dtype) -> dict[str, np.ndarray]:
    """One single-element array per field: ``view[0]`` reads or writes that field in place.

    Reading one element of a plain array costs a fraction of a structured-field access,
    and these reads sit on the hot path.
    """
    views = {}
    for name, (field_dtype, offset) in dtype.fields.items():
        views[name] = np.ndarray((1,), field_dtype, buf, base + offset)
    return views


class HeaderView:
    """Field views of the segment header."""

    def __init__(self, buf: memoryview) -> None:
        fields = _scalar_views(buf, 0, HEADER_DTYPE)
        self.epoch = fields["epoch"]
        self.heartbeat_ns = fields["heartbeat_ns"]
        self.sidecar_pid = fields["sidecar_pid"]
        self.sidecar_sleeping = fields["sidecar_sleeping"]
        # Slots in use, kept by the sidecar: a waiting client spins only while the clients and
        # the sidecar's sweep fit on the cores (ClientChannel.wait).
        self.clients = fields["clients"]


class SlotView:
    """Field and array views of one slot."""

    def __init__(self, buf: memoryview, layout: Layout, slot: int) -> None:
        base = layout.slot_offset(slot)
        self.index = slot
        request = _scalar_views(buf, base + layout.request_offset, REQUEST_DTYPE)
        response = _scalar_views(buf, base + layout.response_offset, RESPONSE_DTYPE)
        self.req_seq = request["req_seq"]
        self.op = request["op"]
        self.k = request["k"]
        self.n_queries = request["n_queries"]
        self.flags = request["flags"]
        self.since = request["since"]
        self.until = request["until"]
        self.client_sleeping = request["client_sleeping"]
        self.namespace_len = request["namespace_len"]
        self.namespace = request["namespace"]
        self.where_handle = request["where_handle"]
        self.resp_seq = response["resp_seq"]
        self.status = response["status"]
        self.n_results = response["n_results"]
        self.message_len = response["message_len"]
        self.message = response["message"]
        self.queries = np.ndarray((layout.max_batch, layout.dim), np.float32, buf, base + layout.queries_offset)
        self.ids = np.ndarray((layout.max_batch, layout.max_k), np.int64, buf, base + layout.ids_offset)
        self.scores = np.ndarray((layout.max_batch, layout.max_k), np.float32, buf, base + layout.scores_offset)
        self.request_bytes = np.ndarray((REQUEST_DTYPE.itemsize,), np.uint8, buf, base + layout.request_offset)
        self.response_bytes = np.ndarray((RESPONSE_DTYPE.itemsize,), np.uint8, buf, base + layout.response_offset)

    def write_request(self, op: int, n_queries: int, k: int, flags: int, since: float, until: float,
                      namespace: bytes, where_handle: int = 0) -> None:
        """Writes a request's words (not its rows, not req_seq): the client's, or the sidecar's
        when it recalls in a client's slot on its behalf (op ``recall_text``)."""
        self.where_handle[0] = where_handle
        self.op[0] = op
        self.k[0] = k
        self.n_queries[0] = n_queries
        self.flags[0] = flags
        self.since[0] = since
        self.until[0] = until
        self.namespace[0] = namespace
        self.namespace_len[0] = len(namespace)

    def read_namespace(self) -> bytes:
        n = min(int(self.namespace_len[0]), NAMESPACE_BYTES)
        return self.namespace[0][:n] if n else b""

    def write_message(self, text: str) -> None:
        data = text.encode("utf-8", "replace")[:MESSAGE_BYTES]
        self.message[0] = data
        self.message_len[0] = len(data)

    def read_message(self) -> str:
        n = min(int(self.message_len[0]), MESSAGE_BYTES)
        return self.message[0][:n].decode("utf-8", "replace")

    def reset(self) -> None:
        """Zeroes the control words (the sidecar does this before handing the slot out)."""
        self.request_bytes[:] = 0
        self.response_bytes[:] = 0


class SlotColumns:
    """Strided views of each slot's words across all slots, for the sidecar's sweep.

    ``column[slots]`` reads (or ``column[slots] = values`` writes) one field of many slots in
    one NumPy call: the sweep's cost per pass stays flat however many clients are pending. The
    ``*_row0`` views are the first query row and result row of every slot (``[n_slots, dim]``
    and ``[n_slots, max_k]``), where a single recall travels.
    """

    def __init__(self, buf: memoryview, layout: Layout) -> None:
        base = layout.header_size

        def column(dtype_of: np.dtype, area: int, field: str) -> np.ndarray:
            dtype, offset = dtype_of.fields[field]
            return np.ndarray((layout.n_slots,), dtype, buf, base + area + offset, strides=(layout.slot_size,))

        def rows(dtype: type, area: int, width: int) -> np.ndarray:
            item = np.dtype(dtype).itemsize
            return np.ndarray((layout.n_slots, width), dtype, buf, base + area, strides=(layout.slot_size, item))

        request, response = layout.request_offset, layout.response_offset
        self.req_seq = column(REQUEST_DTYPE, request, "req_seq")
        self.op = column(REQUEST_DTYPE, request, "op")
        self.k = column(REQUEST_DTYPE, request, "k")
        self.n_queries = column(REQUEST_DTYPE, request, "n_queries")
        self.flags = column(REQUEST_DTYPE, request, "flags")
        self.namespace_len = column(REQUEST_DTYPE, request, "namespace_len")
        self.namespace = column(REQUEST_DTYPE, request, "namespace")
        self.where_handle = column(REQUEST_DTYPE, request, "where_handle")
        self.client_sleeping = column(REQUEST_DTYPE, request, "client_sleeping")
        self.resp_seq = column(RESPONSE_DTYPE, response, "resp_seq")
        self.status = column(RESPONSE_DTYPE, response, "status")
        self.n_results = column(RESPONSE_DTYPE, response, "n_results")
        self.query_row0 = rows(np.float32, layout.queries_offset, layout.dim)
        self.ids_row0 = rows(np.int64, layout.ids_offset, layout.max_k)
        self.scores_row0 = rows(np.float32, layout.scores_offset, layout.max_k)
        # The same words seen wider, so that the sweep can tell in two comparisons that a crowd
        # sent one kind of request (RecallLoop._answer): each slot's (op, k, n_queries, flags),
        # adjacent uint32 words, and its namespace bytes as uint64 words.
        kind_at = REQUEST_DTYPE.fields["op"][1]
        if [REQUEST_DTYPE.fields[f][1] - kind_at for f in REQUEST_KIND_FIELDS] != [0, 4, 8, 12]:
            raise AssertionError(f"{REQUEST_KIND_FIELDS} must be adjacent uint32 words of a request")
        self.kind = rows(np.uint32, request + kind_at, len(REQUEST_KIND_FIELDS))
        namespace_at = REQUEST_DTYPE.fields["namespace"][1]
        self.namespace_words = rows(np.uint64, request + namespace_at, NAMESPACE_BYTES // 8)
