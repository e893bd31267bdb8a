"""Suite 3 — hostile input: a rogue client fuzzes its shared-memory slot and the control socket.

Slots. A rogue process takes a slot like any client (hello over the control socket), maps the
segment itself and writes hypothesis-generated requests into its slot: structure-aware fields
(op, k and batch size beyond the slot's max_k / max_batch, namespace lengths past the namespace
field, unknown flags, the where flag naming a clause nobody registered, NaN/inf/empty time
windows, NaN/inf/zero/subnormal/huge query rows),
raw random request bytes, garbage over its own response words, and request sequence numbers
out of order (repeated, going back, jumping). For every request a model of the sidecar's rules
predicts the allowed answers: the set of error codes the request deserves, or success, in which
case the answer must be the exact top-k (float64 reference, filters applied). Meanwhile an
honest client process recalls and checks every answer, and the bytes of idle clients' slots
and of the segment header's fixed fields are compared before and after: the sidecar writes
nowhere but the rogue's slot.

Control socket. Hypothesis-generated frames on fresh connections: random bytes, truncated
frames, oversized length prefixes, bodies that are not JSON / not UTF-8 / not an object / nested
100,000 deep / integers of 20,000 digits, and well-framed messages of every op with every field
replaced by JSON of any type (blob descriptions with absurd shapes, blobs of the wrong size).
Every complete frame must get a reply that is a success or an error with a code other than
INTERNAL (INTERNAL is a server bug), the connection must close after EOF (no hang), and the
honest client keeps getting exact answers.

File descriptors and connections. A rogue hands the sidecar a bell of the wrong kind (a file,
an eventfd, a pipe, a named, listening or UDP socket: refused, none kept), or one it made
blocking and full, or closed at its end, and asks to be woken thousands of times; another rings
without pause while an honest client that sleeps on every recall checks its answers;
a flood of connections runs the sidecar out of file descriptors (its limit lowered to 128).
The sweep must never stop or stall, honest clients must never see an error, and once the flood
is gone new clients must get in.

Everywhere: the sidecar stays alive and its log has no traceback.
"""
from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import time
from typing import Any

import numpy as np
import pytest
from conftest import DEADLINE_S, _seed_value, unique_name, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from kalos import Client
from kalos.errors import ErrorCode, InvalidArgument
from kalos.ipc.channel import wake_pair
from kalos.ipc.control import PROTOCOL_VERSION
from kalos.ipc.protocol import (HEADER_DTYPE, MESSAGE_BYTES, NAMESPACE_BYTES, REQUEST_DTYPE, Layout, Op, RequestFlag,
                                SlotView)
from kalos.validation import check_namespace
from reliability._support import ItemTable, check_row, honest, raw_connection, tracebacks

DIM = 8
MAX_K = 16
MAX_BATCH = 4
NAMESPACES = {"honest": 400, "other": 60}  # "default" exists too, empty
REQUEST_BYTES = REQUEST_DTYPE.itemsize
_PREFIX = struct.Struct("<IQ")
IQ, PROTO, INTERNAL = int(ErrorCode.INVALID_QUERY), int(ErrorCode.PROTOCOL), int(ErrorCode.INTERNAL)
UNKNOWN_FILTER = int(ErrorCode.UNKNOWN_FILTER)


def _fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck), print_blob=True)


class Served:
    """A sidecar with a fixed population, an observer client and one honest checker process."""

    def __init__(self, sidecars: Any, children: Any, store_dir: Any, seed: int) -> None:
        self.name = unique_name("hostile")
        self.proc = sidecars.start(store_dir / "h.db", name=self.name, dim=DIM,
                                   extra_args=["--slots", "8", "--max-k", str(MAX_K), "--max-batch", str(MAX_BATCH)])
        rng = np.random.default_rng(seed)
        self.observer = Client(self.name, timeout=30.0)
        ids, units, namespaces, created = [], [], [], []
        for namespace, n in NAMESPACES.items():
            v = rng.standard_normal((n, DIM)).astype(np.float32)
            t = rng.uniform(1000, 2000, n)
            ids.append(self.observer.add(v, namespace=namespace, created_at=t))
            units.append(v.astype(np.float64) / np.linalg.norm(v.astype(np.float64), axis=1, keepdims=True))
            namespaces += [namespace] * n
            created.append(t)
        self.ids = np.concatenate(ids)
        self.unit = np.concatenate(units)
        self.namespaces = np.array(namespaces, dtype=object)
        self.created = np.concatenate(created)
        self.table = ItemTable.static(self.ids, self.unit, namespaces)
        order = np.argsort(self.ids)
        self.created_sorted = self.created[order]
        self.honest_ids = self.ids[self.namespaces == "honest"]
        self.out, self.stop = children.queue(), children.event()
        children.start(honest, self.name, self.honest_ids, self.unit[self.namespaces == "honest"], "honest",
                       seed + 1, self.stop, self.out)
        msg = self.out.get(timeout=DEADLINE_S * 2)
        assert msg[0] == "warm", msg

    def finish(self) -> int:
        """Stops the honest client; asserts it saw only exact answers and the sidecar is clean."""
        self.stop.set()
        msg = self.out.get(timeout=DEADLINE_S * 2)
        assert msg[0] == "honest", msg
        assert not msg[3], "the honest client saw wrong answers:\n" + "\n".join(msg[3][:5])
        assert self.proc.process.poll() is None, "the sidecar died"
        found = tracebacks(self.proc.log())
        assert not found, found[0]
        self.observer.close()
        return msg[2]


# -- the rogue's slot --------------------------------------------------------------------------------


u32 = st.one_of(st.integers(0, 2**32 - 1),
                st.sampled_from([0, 1, 2, MAX_BATCH, MAX_BATCH + 1, MAX_K, MAX_K + 1, 2**31, 2**32 - 1]))
any_float = st.floats(allow_nan=True, allow_infinity=True)
a_time = st.one_of(st.floats(900, 2100), any_float)
query_value = st.one_of(st.floats(-3, 3), st.floats(width=32, allow_nan=True, allow_infinity=True),
                        st.sampled_from([0.0, 1e-45, -1e-41, 3e38, -3e38]))
def mostly(valid: Any, invalid: Any) -> Any:
    """Four draws in five from ``valid``: enough well-formed requests to check real answers too."""
    return st.one_of(valid, valid, valid, valid, invalid)


slot_case = st.fixed_dictionaries({
    "op": mostly(st.just(int(Op.RECALL)), st.one_of(st.just(int(Op.PING)), u32)),
    "k": mostly(st.integers(1, MAX_K), u32),
    "n": mostly(st.integers(1, MAX_BATCH), u32),
    "flags": mostly(st.integers(0, 7), st.one_of(st.sampled_from([8, 9, 15, 16]), u32)),
    "since": mostly(st.floats(900, 1500), any_float),
    "until": mostly(st.floats(1500, 2100), a_time),
    "namespace": mostly(st.sampled_from([b"honest", b"other", b"default"]),
                        st.one_of(st.sampled_from([b"nope", b"honest\x00x"]), st.binary(max_size=NAMESPACE_BYTES))),
    "namespace_len": mostly(st.none(), u32),
    "queries": mostly(st.integers(0, 2**32 - 1),  # a seed: random gaussian rows
                      st.lists(query_value, min_size=DIM * MAX_BATCH, max_size=DIM * MAX_BATCH)),
    "raw_request": mostly(st.none(), st.binary(min_size=REQUEST_BYTES, max_size=REQUEST_BYTES)),
    "scribble_response": mostly(st.none(), st.binary(min_size=64 + MESSAGE_BYTES, max_size=64 + MESSAGE_BYTES)),
    "client_sleeping": st.sampled_from([0, 0, 1, 2**32 - 1]),
    "seq": st.sampled_from(["next", "next", "next", "next", "next", "same", "back", "jump"]),
    "jump": st.integers(0, 2**64 - 1),
    "pristine": st.booleans(),  # half the cases: a well-formed request built from the same draws
})


def allowed_statuses(view: SlotView, layout: Layout, known: set[bytes]) -> set[int]:
    """What the sidecar may answer to the request in ``view``: error codes, or {0} for success."""
    op = int(view.op[0])
    if op == Op.PING:
        return {0}
    if op != Op.RECALL:
        return {IQ}
    errors = set()
    n, k, flags = int(view.n_queries[0]), int(view.k[0]), int(view.flags[0])
    # In the sidecar's order: the request's words, then the where handle before the rest of
    # the filter and the rows.
    if not 1 <= n <= layout.max_batch or not 1 <= k <= layout.max_k or flags & ~15:
        return {IQ}
    if flags & RequestFlag.HAS_WHERE:  # nobody registered a where clause with this sidecar
        return {UNKNOWN_FILTER}
    if not flags & 1 and view.read_namespace() not in known:
        # A valid name that never held a memory is answered with no hits (issue 22); bytes that
        # are no namespace name (not UTF-8, control characters, empty, too long) are refused.
        try:
            check_namespace(view.read_namespace().decode("utf-8"))
        except (UnicodeDecodeError, InvalidArgument):
            errors.add(IQ)
    since = float(view.since[0]) if flags & 2 else None
    until = float(view.until[0]) if flags & 4 else None
    if any(t is not None and not np.isfinite(t) for t in (since, until)):
        errors.add(IQ)
    elif since is not None and until is not None and since >= until:
        errors.add(IQ)
    rows = view.queries[:n].astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        norms = np.einsum("ij,ij->i", rows, rows)
    if not np.all(np.isfinite(rows)) or not np.all(norms > 0):
        errors.add(IQ)
    return errors or {0}


def test_rogue_slot_fuzz_changes_nothing_but_its_own_slot(sidecars, children, store_dir, scale):
    seed = _seed_value()
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    served = Served(sidecars, children, store_dir, seed)
    sentinels = [Client(served.name, timeout=30.0) for _ in range(2)]
    rogue = Client(served.name, timeout=30.0)
    conn = rogue._conn  # the rogue knows its slot and bell, as any client does
    path = f"segment of {served.name}"
    fd = conn.segment.fileno()  # the memfd its hello passed, mapped a second time
    mapping = mmap.mmap(fd, os.fstat(fd).st_size)
    buf = memoryview(mapping)
    layout = Layout.read_header(buf, source=path)
    view = SlotView(buf, layout, conn.channel.slot.index)
    others = [c._conn.channel.slot.index for c in sentinels + [served.observer]]
    fixed_header = bytes(buf[:40]) + bytes(buf[56:60]) + bytes(buf[HEADER_DTYPE.itemsize:layout.header_size])
    before = {i: bytes(buf[layout.slot_offset(i): layout.slot_offset(i) + layout.slot_size]) for i in others}
    known = {b"default", *(ns.encode() for ns in NAMESPACES)}
    state = {"answered": int(view.resp_seq[0]), "requests": 0, "errors": 0, "ok": 0, "not_pending": 0}
    problems: list[str] = []

    def run(case: dict[str, Any]) -> None:
        if case["pristine"]:
            case = {**case, "op": int(Op.RECALL), "k": 1 + case["k"] % MAX_K, "n": 1 + case["n"] % MAX_BATCH,
                    "flags": case["flags"] & 7, "since": 900 + case["k"] % 600, "until": 1500 + case["n"] % 600,
                    "namespace": [b"honest", b"other", b"default"][case["jump"] % 3], "namespace_len": None,
                    "raw_request": None, "queries": case["jump"]}
        view.request_bytes[8:] = 0
        if case["raw_request"] is not None:
            view.request_bytes[8:] = np.frombuffer(case["raw_request"][8:], np.uint8)
        else:
            for field in ("op", "k", "flags", "since", "until", "client_sleeping"):
                getattr(view, field)[0] = case[field]
            view.n_queries[0] = case["n"]
            view.namespace[0] = case["namespace"]
            view.namespace_len[0] = len(case["namespace"]) if case["namespace_len"] is None else case["namespace_len"]
        q = case["queries"]
        if isinstance(q, int):
            view.queries[:] = np.random.default_rng(q).standard_normal(view.queries.shape).astype(np.float32)
        else:
            view.queries[:] = np.asarray(q, np.float32).reshape(view.queries.shape)
        answered = state["answered"]
        seq = {"next": answered + 1, "same": answered, "back": answered - 1 - case["jump"] % 1000,
               "jump": case["jump"]}[case["seq"]] % 2**64
        if case["scribble_response"] is not None:
            view.response_bytes[:] = np.frombuffer(case["scribble_response"], np.uint8)
        if int(view.resp_seq[0]) == seq and seq != answered:
            view.resp_seq[0] = seq ^ 1  # so that the wait below cannot end before the answer
        expected = allowed_statuses(view, layout, known)
        resp_before = bytes(view.response_bytes)
        view.req_seq[0] = seq  # publishes the request (x86-64: stores stay in order)
        ring(conn.wake.fileno())
        if seq == answered:  # not a new request: the sidecar must not answer (again)
            state["not_pending"] += 1
            time.sleep(0.002)
            if bytes(view.response_bytes) != resp_before:
                problems.append(f"the sidecar answered a request that was not pending: {case}")
                raise AssertionError(problems[-1])
            return
        deadline = time.monotonic() + 30
        while int(view.resp_seq[0]) != seq:
            if time.monotonic() > deadline:
                problems.append(f"no answer to {case}")
                raise AssertionError(problems[-1])
            time.sleep(0.0001)
        state["answered"] = seq
        state["requests"] += 1
        status = int(view.status[0])
        if status not in expected:
            problems.append(f"status {status} ({view.read_message()!r}), expected one of {expected}: {case}")
            raise AssertionError(problems[-1])
        if status:
            state["errors"] += 1
            assert view.read_message(), f"error {status} without a message: {case}"
            return
        state["ok"] += 1
        if int(view.op[0]) == Op.PING:
            return
        flags, k, n = int(view.flags[0]), int(view.k[0]), int(view.n_queries[0])
        assert int(view.n_results[0]) == k
        eligible = np.ones(len(served.table.ids), bool)
        if not flags & 1:
            eligible &= served.table.namespaces == view.read_namespace().decode()
        if flags & 2:
            eligible &= served.created_sorted >= float(view.since[0])
        if flags & 4:
            eligible &= served.created_sorted < float(view.until[0])
        for row in range(n):
            problem = check_row(view.queries[row].copy(), k, view.ids[row, :k].copy(), view.scores[row, :k].copy(),
                                served.table, eligible, eligible)
            if problem is not None:
                problems.append(f"row {row}: {problem}: {case}")
                raise AssertionError(problems[-1])

    fuzz = hypothesis_seed(seed)(_fuzz_settings(scale(400, 5000))(given(slot_case)(run)))
    try:
        fuzz()
    finally:
        assert not problems, problems[:3]
        after = {i: bytes(buf[layout.slot_offset(i): layout.slot_offset(i) + layout.slot_size]) for i in others}
        changed = [i for i in others if after[i] != before[i]]
        header_now = bytes(buf[:40]) + bytes(buf[56:60]) + bytes(buf[HEADER_DTYPE.itemsize:layout.header_size])
        del view
        buf.release()
        mapping.close()
    assert not changed, f"the sidecar wrote into slots {changed}, which are not the rogue's"
    assert header_now == fixed_header, "the segment header's fixed fields changed"
    for c in sentinels:  # their slots still work
        hit = c.recall(served.unit[0].astype(np.float32), k=1, namespace=None)
        assert hit.ids.tolist() == [int(served.ids[0])]
        c.close()
    rogue.close()
    honest_answers = served.finish()
    print(f"RELIABILITY hostile-slot: examples={state['requests'] + state['not_pending']} answered={state['requests']} "
          f"errors={state['errors']} exact_successes={state['ok']} not_pending_ignored={state['not_pending']} "
          f"foreign_bytes_written=0 honest_recalls_checked={honest_answers}")


# -- the control socket --------------------------------------------------------------------------------


def _frame(body: bytes, blob: bytes = b"", *, json_len: int | None = None, blob_len: int | None = None) -> bytes:
    return _PREFIX.pack(len(body) if json_len is None else json_len, len(blob) if blob_len is None else blob_len) + body + blob


def exchange(runtime: str, name: str, parts: list[tuple[str, Any]]) -> tuple[list[dict], bool]:
    """Sends ``parts`` (("bytes", b), ("fd", None), ("junk-fd", None)), half-closes, reads to EOF.

    Returns the replies and whether the stream after them was well framed. Raises on a hang.
    """
    sock = raw_connection(runtime, name, timeout=30.0)
    wake_end, kept = wake_pair()
    wake = wake_end.detach()
    kept.close()
    try:
        try:
            for kind, value in parts:
                if kind == "bytes":
                    sock.sendall(value)
                elif kind == "fd":
                    socket.send_fds(sock, [b"F"], [wake])
                else:
                    sock.sendall(b"X")
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the sidecar dropped the connection early (a framing error): read its reply
        data = bytearray()
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            except socket.timeout:
                raise AssertionError(f"the sidecar neither answered nor closed after EOF: {parts!r:.300}") from None
            if not chunk:
                break
            data += chunk
    finally:
        sock.close()
        os.close(wake)
    replies, pos, framed = [], 0, True
    while pos < len(data):
        if data[pos:pos + 1] == b"F" and replies and replies[-1].get("slot") is not None:
            pos += 1  # the segment fd's one-byte message after a hello reply
            continue
        if len(data) - pos < _PREFIX.size:
            framed = False
            break
        json_len, blob_len = _PREFIX.unpack_from(data, pos)
        end = pos + _PREFIX.size + json_len
        replies.append(json.loads(bytes(data[pos + _PREFIX.size: end])))
        pos = end + blob_len
    return replies, framed


def check_replies(replies: list[dict], framed: bool, what: Any, *, expect_reply: bool) -> int:
    assert framed, f"a reply was not a well-formed frame: {what!r:.300}"
    if expect_reply:
        assert replies, f"no reply to a complete frame: {what!r:.300}"
    errors = 0
    for reply in replies:
        assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
        if not reply["ok"]:
            errors += 1
            assert reply.get("code") in {int(c) for c in ErrorCode} and reply["code"] != INTERNAL, \
                f"reply {reply} to {what!r:.400}"
            assert isinstance(reply.get("error"), str) and reply["error"], reply
    return errors


json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_any = st.recursive(json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                        max_leaves=12)
dims = st.one_of(st.integers(0, 64), st.sampled_from([DIM, 2**31, 2**32, 2**40, 2**62, 2**63, 2**64, -1]),
                 json_any)
FIELDS: dict[str, dict[str, Any]] = {
    "add": {
        "namespace": st.one_of(st.sampled_from(["default", "fuzz", "", "x" * 64, "a\x00b", "\ud800"]), json_any),
        "vectors": st.one_of(st.fixed_dictionaries({
            "dtype": st.one_of(st.sampled_from(["float32", "float32", "int64", "float64"]), json_any),
            "shape": st.one_of(st.lists(dims, min_size=0, max_size=3), st.just([1, DIM]), st.just([3, DIM]), json_any),
        }), json_any),
        "texts": st.one_of(st.lists(st.one_of(st.text(max_size=8), json_any), max_size=4), json_any),
        "metadata": st.one_of(st.lists(st.one_of(st.dictionaries(st.text(max_size=4), json_any), json_any), max_size=4),
                              json_any),
        "created_at": st.one_of(st.lists(any_float, max_size=4), any_float, json_any),
    },
    "delete": {"ids": st.one_of(st.lists(st.one_of(st.integers(), st.integers(-2**70, 2**70), json_any), max_size=6),
                                json_any)},
    "get": {"ids": st.one_of(st.lists(st.one_of(st.integers(), st.integers(-2**70, 2**70), json_any), max_size=6),
                             json_any)},
    "hello": {"protocol": st.one_of(st.just(1), st.just(1.0), json_any), "pid": json_any},
    "stats": {"extra": json_any},
    "compact": {"extra": json_any},
}


@st.composite
def control_case(draw: Any) -> tuple[str, list[tuple[str, Any]], bool, Any]:
    """(kind, parts to send, whether a reply is due, description)."""
    kind = draw(st.sampled_from(["fields"] * 6 + ["random", "truncated", "oversized", "bad-body"]))
    if kind == "random":
        data = draw(st.binary(max_size=200))
        return kind, [("bytes", data)], False, data
    if kind == "oversized":
        json_len = draw(st.one_of(st.integers((1 << 28) + 1, 2**32 - 1), st.just(2**32 - 1)))
        blob_len = draw(st.one_of(st.integers(0, 16), st.integers((1 << 30) + 1, 2**64 - 1), st.just(2**60)))
        if draw(st.booleans()):
            json_len = draw(st.integers(0, 64))
            blob_len = draw(st.integers((1 << 30) + 1, 2**64 - 1))
        return kind, [("bytes", _PREFIX.pack(json_len, blob_len))], True, (json_len, blob_len)
    if kind == "bad-body":
        body = draw(st.one_of(
            st.binary(max_size=100),
            st.sampled_from([b"\xff\xfe{}", b"[]", b"1", b'"op"', b"null", b"{", b'{"op": "stats"', b"\xed\xa0\x80"]),
            st.integers(1000, 100_000).map(lambda d: b"[" * d + b"]" * d),
            st.integers(1000, 100_000).map(lambda d: b'{"op":' * d + b"1" + b"}" * d),
            st.integers(4000, 20_000).map(lambda d: b'{"op":"get","ids":[' + b"9" * d + b"]}"),
        ))
        return kind, [("bytes", _frame(body))], True, body[:80]
    op = draw(st.one_of(st.sampled_from(sorted(FIELDS)), json_any))
    message: dict[str, Any] = {"op": op} if draw(st.sampled_from([True] * 20 + [False])) else {}
    for field, strategy in FIELDS.get(op if isinstance(op, str) else "", {}).items():
        if draw(st.booleans()):
            message[field] = draw(strategy)
    if op in ("delete", "get") and isinstance(message.get("ids"), list):
        # Never delete the honest client's items: they are the oracle's fixed ground.
        message["ids"] = [v + 10**12 if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 10**6 else v
                          for v in message["ids"]]
    blob_kind = draw(st.sampled_from(["none", "random", "matching"]))
    blob = b""
    if blob_kind == "random":
        blob = draw(st.binary(max_size=300))
    elif blob_kind == "matching" and isinstance(message.get("vectors"), dict):
        shape = message["vectors"].get("shape")
        if isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 64 for d in shape):
            count = int(np.prod(shape)) if shape else 1
            blob = np.random.default_rng(count).standard_normal(count).astype("<f4").tobytes()
    body = json.dumps(message, allow_nan=True).encode("utf-8", "surrogatepass")
    parts = [("bytes", _frame(body, blob))]
    if draw(st.sampled_from([False] * 5 + [True])):  # truncated: cut anywhere, then hang up
        cut = draw(st.integers(0, max(0, len(parts[0][1]) - 1)))
        return "truncated", [("bytes", parts[0][1][:cut])], False, message
    if op == "hello" and message.get("protocol") == 1 and not isinstance(message.get("protocol"), bool):
        follow = draw(st.sampled_from(["fd", "junk-fd", "nothing"]))
        if follow != "nothing":
            parts.append((follow, None))
        return kind, parts, follow != "nothing", message
    if op == "hello" and message.get("protocol") is True:
        parts.append(("fd", None))
    return kind, parts, True, message


EXPLICIT = [  # always tried, before the generated cases
    ("2^60 blob", [("bytes", _PREFIX.pack(2, 2**60) + b"{}")], True),
    ("4 GiB json", [("bytes", _PREFIX.pack(2**32 - 1, 0))], True),
    ("nested 100k", [("bytes", _frame(b"[" * 100_000 + b"]" * 100_000))], True),
    ("20k-digit id", [("bytes", _frame(b'{"op":"get","ids":[' + b"7" * 20_000 + b"]}"))], True),
    ("bad utf-8", [("bytes", _frame(b'{"op":"\xff"}'))], True),
    ("lone surrogate escape", [("bytes", _frame(b'{"op":"add","namespace":"\\ud800","vectors":{"dtype":"float32","shape":[1,8]}}',
                                               b"\x00\x00\x80\x3f" * 8))], True),
    ("shape 2^62 x 2^62", [("bytes", _frame(b'{"op":"add","vectors":{"dtype":"float32","shape":[4611686018427387904,4611686018427387904]}}'))], True),
    ("shape 2^63", [("bytes", _frame(b'{"op":"add","vectors":{"dtype":"float32","shape":[9223372036854775808]}}'))], True),
    ("shape 2^40 x 16", [("bytes", _frame(b'{"op":"add","vectors":{"dtype":"int64","shape":[1099511627776,16]}}'))], True),
    ("shape 2^61 x 8 (wraps to 0 bytes)", [("bytes", _frame(b'{"op":"add","vectors":{"dtype":"float32","shape":[2305843009213693952,8]}}'))], True),
    ("hello then hang up", [("bytes", _frame(b'{"op":"hello","protocol":1}'))], False),
    ("hello, junk instead of fd", [("bytes", _frame(b'{"op":"hello","protocol":1}')), ("junk-fd", None)], True),
]


def test_control_socket_fuzz_gets_error_codes_never_a_crash(sidecars, children, store_dir, runtime_dir, scale):
    seed = _seed_value()
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    served = Served(sidecars, children, store_dir, seed)
    counts: dict[str, int] = {}
    replies_seen = [0, 0]

    for label, parts, due in EXPLICIT:
        replies, framed = exchange(str(runtime_dir), served.name, parts)
        replies_seen[1] += check_replies(replies, framed, label, expect_reply=due)
        replies_seen[0] += len(replies)
        assert served.proc.process.poll() is None, f"the sidecar died on {label}"

    def run(case: tuple[str, list, bool, Any]) -> None:
        kind, parts, due, what = case
        counts[kind] = counts.get(kind, 0) + 1
        replies, framed = exchange(str(runtime_dir), served.name, parts)
        replies_seen[1] += check_replies(replies, framed, what, expect_reply=due)
        replies_seen[0] += len(replies)
        assert served.proc.process.poll() is None, f"the sidecar died on {what!r:.300}"

    fuzz = hypothesis_seed(seed)(_fuzz_settings(scale(400, 5000))(given(control_case())(run)))
    fuzz()
    # Still in step: the observer's control calls and the slot path work.
    stats = served.observer.stats()
    assert stats["namespaces"]["honest"] == NAMESPACES["honest"]
    q = served.unit[0].astype(np.float32)
    assert served.observer.recall(q, k=1, namespace=None).ids.tolist() == [int(served.ids[0])]
    honest_answers = served.finish()
    total = sum(counts.values()) + len(EXPLICIT)
    print(f"RELIABILITY hostile-control: frames={total} by_kind={counts} explicit={len(EXPLICIT)} "
          f"replies={replies_seen[0]} error_replies={replies_seen[1]} internal_errors=0 tracebacks=0 "
          f"honest_recalls_checked={honest_answers}")


@pytest.mark.parametrize("where", ["request", "whole-slot"])
def test_scribbling_over_the_whole_slot_with_random_bytes(sidecars, children, store_dir, scale, where):
    """Unstructured: random bytes over the request words or the entire slot, a few hundred times."""
    seed = _seed_value()
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    served = Served(sidecars, children, store_dir, seed)
    rng = np.random.default_rng(seed)
    rogue = Client(served.name, timeout=30.0)
    conn = rogue._conn
    path = f"segment of {served.name}"
    fd = conn.segment.fileno()  # the memfd its hello passed, mapped a second time
    mapping = mmap.mmap(fd, os.fstat(fd).st_size)
    buf = memoryview(mapping)
    layout = Layout.read_header(buf, source=path)
    base = layout.slot_offset(conn.channel.slot.index)
    view = SlotView(buf, layout, conn.channel.slot.index)
    answered = int(view.resp_seq[0])
    statuses: dict[int, int] = {}
    rounds = scale(200, 2000)
    try:
        for _ in range(rounds):
            size = REQUEST_BYTES if where == "request" else layout.slot_size
            buf[base: base + size] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            seq = int(view.req_seq[0])
            if seq == answered:
                continue
            ring(conn.wake.fileno())
            deadline = time.monotonic() + 30
            while int(view.resp_seq[0]) != seq:
                assert time.monotonic() < deadline, "no answer to a random slot"
                time.sleep(0.0001)
            answered = seq
            status = int(view.status[0])
            statuses[status] = statuses.get(status, 0) + 1
            assert status != INTERNAL, view.read_message()
    finally:
        del view
        buf.release()
        mapping.close()
    rogue.close()
    served.finish()
    print(f"RELIABILITY hostile-scribble-{where}: rounds={rounds} statuses={statuses}")



# -- hostile wake-up file descriptors ---------------------------------------------------------------


def _rogue_hello(runtime: str, name: str, wake_fd: int) -> tuple[Any, dict, list[int]]:
    """A raw hello that hands the sidecar ``wake_fd`` as the client's wake-up: (the socket, the
    reply, the descriptors that follow a successful one: the segment)."""
    from kalos.ipc.control import recv_fd

    sock = raw_connection(runtime, name)
    send_frame_raw = _frame(json.dumps({"op": "hello", "protocol": PROTOCOL_VERSION, "pid": os.getpid()}).encode())
    sock.sendall(send_frame_raw)
    socket.send_fds(sock, [b"F"], [wake_fd])
    head = sock.recv(_PREFIX.size, socket.MSG_WAITALL)
    json_len, _ = _PREFIX.unpack(head)
    reply = json.loads(sock.recv(json_len, socket.MSG_WAITALL))
    return sock, reply, [recv_fd(sock)] if reply["ok"] else []


def ring(bell: int) -> None:
    """Rings the sidecar as a client does, through its end of the pair (full: rung already)."""
    try:
        os.write(bell, b"\x01")
    except BlockingIOError:
        pass


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("wake", ["read-only-file", "eventfd", "pipe", "named-unix-socket", "listening-socket",
                                  "udp-socket"])
def test_a_wake_descriptor_that_is_no_socket_pair_end_is_refused_and_not_kept(sidecars, children, store_dir,
                                                                           runtime_dir, wake):
    """The hello's wake descriptor must be one end of a Unix stream socket pair: the only kind
    the sidecar can ring with no flag of the client's making the write block, and none that
    carries its writes to another process's listening socket. Anything else is refused with a
    named error, and the sidecar keeps no descriptor of it (a refused hello leaked one)."""
    served = Served(sidecars, children, store_dir, _seed_value())
    pid = served.proc.process.pid
    keep: list[int] = []
    listener = None
    if wake == "read-only-file":
        fd = os.open("/dev/null", os.O_RDONLY)
    elif wake == "eventfd":  # what protocol 2 passed: its O_NONBLOCK was the client's to clear
        fd = os.eventfd(0, os.EFD_NONBLOCK)
    elif wake == "pipe":
        r, fd = os.pipe()
        keep.append(r)
    elif wake in ("named-unix-socket", "listening-socket"):
        path = os.path.join(str(runtime_dir), f"rogue-{os.getpid()}.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        if wake == "listening-socket":
            fd = os.dup(listener.fileno())
        else:
            other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            other.connect(path)
            fd = other.detach()
    else:
        fd = socket.socket(socket.AF_INET, socket.SOCK_DGRAM).detach()
    keep.append(fd)
    try:
        before = _open_fds(pid)
        for _ in range(20):
            sock, reply, fds = _rogue_hello(str(runtime_dir), served.name, fd)
            sock.close()
            assert not reply["ok"] and reply["code"] == int(ErrorCode.INVALID_ARGUMENT), reply
            assert "wake" in reply["error"], reply
        wait_until(lambda: _open_fds(pid) <= before, "the sidecar to close the refused descriptors")
        # Honest clients are served all along.
        q = served.unit[1].astype(np.float32)
        assert served.observer.recall(q, k=1, namespace=None).ids.tolist() == [int(served.ids[1])]
    finally:
        for k in keep:
            os.close(k)
        if listener is not None:
            listener.close()
    served.finish()


@pytest.mark.parametrize("wake", ["full-blocking", "peer-closed"])
def test_a_rogue_wake_socket_cannot_stop_or_stall_the_sweep(sidecars, children, store_dir, runtime_dir, scale, wake):
    """The sidecar writes to each sleeping client's wake socket. A rogue keeps a copy of the end
    it handed over, makes it blocking (the flag is shared with the sidecar's copy) and never
    drains the pair, so that it fills: a plain write would block the sweep, and every client
    with it, for good (an adversarial review found this with protocol 2's eventfd). Or it
    closes its own end, so that every write fails."""
    seed = _seed_value()
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    served = Served(sidecars, children, store_dir, seed)
    theirs, ours_sock = wake_pair()
    ours = ours_sock.detach()
    handed = theirs.detach()
    keep = [ours]
    if wake == "full-blocking":
        blocking = os.dup(handed)
        os.set_blocking(blocking, True)
        keep.append(blocking)
        filler = socket.socket(fileno=os.dup(handed))
        filler.setblocking(False)
        try:
            while True:  # fill the sidecar's direction of the pair (its writes land on ``ours``)
                filler.send(b"x" * 4096)
        except BlockingIOError:
            pass
        filler.close()
    sock, reply, fds = _rogue_hello(str(runtime_dir), served.name, handed)
    os.close(handed)
    assert reply["ok"], reply
    (mfd,) = fds
    if wake == "peer-closed":  # it cannot ring any more: its requests are answered at the sweep's looks
        os.close(ours)
        keep = []
    slot = int(reply["slot"])
    path = f"segment of {served.name}"
    mapping = mmap.mmap(mfd, os.fstat(mfd).st_size)
    os.close(mfd)
    buf = memoryview(mapping)
    layout = Layout.read_header(buf, source=path)
    view = SlotView(buf, layout, slot)
    rounds = scale(1200, 6000) if wake != "peer-closed" else scale(6, 30)  # (unrung: answered at the looks)
    try:
        view.op[0] = int(Op.RECALL)
        view.k[0] = 3
        view.n_queries[0] = 1
        view.flags[0] = 1
        view.queries[0] = 1.0
        for seq in range(1, rounds + 1):
            view.client_sleeping[0] = 1  # "wake me": the sidecar writes to the rogue's socket every time
            view.req_seq[0] = seq
            if wake != "peer-closed":
                ring(ours)
            deadline = time.monotonic() + 30
            while int(view.resp_seq[0]) != seq:
                assert served.proc.process.poll() is None, f"the sidecar died after {seq} requests"
                assert time.monotonic() < deadline, f"the sweep stalled at request {seq}"
                time.sleep(0.0001)
            assert int(view.status[0]) == 0, view.read_message()
    finally:
        del view
        buf.release()
        mapping.close()
        sock.close()
        for k in keep:
            os.close(k)
    q = served.unit[1].astype(np.float32)
    assert served.observer.recall(q, k=1, namespace=None).ids.tolist() == [int(served.ids[1])]
    honest_answers = served.finish()
    print(f"RELIABILITY hostile-wake-socket-{wake}: rounds={rounds} honest_recalls_checked={honest_answers}")


def test_a_rogue_ringing_without_pause_does_not_break_honest_clients(sidecars, children, store_dir, scale):
    """A rogue rings the sidecar through its own bell as fast as it can, while an honest client
    that sleeps between its requests recalls: every honest answer is exact. (With one doorbell
    eventfd shared by every client, a rogue could saturate it, or make it blocking and eat its
    rings; now each client's bell is its own.)"""
    import threading

    seed = _seed_value()
    print(f"random seed: {seed} (replay with KALOS_TEST_SEED={seed})")
    served = Served(sidecars, children, store_dir, seed)
    rogue = Client(served.name, timeout=30.0)
    bell = rogue._conn.wake.fileno()
    stop = threading.Event()
    writes = [0]

    def hammer() -> None:
        while not stop.is_set():
            try:
                os.write(bell, b"x" * 4096)
                writes[0] += 1
            except BlockingIOError:
                time.sleep(0)

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    table_ns = served.namespaces == "honest"
    everything = np.ones(int(table_ns.sum()), bool)
    table = ItemTable.static(served.honest_ids, served.unit[table_ns], ["honest"] * int(table_ns.sum()))
    rng = np.random.default_rng(seed)
    rounds = scale(300, 3000)
    try:
        with Client(served.name, timeout=30.0, spin_us=0) as sleeper:  # rings whenever it asks
            for r in range(rounds):
                time.sleep(float(rng.uniform(0, 0.004)))  # let the sidecar fall asleep between requests
                q = rng.standard_normal(DIM).astype(np.float32)
                hit = sleeper.recall(q, k=5, namespace="honest")
                problem = check_row(q, 5, hit.ids, hit.scores, table, everything, everything)
                assert problem is None, f"round {r}: {problem}"
    finally:
        stop.set()
        thread.join(timeout=DEADLINE_S)
        rogue.close()
    honest_answers = served.finish()
    print(f"RELIABILITY hostile-bell: rounds={rounds} rogue_writes={writes[0]} "
          f"honest_recalls_checked={honest_answers + rounds}")


def test_a_connection_flood_leaves_the_sidecar_serving_afterwards(sidecars, children, store_dir, runtime_dir):
    """Connections until the sidecar runs out of file descriptors; once they close, all is as before."""
    import resource

    seed = _seed_value()
    served = Served(sidecars, children, store_dir, seed)
    # Reached in a second rather than at the usual tens of thousands (same uid: no privilege needed).
    resource.prlimit(served.proc.pid, resource.RLIMIT_NOFILE, (128, 128))
    flood: list[socket.socket] = []
    try:
        stuck_since = None
        while len(flood) < 400:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(1.0)
            try:
                s.connect(str(runtime_dir / f"{served.name}.sock"))
            except BlockingIOError:  # the backlog is full: the sidecar is not accepting (for now?)
                s.close()
                stuck_since = stuck_since or time.monotonic()
                if time.monotonic() - stuck_since > 2.0:
                    break  # for good: it is out of descriptors
                time.sleep(0.01)
                continue
            stuck_since = None
            flood.append(s)
        time.sleep(0.5)
        # Meanwhile the clients that are connected already keep working (checked by the honest one).
        q = served.unit[2].astype(np.float32)
        assert served.observer.recall(q, k=1, namespace=None).ids.tolist() == [int(served.ids[2])]
    finally:
        for s in flood:
            s.close()
    assert len(flood) > 100, f"only {len(flood)} connections: the flood did not reach the limit"
    with Client(served.name, timeout=30.0) as late:  # accepted again once descriptors are free
        assert late.stats()["count"] == sum(NAMESPACES.values())
    honest_answers = served.finish()
    print(f"RELIABILITY hostile-flood: connections={len(flood)} fd_limit=128 then_new_client=ok "
          f"honest_recalls_checked={honest_answers}")
