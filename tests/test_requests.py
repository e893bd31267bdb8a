"""kalos.client.requests: the checks of a call's arguments, without a sidecar."""
from __future__ import annotations

import pytest

from kalos.client.requests import request_words
from kalos.errors import InvalidQuery


@pytest.mark.parametrize("first, then", [(1, True), (0, False), (1.0, True)])
def test_a_bool_time_is_refused_after_an_equal_number_was_remembered(first, then):
    """request_words remembers the words of plain-number windows; True == 1 and hashes alike, so
    since=True found since=1's words and was accepted, though refused in a fresh process."""
    ns = f"memo-{first!r}"
    request_words(4, ns, first, None)
    request_words(4, ns, None, first + 1)
    request_words(4, ns, None, first)
    with pytest.raises(InvalidQuery, match="since must be unix seconds or a datetime, got bool"):
        request_words(4, ns, then, None)
    with pytest.raises(InvalidQuery, match="until must be unix seconds or a datetime, got bool"):
        request_words(4, ns, None, then)


def test_remembered_words_are_those_computed_afresh():
    words = request_words(3, "memo-words", 10, 20.5)
    assert request_words(3, "memo-words", 10, 20.5) == words == (3, 6, 10.0, 20.5, b"memo-words")
