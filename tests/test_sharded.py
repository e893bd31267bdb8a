"""ShardedEngine: rows split across engines, searched together, merged exactly.

On the CPU: shards are TorchEngines on PyTorch's CPU device (the plain torch backend, and the
Triton kernels under the interpreter), checked against the float64 brute force of
test_torch_engine's Mirror. On a GPU (marked cuda): two shards on one card, and one per card
when there are several.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_torch_engine import (  # noqa: E402  (_interpreter_env: the autouse fixture, per test)
    FILTERS,
    HAVE_CUDA,
    Mirror,
    _interpreter_env,
    needs_interpreter,
    rng,
    unit_queries,
)

from kalos import Client  # noqa: E402
from kalos.engine import Engine, Filter, make_engine  # noqa: E402
from kalos.engine.gpu import TorchEngine  # noqa: E402
from kalos.engine.sharded import ShardedEngine, merge_topk  # noqa: E402
from kalos.errors import InvalidArgument  # noqa: E402

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")


def cpu_shards(n: int, dim: int, backend: str = "torch", **kw) -> ShardedEngine:
    return ShardedEngine([TorchEngine(dim, device="cpu", backend=backend, capacity=8, **kw) for _ in range(n)])


def add_batches(m: Mirror, sizes) -> list[np.ndarray]:
    return [m.add(size) for size in sizes]


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_three_shards_match_the_reference(rng, precision):
    eng = cpu_shards(3, 24, precision=precision)
    assert isinstance(eng, Engine)
    m = Mirror(eng, rng)
    batches = add_batches(m, [50, 30, 40, 20, 60])
    # Each batch went whole to the emptiest shard: 50 | 30+20 | 40, then 60 to the 40.
    assert sorted(eng.shard_sizes()) == [50, 50, 100]
    assert len(eng) == 200
    m.delete(np.concatenate([b[::5] for b in batches]))
    assert len(eng) == 200 - sum(len(b[::5]) for b in batches)
    q = unit_queries(rng, 4, 24)
    for flt in FILTERS:
        for k in (1, 7, 300):  # 300: more than any shard holds, padding merged last
            m.check(q, k, flt)
    groups = [(q[:3], 5, FILTERS[0]), (q[3:], 300, FILTERS[-1])]  # (a sidecar's mixed pass)
    for (queries, k, flt), (ids, _scores) in zip(groups, eng.search_groups(groups)):
        np.testing.assert_array_equal(ids, eng.search(queries, k, flt)[0])
    eng.compact()
    assert eng.tombstones == 0
    m.check(q, 10)
    assert batches[0][3] in eng and batches[0][0] not in eng  # ids 0, 5, ... were deleted


def test_adds_reject_an_id_another_shard_holds(rng):
    eng = cpu_shards(2, 8)
    vec = np.eye(8, dtype=np.float32)[:2]
    eng.add(np.array([1, 2]), vec, 0, 0.0)
    eng.add(np.array([3, 4]), vec, 0, 0.0)  # the other shard
    with pytest.raises(InvalidArgument, match="already present"):
        eng.add(np.array([5, 1]), vec, 0, 0.0)
    assert len(eng) == 4 and 5 not in eng


def test_an_add_goes_where_the_room_is_so_nothing_grows_after_the_room_was_made(rng):
    """The sidecar makes room before the store commits (has_room, reserve: issue 19), and an
    update then deletes the old row before it adds the new one: the delete moves the fewest
    live rows to a full shard, and the add must still go where the room is, growing nothing."""
    eng = cpu_shards(2, 8)
    vec = unit_queries(rng, 15, 8)
    eng.add(np.arange(8), vec[:8], 0, 0.0)  # shard 0 full (capacity 8)
    eng.add(np.arange(8, 15), vec[8:], 0, 0.0)  # shard 1: 7 of 8
    capacities = [shard.capacity for shard in eng.shards]
    assert eng.has_room(1) and not eng.has_room(2)
    eng.reserve(1)  # nothing to do: shard 1 holds one more
    eng.delete(np.array([3]))  # shard 0 now has the fewest live rows, and no room
    eng.add(np.array([3]), vec[3:4], 0, 0.0)
    assert [shard.capacity for shard in eng.shards] == capacities and 3 in eng.shards[1]
    eng.reserve(2)  # no shard holds two more: the one with the fewest live rows grows
    assert eng.has_room(2) and sum(shard.capacity for shard in eng.shards) > sum(capacities)


@needs_interpreter
def test_triton_shards_through_search_start(rng):
    """The shards' start-then-wait path with the Triton kernels (interpreter). On the CPU a
    start runs to completion; the overlap of shards is a CUDA matter (test_cuda_shards)."""
    eng = cpu_shards(2, 40, backend="triton")
    m = Mirror(eng, rng)
    add_batches(m, [120, 90])
    q = unit_queries(rng, 2, 40)
    m.check(q[:1], 8, Filter(namespace=1))
    m.check(q, 5)


def test_batches_larger_than_a_shard_round(rng):
    """More queries than a shard's max_batch: searched in rounds, answers in query order."""
    eng = ShardedEngine([TorchEngine(16, device="cpu", backend="torch", max_batch=3) for _ in range(2)])
    m = Mirror(eng, rng)
    add_batches(m, [40, 40])
    m.check(unit_queries(rng, 8, 16), 5)


def test_a_failing_shard_does_not_leave_the_others_pending(rng):
    eng = cpu_shards(2, 8)
    Mirror(eng, rng).add(20)
    started = []

    class Broken:
        def __call__(self):
            raise RuntimeError("shard 0 failed")

    real = eng.shards[1].search_start

    def second(*args, **kwargs):
        wait = real(*args, **kwargs)

        def waited():
            started.append(True)
            return wait()
        return waited

    eng.shards[0].search_start = lambda *a, **k: Broken()
    eng.shards[1].search_start = second
    with pytest.raises(RuntimeError, match="shard 0 failed"):
        eng.search(unit_queries(rng, 1, 8), 3)
    assert started == [True]  # the healthy shard was awaited all the same


def test_capabilities_are_declared_and_shards_are_checked_by_them():
    """What an engine can do beyond search is declared on its class (kalos.engine.base) and read
    once: a NumPy shard, which cannot queue a search, is refused by name."""
    from kalos.engine import NumpyEngine

    cpu = NumpyEngine(8)
    assert not (cpu.supports_search_start or cpu.supports_attached_host or cpu.supports_streams
                or cpu.supports_gpu_polling) and cpu.max_k is None
    gpu_engine = TorchEngine(8, device="cpu", backend="torch")
    assert gpu_engine.supports_search_start and gpu_engine.supports_attached_host and gpu_engine.supports_streams
    assert not gpu_engine.supports_gpu_polling  # the slot server runs the Triton kernels on CUDA only
    with pytest.raises(InvalidArgument, match="search_start"):
        ShardedEngine([gpu_engine, cpu])
    sharded = cpu_shards(2, 8)
    assert sharded.max_k == TorchEngine.max_k and sharded.supports_streams
    assert not (sharded.supports_attached_host or sharded.supports_gpu_polling or sharded.supports_search_start)


def test_merge_topk_keeps_order_ties_and_padding():
    a = (np.array([[10, 11, -1]]), np.array([[0.9, 0.5, -np.inf]], np.float32))
    b = (np.array([[20, 21, 22]]), np.array([[0.7, 0.5, 0.1]], np.float32))
    ids, scores = merge_topk([a, b], 4)
    np.testing.assert_array_equal(ids, [[10, 20, 11, 21]])  # the tie at 0.5: first answer first
    np.testing.assert_array_equal(scores, np.array([[0.9, 0.7, 0.5, 0.5]], np.float32))
    ids, scores = merge_topk([a, (np.array([[-1, -1, -1]]), np.full((1, 3), -np.inf, np.float32))], 3)
    np.testing.assert_array_equal(ids, [[10, 11, -1]])


def test_device_strings():
    for bad in ("cuda:x", "tpu", "cuda:0,tpu", "", "cuda:0,,cuda:1"):
        with pytest.raises(InvalidArgument):
            make_engine(bad, 8)
    with pytest.raises(InvalidArgument, match="at least one shard"):
        ShardedEngine([])
    same = TorchEngine(4, device="cpu", backend="torch")
    with pytest.raises(InvalidArgument, match="listed twice"):
        ShardedEngine([same, same])
    with pytest.raises(InvalidArgument, match="one dimension"):
        ShardedEngine([TorchEngine(4, device="cpu", backend="torch"), TorchEngine(5, device="cpu", backend="torch")])
    if not HAVE_CUDA:
        with pytest.raises(InvalidArgument):
            make_engine("cuda:all", 8)


def test_sidecar_serves_a_sharded_engine(rng, runtime_dir, tmp_path):
    from kalos.server.sidecar import Sidecar, SidecarConfig

    d = 16
    config = SidecarConfig(store=tmp_path / "m.db", name="sh", dim=d, slots=4)
    sidecar = Sidecar(config, engine_factory=lambda _dev, dim, cap: cpu_shards(2, dim))
    thread = threading.Thread(target=sidecar.serve_forever, daemon=True)
    thread.start()
    try:
        with Client("sh", timeout=30) as client:
            vectors = rng.standard_normal((90, d)).astype(np.float32)
            ids = np.concatenate([client.add(vectors[:40]), client.add(vectors[40:])])
            assert sorted(sidecar.engine.shard_sizes()) == [40, 50]
            assert client.stats()["engine"].startswith("sharded-2x")
            unit = vectors / np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
            q = rng.standard_normal((3, d)).astype(np.float32)
            got = client.recall_many(q, k=6)
            ref = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ unit.T
            for i in range(3):
                np.testing.assert_array_equal(got[i].ids, ids[np.argsort(-ref[i], kind="stable")[:6]])
            client.delete(ids[:45].tolist())
            assert len(sidecar.engine) == 45
    finally:
        sidecar.stop()
        thread.join(timeout=30)


@cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_cuda_shards(rng, precision):
    """Two shards on card 0, and one per card with cuda:all when there are several."""
    for device in ("cuda:0,cuda:0",) + (("cuda:all",) if torch.cuda.device_count() > 1 else ()):
        eng = make_engine(device, 256, precision=precision)
        assert isinstance(eng, ShardedEngine)
        m = Mirror(eng, rng)
        ids = np.concatenate(add_batches(m, [3000, 2500, 2000]))
        m.delete(rng.choice(ids, 300, replace=False))
        q = unit_queries(rng, 5, 256)
        for flt in FILTERS[:3]:
            for k in (1, 8, 256):
                m.check(q[:1], k, flt)
                m.check(q, k, flt)
