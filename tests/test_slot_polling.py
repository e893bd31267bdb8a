"""kalos.server.slot_polling: how clients come and go while the GPU polls the slots.

A hello takes a slot without stopping the polling kernel whenever a free slot is quiet (its
last request answered), and mirrors the slot table into the kernel's in-use words; the kernel
is stopped only when every free slot still holds an unanswered request; a client that leaves
never stops it. The kernel is a fake that records its stops (its own side of the contract:
tests/test_slot_server.py); the channel and its segment are the real ones.
"""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest
from conftest import unique_name

from kalos.ipc.channel import SidecarChannel, wake_pair
from kalos.ipc.protocol import Layout, rest_seq
from kalos.ipc.segment import Segment
from kalos.server.slot_polling import SlotPolling
from kalos.server.state_lock import StateLock


class FakeServer:
    """The slot server's side that SlotPolling uses: its in-use and taken words, and its stops
    (with the slot table as each stop found it)."""

    def __init__(self, channel: SidecarChannel) -> None:
        self.channel = channel
        self.in_use = np.zeros(channel.layout.n_slots, np.int64)
        self.taken = np.zeros(channel.layout.n_slots, np.int64)
        self.stops: list[list[bool]] = []

    def stop(self) -> None:
        self.stops.append(self.channel.active.tolist())


@pytest.fixture
def polled():
    layout = Layout(3, 4, 4, 1)
    segment = Segment.create(unique_name("polling"), layout.size)
    layout.write_header(segment.buf, epoch=1, pid=os.getpid())
    channel = SidecarChannel(segment, layout, epoch=1)
    polling = SlotPolling(StateLock())
    server = FakeServer(channel)
    yield channel, polling, server
    channel.close()
    segment.close()


def _wake_fd() -> socket.socket:
    return wake_pair()[0]


def test_clients_come_and_go_without_stopping_the_kernel(polled):
    channel, polling, server = polled
    assert polling.admit(channel, _wake_fd()) == 0  # no GPU polling yet: the first free slot
    polling.install(server, channel)
    assert server.in_use.tolist() == [1, 0, 0]  # the table so far, mirrored at install
    assert polling.admit(channel, _wake_fd()) == 1
    assert server.in_use.tolist() == [1, 1, 0] and server.stops == []
    polling.release(channel, 0)
    assert server.in_use.tolist() == [0, 1, 0] and server.stops == []
    assert polling.admit(channel, _wake_fd()) == 0 and server.stops == []
    assert int(channel.columns.req_seq[0]) == rest_seq(int(channel.generation[0])) == int(channel.answered[0])


def test_a_slot_left_with_a_request_in_flight_is_handed_out_last_and_only_after_a_stop(polled):
    channel, polling, server = polled
    polling.install(server, channel)
    for slot in range(3):
        assert polling.admit(channel, _wake_fd()) == slot
    channel.columns.req_seq[1] = channel.answered[1] + np.uint64(1)  # slot 1's client asks, then dies
    polling.release(channel, 1)
    polling.release(channel, 2)
    # The kernel may hold slot 1's request and answer it later: a quiet slot goes first.
    assert polling.admit(channel, _wake_fd()) == 2 and server.stops == []
    # Only slot 1 is left: the kernel is stopped before it changes hands, and it changes hands at rest.
    assert polling.admit(channel, _wake_fd()) == 1 and server.stops == [[True, False, True]]
    assert int(channel.columns.req_seq[1]) == int(channel.answered[1]) == rest_seq(int(channel.generation[1]))
    assert polling.admit(channel, _wake_fd()) is None and len(server.stops) == 1  # all in use: no stop either
    assert server.in_use.tolist() == [1, 1, 1]


def test_a_slot_a_round_still_holds_is_not_handed_out_whatever_its_words_say(polled):
    # The previous client asked, the kernel took the request, and the client wrote its req_seq
    # back to the last answered number before it left: only the kernel's taken word tells.
    channel, polling, server = polled
    polling.install(server, channel)
    for slot in range(2):
        assert polling.admit(channel, _wake_fd()) == slot
    server.taken[0] = int(channel.answered[0]) + 1  # a round holds slot 0's request
    polling.release(channel, 0)
    assert int(channel.columns.req_seq[0]) == int(channel.answered[0])  # its words look quiet
    assert polling.admit(channel, _wake_fd()) == 2 and server.stops == []
    polling.release(channel, 1)
    assert polling.admit(channel, _wake_fd()) == 1 and server.stops == []
    # Slot 0 is the only one free: handed out only after the kernel stopped (its rounds done).
    assert polling.admit(channel, _wake_fd()) == 0 and server.stops == [[False, True, True]]
