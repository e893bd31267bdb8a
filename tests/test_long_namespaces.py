"""Namespaces longer than the 64 bytes the GPU's polling kernels compare (issue 22: names of up to
255 UTF-8 bytes): the slot server keeps them out of its device table, so a request naming one
is handed to the host, and two long names that agree on their first 64 bytes never answer for
each other. Under the Triton interpreter on the CPU, as tests/test_slot_server.py.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from reference import assert_topk_matches  # noqa: E402
from test_slot_server import Rig, _interpreter_env, make_rig, needs_interpreter, rng  # noqa: E402,F401  (fixtures)


@needs_interpreter
def test_names_past_64_bytes_are_handed_to_the_host(make_rig, rng):
    rig: Rig = make_rig()
    prefix = b"users/alice/memories/" + b"x" * 43  # 64 bytes: the part the kernels compare
    assert len(prefix) == 64
    long_a, long_b = prefix + b"/session-1", prefix + b"/session-2"  # same length, same first 64 bytes
    rig.server.set_namespaces({b"a": 0, b"b": 1, long_a: 0, long_b: 1})
    q = rng.standard_normal(rig.engine.dim).astype(np.float32)
    for name in (long_a, long_b, prefix + b"/other"):
        seq = rig.submit(0, q, 4, flags=0, namespace=name)
        rig.server.start(rig.active)
        assert int(rig.server.handed[0]) == seq, f"{name!r} was not handed to the host"
        assert int(rig.views[0].resp_seq[0]) != seq, f"the kernel answered {name!r} itself"
    # A name of exactly 64 bytes is still the kernel's own.
    rig.server.set_namespaces({b"a": 0, b"b": 1, prefix: 1})
    seq = rig.submit(0, q, 4, flags=0, namespace=prefix)
    rig.server.start(rig.active)
    view = rig.views[0]
    assert int(view.resp_seq[0]) == seq
    assert_topk_matches(view.ids[:1, :4], view.scores[:1, :4], rig.ids, rig.vectors, q[None], 4,
                        rig.live & (rig.namespaces == 1), context="64-byte name")
