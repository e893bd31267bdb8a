"""How a client reads the items in a sidecar's replies (recall_text, get, list): a field it does
not know (a newer sidecar's) is left out, a sidecar from before keys sends none, and a reply
that does not make items or hits is a ProtocolMismatch, not a TypeError or a KeyError. The
sidecar is a stub that answers every control message with a canned reply."""
from __future__ import annotations

import threading
from typing import Any

import pytest

from kalos import Client
from kalos.errors import ProtocolMismatch

ITEM = {"id": 7, "namespace": "n", "text": "t", "metadata": {"m": 1}, "created_at": 1.5, "key": "k",
        "updated_at": 2.5, "expires_at": None}


def stub_client(reply: dict[str, Any]) -> Client:
    client = object.__new__(Client)
    client._lock = threading.RLock()
    client._control = lambda message, blob=b"": (reply, bytearray())
    client._resync_slot = lambda: None
    return client


def recall_text(reply: dict[str, Any]) -> list[list[Any]]:
    return stub_client(reply)._recall_texts_in_sidecar(["q"], 8, "n", None, None, None)


def test_a_hit_is_its_items_fields_and_a_field_this_client_does_not_know_is_left_out():
    (hits,) = recall_text({"hits": [[[7, 0.5]]], "items": [{**ITEM, "added_later": [1, 2]}]})
    (hit,) = hits
    assert (hit.id, hit.score, hit.text, hit.metadata, hit.namespace, hit.created_at, hit.key, hit.updated_at) == (
        7, 0.5, "t", {"m": 1}, "n", 1.5, "k", 2.5)


def test_a_sidecar_from_before_keys_sends_no_key_fields():
    before_keys = {name: value for name, value in ITEM.items() if name not in ("key", "updated_at", "expires_at")}
    (hits,) = recall_text({"hits": [[[7, 0.5]]], "items": [before_keys]})
    assert (hits[0].key, hits[0].updated_at) == (None, None)
    (item,) = stub_client({"items": [before_keys]}).get(ids=[7])
    assert (item.key, item.updated_at, item.expires_at) == (None, None, None)


@pytest.mark.parametrize("reply", [
    {"hits": [[[7, 0.5]]], "items": [None]},
    {"hits": [[[7, 0.5]]], "items": [{name: value for name, value in ITEM.items() if name != "text"}]},
    {"hits": [[[7, None]]], "items": [ITEM]},
    {"hits": [[7]], "items": [ITEM]},
    {"items": [ITEM]},
    {"hits": None, "items": [ITEM]},
    {"hits": [[[7, 0.5]], []], "items": [ITEM]},
])
def test_a_recall_text_reply_that_makes_no_hits_is_a_protocol_mismatch(reply):
    with pytest.raises(ProtocolMismatch, match="recall_text"):
        recall_text(reply)


def test_get_and_list_leave_out_a_field_they_do_not_know_and_refuse_items_they_cannot_make():
    newer = {**ITEM, "added_later": True, "vector": None}  # (a sidecar from before the vector's blob sent it)
    (item,) = stub_client({"items": [newer]}).get(ids=[7])
    assert (item.id, item.text, item.key, item.vector) == (7, "t", "k", None)
    page = stub_client({"items": [newer], "next": None}).list(namespace="n")
    assert [item.id for item in page.items] == [7] and page.next_cursor is None
    without_text = {name: value for name, value in ITEM.items() if name != "text"}
    with pytest.raises(ProtocolMismatch, match="get was answered with a malformed item"):
        stub_client({"items": [without_text]}).get(ids=[7])
    with pytest.raises(ProtocolMismatch, match="list was answered with a malformed item"):
        stub_client({"items": [[1, 2]], "next": None}).list(namespace="n")
    with pytest.raises(ProtocolMismatch, match="get of 1 ids was answered with NoneType items"):
        stub_client({"items": None}).get(ids=[7])
