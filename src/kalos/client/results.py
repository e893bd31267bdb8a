"""What a client's calls return: :class:`Recall` and :class:`RecallBatch` (ids and scores),
:class:`Hit` (a recalled text memory), :class:`Page` (one page of a listing), and how they are
read from a slot or from a reply's fields (:class:`~kalos.validation.Item` is the stores').
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from kalos.engine.base import MISSING_ID
from kalos.errors import ProtocolMismatch
from kalos.validation import Item

__all__ = ["Recall", "RecallBatch", "Hit", "Page", "item_from_reply", "single_hits"]


@dataclass(frozen=True)
class Recall:
    """The hits of one query, best first: ``ids`` (int64 store ids) and ``scores`` (float32 cosine)."""

    ids: np.ndarray
    scores: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return zip(self.ids.tolist(), self.scores.tolist())

    def __repr__(self) -> str:
        if not len(self):
            return "Recall(0 hits)"
        return f"Recall({len(self)} hits, best id={int(self.ids[0])} score={float(self.scores[0]):.4f})"


@dataclass(frozen=True)
class RecallBatch:
    """The hits of Q queries: ``ids[Q, k]``, ``scores[Q, k]``; missing hits are id -1, score -inf."""

    ids: np.ndarray
    scores: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Recall:
        ids, scores = self.ids[i], self.scores[i]
        n = int(np.count_nonzero(ids != MISSING_ID))
        return Recall(ids[:n], scores[:n])

    def __iter__(self) -> Iterator[Recall]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"RecallBatch({len(self)} queries, k={self.ids.shape[1] if self.ids.ndim == 2 else 0})"


#: The fields of an Item a reply carries (its vector travels apart, in the reply's blob).
_REPLY_ITEM_FIELDS = frozenset(field.name for field in dataclasses.fields(Item)) - {"vector"}


def item_from_reply(fields: Any, op: str) -> Item:
    """The Item of a reply's fields: a field this client does not know (a newer sidecar's) is
    left out; fields that do not make an Item are a ProtocolMismatch."""
    try:
        return Item(**{name: value for name, value in fields.items() if name in _REPLY_ITEM_FIELDS})
    except (AttributeError, TypeError) as exc:
        raise ProtocolMismatch(f"{op} was answered with a malformed item: {exc}") from None


@dataclass(frozen=True)
class Hit:
    """One recalled text memory: ``id``, cosine ``score``, ``text``, ``metadata``, ``namespace``,
    ``created_at``, ``key`` (None for an item added without one), ``updated_at`` (None until an upsert revised it)."""

    id: int
    score: float
    text: str | None
    metadata: dict[str, Any] | None
    namespace: str
    created_at: float
    key: str | None = None  # defaults: Hit(...) calls written before keys still build
    updated_at: float | None = None

    @classmethod
    def from_item(cls, item: Item, score: float) -> "Hit":
        return cls.from_fields(vars(item), score)  # (an Item's attributes are the fields a reply names)

    @classmethod
    def from_fields(cls, fields: dict[str, Any], score: float) -> "Hit":
        """The Hit of an item as a reply carries it (its JSON fields); a field this client does
        not know (a newer sidecar's) is left out, and a sidecar from before keys sends none."""
        return cls(id=fields["id"], score=float(score), text=fields["text"], metadata=fields["metadata"],
                   namespace=fields["namespace"], created_at=fields["created_at"], key=fields.get("key"),
                   updated_at=fields.get("updated_at"))

    def __repr__(self) -> str:
        text = (self.text or "").replace("\n", " ")
        return f"Hit(id={self.id}, score={self.score:.4f}, text={text[:60] + ('...' if len(text) > 60 else '')!r})"


@dataclass(frozen=True)
class Page:
    """One page of :meth:`kalos.Client.list`: its ``items`` and the ``next_cursor`` (None: the last page)."""

    items: list[Item]
    next_cursor: str | None

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Item]:
        return iter(self.items)

    def __repr__(self) -> str:
        return f"Page({len(self.items)} items, next_cursor={self.next_cursor!r})"


def single_hits(ids: np.ndarray, scores: np.ndarray, k: int) -> Recall:
    """A single recall's answer straight from its slot's first row of hits (``ids``, ``scores``):
    its ``k`` hits, without the -1 / -inf padding."""
    hits = ids[:k].copy()
    hit_scores = scores[:k].copy()
    if hits[k - 1] == MISSING_ID:  # fewer than k matched: the padding trails the hits
        n = int(np.argmax(hits == MISSING_ID))
        hits, hit_scores = hits[:n], hit_scores[:n]
    return Recall(hits, hit_scores)
