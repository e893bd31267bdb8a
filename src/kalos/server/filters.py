"""The filter cache: the engine filter each request's words describe (flags, namespace, time
window, where handle), validated once and then cached; and the where clauses registered over the
control socket, which a request names by handle.

The recall loop reads it on every request (bound once, kalos.server.recall_loop); the control
operations register where clauses into it (kalos.server.operations).
"""
from __future__ import annotations

import collections
import secrets
import threading

import numpy as np

from kalos.engine import Filter
from kalos.errors import InvalidArgument, InvalidQuery, UnknownFilter
from kalos.ipc.protocol import RequestFlag
from kalos.validation import check_namespace
from kalos.where import Where

__all__ = ["FilterCache", "FilterKey", "NOTHING"]

# Plain ints: IntFlag arithmetic costs microseconds, and these are tested on every request.
_ALL_NAMESPACES = int(RequestFlag.ALL_NAMESPACES)
_HAS_WHERE = int(RequestFlag.HAS_WHERE)
# Registered where clauses a sidecar keeps (op "where"); the oldest registration goes first.
_MAX_WHERE_HANDLES = 4096

#: The filter of a namespace that never held a memory (issue 22): answered with no hits, without
#: a search. Compared by identity, and never cached, so that the namespace's first add (or a
#: follower's) is seen by the next recall.
NOTHING = Filter(namespace=-1)

#: What identifies a request's filter: (flags, namespace, since, until, where handle).
FilterKey = tuple[int, bytes, float | None, float | None, int]


class FilterCache:
    """The engine filter of each request's words, validated once and then cached; and the where
    clauses registered over the control socket (op "where"), which a request names by handle.

    ``namespaces`` (name bytes -> id) is the sidecar's map, which its writers keep up to date.
    """

    def __init__(self, namespaces: dict[bytes, int]) -> None:
        self.namespaces = namespaces
        self.cached: dict[FilterKey, Filter] = {}
        # Registered clauses: handle -> clause and canonical JSON -> handle, oldest first (the
        # table is bounded: _MAX_WHERE_HANDLES). Handles are never reused and start at random,
        # so a stale handle (evicted, or from before a restart) is refused as unknown, never
        # read as another clause.
        self.wheres: dict[int, Where] = {}
        self._handles: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._next_handle = secrets.randbits(48) | 1
        self._lock = threading.Lock()

    def register(self, where: Where) -> int:
        """The handle of ``where``: the one it already has, or a new one (the oldest
        registration is evicted past ``_MAX_WHERE_HANDLES``)."""
        with self._lock:
            handle = self._handles.get(where.key)
            if handle is not None:
                self._handles.move_to_end(where.key)
            else:
                handle = self._next_handle
                self._next_handle += 1
                self.wheres[handle] = where
                self._handles[where.key] = handle
                while len(self._handles) > _MAX_WHERE_HANDLES:
                    _key, old = self._handles.popitem(last=False)
                    del self.wheres[old]
        return handle

    def get(self, key: FilterKey) -> Filter:
        """The engine filter of a request's words ``key``: the cached one, else :meth:`filter_for`'s
        (a KalosError names what is wrong with them)."""
        flt = self.cached.get(key)
        return flt if flt is not None else self.filter_for(*key)

    def filter_for(self, flags: int, namespace_bytes: bytes, since: float | None, until: float | None,
                   where_handle: int = 0) -> Filter:
        """The engine filter a request's words describe (validated, then cached)."""
        where = None
        if flags & _HAS_WHERE:
            where = self.wheres.get(where_handle)
            if where is None:
                raise UnknownFilter(
                    f"where handle {where_handle} is not registered with this sidecar (it restarted, or the "
                    "handle was evicted): register the clause again"
                )
        namespace = None
        if not flags & _ALL_NAMESPACES:
            namespace = self.namespaces.get(namespace_bytes)
            if namespace is None:
                # A name no add ever used: a valid one holds nothing yet (a new user's first
                # recall), so it is answered with no hits (issue 22); a malformed one is still
                # the caller's error, named.
                try:
                    check_namespace(namespace_bytes.decode("utf-8"))
                except UnicodeDecodeError:
                    shown = namespace_bytes.decode("utf-8", "replace")
                    raise InvalidQuery(f"namespace {shown!r} is not valid UTF-8") from None
                except InvalidArgument as exc:  # too long, control characters: a bad query
                    raise InvalidQuery(str(exc)) from None
        for label, value in (("since", since), ("until", until)):
            if value is not None and not np.isfinite(value):
                raise InvalidQuery(f"{label} must be a finite time, got {value}")
        if since is not None and until is not None and since >= until:
            raise InvalidQuery(f"empty time range: since={since} is not before until={until}")
        if not flags & _ALL_NAMESPACES and namespace is None:
            return NOTHING
        if len(self.cached) >= 1024:  # clients sweeping time windows: keep the cache bounded
            self.cached.clear()
        flt = Filter(namespace, since, until, where)
        self.cached[(flags, namespace_bytes, since, until, where_handle)] = flt
        return flt
