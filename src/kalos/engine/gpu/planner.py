"""What a batch scans and how: the scan kinds, the typed tuning table, and the launch plan.

A scan *kind*: "f32" reads the float32 rows and is exact as it stands; "f16" reads the 16-bit
copy, "tf32" the float32 rows through the tensor cores in tf32 (exact batches) and "i8" the
8-bit copy (a single fast query): all three keep a candidate set and end in the certified
float32 re-score (:mod:`kalos.engine.gpu.bounds`). A :class:`Plan` is everything the launches
of one (kind, query bucket, k bucket) need: tiles, grid, merge levels, the final kernel's
shape. Why the defaults are what they are: ``docs/gpu-kernels.md``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from kalos.errors import InvalidArgument

__all__ = [
    "MAX_K", "MAX_FAST_K", "ScanConfig", "Tuning", "DEFAULT_TUNING", "Plan", "Planner", "next_pow2", "k_bucket",
    "fast_candidates",
    "SPLIT_MAX_CANDIDATES", "STAGE_SPLIT_MAX",
]

#: Largest k a search may ask for. The fast (16-bit) path serves k <= MAX_FAST_K; beyond it
#: a fast engine answers with the exact float32 scan.
MAX_K = 1024
MAX_FAST_K = 256
#: Groups of score_chunk / GROUPS_PER_CHUNK scores give the group maxima of the threshold
#: selection (kalos.engine.gpu.kernels.select).
GROUPS_PER_CHUNK = 16
_THRESHOLD_MAX_K = 64  # larger candidate sets (k > 16) keep the per-chunk top-K
#: Most programs that may read one query of a polling round (Tuning.stage_split).
STAGE_SPLIT_MAX = 32
#: Most candidates per query whose re-score a batch's final kernel splits over programs
#: (Tuning.final_split_rows): each program of a split selects among all of them again, so a
#: larger split multiplies that work; split and measured up to KF = 64 (k <= 16) only.
SPLIT_MAX_CANDIDATES = 64


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def k_bucket(k: int) -> int:
    """Columns the final kernel writes for k: a power of two, at least 4."""
    return max(4, next_pow2(k))


def fast_candidates(k: int) -> int:
    """Candidates the fast path keeps for k (KF in :mod:`kalos.engine.gpu.bounds`)."""
    kp = k_bucket(k)
    return min(max(32, 4 * kp), max(2 * kp, 256))


@dataclass(frozen=True)
class ScanConfig:
    """Tile shape of the scan kernel; ``progs`` = programs per query block (0: from occupancy;
    -m: m per SM); ``maxnreg``: registers per thread the compiler may use (0: its choice)."""

    block_n: int
    block_d: int
    block_q: int
    warps: int
    stages: int
    progs: int = 0
    maxnreg: int = 0


# The tuning keys of the dict form (benchmarks pass variants as {key: value}): a string names
# a field of Tuning; (half, batched) a fused scan's tile; ("scores", half, "i8" or "fma", batched) the
# tile of a score-writing scan.
_TILE_FIELDS = {
    (False, False): "fused_f32_single", (True, False): "fused_f16_single",
    (False, True): "fused_f32_batch", (True, True): "fused_f16_batch",
    ("scores", False, False): "scores_f32_single", ("scores", True, False): "scores_f16_single",
    ("scores", False, True): "scores_f32_batch", ("scores", True, True): "scores_f16_batch",
    ("scores", "i8", False): "scores_i8_single", ("scores", "fma", True): "scores_f32_fma",
}


_TILE_NAMES = frozenset(_TILE_FIELDS.values())


def _scan_config(name: str, fields: Mapping[str, Any]) -> ScanConfig:
    """The tile ``name`` given as {field: int} (a benchmark's JSON variant)."""
    tile_fields = dataclasses.fields(ScanConfig)
    known = [f.name for f in tile_fields]
    required = [f.name for f in tile_fields if f.default is dataclasses.MISSING]
    unknown = sorted(set(fields) - set(known))
    missing = [f for f in required if f not in fields]
    problems = []
    if unknown:
        problems.append(f"no tile field {', '.join(map(repr, unknown))}")
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if problems:
        optional = [f for f in known if f not in required]
        raise InvalidArgument(f"tune {name}: {'; '.join(problems)} (a tile's fields are {', '.join(known)}; "
                              f"{', '.join(optional)} optional)")
    bad = [f for f, v in fields.items() if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        raise InvalidArgument(f"tune {name}: {', '.join(f'{f}={fields[f]!r}' for f in bad)} must be integers")
    return ScanConfig(**fields)


@dataclass(frozen=True)
class Tuning:
    """The engine's tuning table: the defaults are the fastest tiles and variants found on an
    H200 (``docs/gpu-kernels.md``, BENCHMARKS.md); benchmarks replace entries (:meth:`replace`)."""

    # Fused scans (a running top-K in the streaming loop): by rows' precision and batching.
    fused_f32_single: ScanConfig = ScanConfig(block_n=8, block_d=512, block_q=1, warps=4, stages=1)
    fused_f16_single: ScanConfig = ScanConfig(block_n=32, block_d=128, block_q=1, warps=4, stages=1)
    fused_f32_batch: ScanConfig = ScanConfig(block_n=64, block_d=32, block_q=32, warps=4, stages=3)
    fused_f16_batch: ScanConfig = ScanConfig(block_n=128, block_d=64, block_q=64, warps=8, stages=3)
    # Score-writing scans. The single exact scan is capped at 128 registers: one program more
    # per SM fits with the filter's columns loaded ahead of the rows.
    scores_f32_single: ScanConfig = ScanConfig(block_n=32, block_d=128, block_q=1, warps=4, stages=1, maxnreg=128)
    scores_f16_single: ScanConfig = ScanConfig(block_n=32, block_d=128, block_q=1, warps=4, stages=1)
    scores_f32_batch: ScanConfig = ScanConfig(block_n=64, block_d=64, block_q=16, warps=4, stages=3)
    scores_f16_batch: ScanConfig = ScanConfig(block_n=64, block_d=64, block_q=16, warps=4, stages=3)
    # Exact batches of a few queries by FMA (up to exact_fma_max_q): block_q is the batch's
    # bucket, and block_n shrinks as it grows (block_n * block_q rows x queries per tile).
    scores_f32_fma: ScanConfig = ScanConfig(block_n=16, block_d=64, block_q=8, warps=4, stages=1)
    # The 8-bit scan of a single query (int8_scores_kernel, tensor cores).
    scores_i8_single: ScanConfig = ScanConfig(block_n=128, block_d=128, block_q=1, warps=4, stages=3)
    # What a single query scans in fast mode: "int8" (an 8-bit copy of the rows, held beside
    # the 16-bit one that batches scan) or "f16" (the 16-bit copy; no 8-bit one is held).
    single_scan: str = "int8"
    # Batches of at least this many queries (16-bit and tf32 scans) are scored by cuBLAS, a
    # slice of gemm_rows rows at a time, then the same chunked top-k and certified re-score.
    # Below it the Triton scan, which reads each row tile once for 16 queries; its tf32 and
    # 16-bit batches from scan_threshold_min_q on write the threshold selection's group maxima
    # themselves (docs/gpu-kernels.md, batches).
    gemm_min_q: int = 32
    gemm_rows: int = 65536
    # Whole slices select by threshold (group maxima, then every row above the K-th largest);
    # False: a bitonic top-K of every chunk.
    threshold_select: bool = True
    # Batches of the score-writing scan (below gemm_min_q) of at least this many queries select
    # by threshold too, in slices of gemm_rows, the scan writing each row block's maximum (the
    # block being a group); smaller ones keep the top-K of every chunk.
    scan_threshold_min_q: int = 8
    # The score-writing scan (then a parallel top-K per chunk) for batches of at most this
    # many queries; 0 keeps the fused scan everywhere.
    scores_max_q: int = 16
    score_chunk: int = 1024
    # Exact batches (Q > 1) of up to exact_fma_max_q queries: the float32 rows by FMA, each
    # row tile read once for all of them (no re-score). Off (0): on an H200 it was no faster
    # than tf32 + re-score at Q = 2-4 and slower from Q = 8 (BENCHMARKS.md, the crowd).
    # Other exact batches by exact_batch_scan: "tf32" = tensor-core scan + the certified
    # float32 re-score (the same answer); "ieee" = tl.dot in float32.
    exact_fma_max_q: int = 0
    exact_batch_scan: str = "tf32"
    merge_chunk: int = 1024
    final_max: int = 2048
    # The final kernel's [candidates x BLOCK_D] tile (elements) and warps: the certified
    # re-score reads KF float32 rows per query in one program, latency-bound when narrow;
    # a single query gets a wider one.
    final_tile: int = 8192
    final_warps: int = 8
    # Candidates each program of a batch's final kernel re-scores (rounded up to a power of
    # two): a query's KF candidates (at most SPLIT_MAX_CANDIDATES) go to KF / final_split_rows
    # programs, each reading its rows in one tile, the last to finish answering; 0: one program
    # re-scores them all, a tile at a time (a round trip per tile). 4, 8 and 16 measured alike.
    final_split_rows: int = 8
    single_final_tile: int = 16384
    single_final_warps: int = 16
    # A single query's chunk top-K and exact final kernel (batches keep 4 warps for both).
    single_topk_warps: int = 8
    single_exact_final_warps: int = 8
    # Fast mode, a single query: each chunk's candidates re-scored in float32 by the chunk's
    # own program (scores_rescore_kernel) instead of one program re-scoring the whole query's
    # in the final kernel. Up to chunk_rescore_max_rows rows only: past it the chunks'
    # re-scores read more rows than the one program did.
    single_chunk_rescore: bool = True
    chunk_rescore_max_rows: int = 262144
    # Scores per chunk, candidates each chunk re-scores (at least 2x the k bucket) and the
    # [candidates x BLOCK_D] tile of their re-score.
    chunk_rescore_chunk: int = 1024
    chunk_rescore_k: int = 32
    chunk_rescore_tile: int = 8192
    # Programs that read each query of a polling round from its slot (the slot server's
    # stage-in; a power of two): 1 = one program a query (stage_in_kernel), more = each a
    # part, the last to finish normalising it (stage_queries_kernel): a round's reads of host
    # memory spread over more, smaller requests (docs/gpu-kernels.md).
    stage_split: int = 8
    # PyTorch's CPU device (Triton's interpreter): few, large blocks, since every tl.topk
    # costs the interpreter a fraction of a second.
    cpu_progs: int = 2
    cpu_block_n: int = 64

    def __post_init__(self) -> None:
        if self.single_scan not in ("int8", "f16"):
            raise InvalidArgument(f"tune single_scan must be 'int8' or 'f16', got {self.single_scan!r}")
        if not 1 <= self.stage_split <= STAGE_SPLIT_MAX or self.stage_split & (self.stage_split - 1):
            raise InvalidArgument(
                f"tune stage_split must be a power of two from 1 to {STAGE_SPLIT_MAX}, got {self.stage_split!r}")

    def replace(self, overrides: Mapping[Any, Any] | None = None) -> "Tuning":
        """A copy with ``overrides`` ({field name or tile key: value}, see ``_TILE_FIELDS``)."""
        changes = {}
        names = {f.name for f in dataclasses.fields(self)}
        for key, value in (overrides or {}).items():
            name = _TILE_FIELDS.get(key) if isinstance(key, tuple) else key
            if name not in names:
                raise InvalidArgument(f"unknown tuning key {key!r}")
            if isinstance(value, Mapping):  # (a tile as JSON gives it)
                if name not in _TILE_NAMES:
                    raise InvalidArgument(f"tune {name} is not a tile: it takes a value, not a mapping")
                value = _scan_config(name, value)
            changes[name] = value
        return dataclasses.replace(self, **changes)

    def tile(self, scores: bool, kind: str, batched: bool, fma: bool = False) -> ScanConfig:
        """The scan tile for a kind ("f32", "tf32", "f16", "i8"), score-writing or fused
        (``fma``: an exact batch of a few queries, :meth:`Planner.fma`)."""
        half = kind == "f16"
        if scores or fma:
            rows = "fma" if fma else "i8" if kind == "i8" else half
            return getattr(self, _TILE_FIELDS[("scores", rows, batched)])
        return getattr(self, _TILE_FIELDS[(half, batched)])


DEFAULT_TUNING = Tuning()


@dataclass
class Plan:
    k1: int  # keys kept per scan program
    kout: int
    cfg: ScanConfig
    n_qblocks: int
    progs: int
    levels: list  # (chunk, programs) per merge level
    count_final: int
    final_chunk: int
    final_block_d: int
    final_warps: int
    ws_keys: int  # int64 keys per query the workspace must hold
    topk_warps: int  # warps of a program of the score-writing scan's chunk top-K
    rescore_k: int = 0  # fast mode: candidates each chunk re-scores in float32 (0: the final kernel does)
    score_chunk: int = 0  # the scan writes scores, top-K per chunk of this many (0: fused)
    gemm_rows: int = 0  # batches: cuBLAS scores this many rows at a time instead of the scan (0: scan)
    threshold: bool = False  # whole slices (GEMM or scan scores) select by threshold, not per chunk
    fma: bool = False  # an exact batch of a few queries scanned by FMA (Planner.fma)
    final_rescore: bool = False  # the final kernel re-scores the candidates and certifies (its RESCORE)
    final_split: int = 1  # programs per query of that re-score (final_kernel's SPLIT)
    slice_rows: int = 0  # with threshold: the rows of a slice (a GEMM's, or the scan's scores read a slice at a time)


@dataclass
class Planner:
    """Plans for one engine: its dimension, device facts and tuning; plans are cached per
    (kind, query bucket, k bucket, capacity) until :meth:`clear` or a new tuning.

    ``occupancy(kind, cfg, k1)``: resident scan programs per SM (compiled kernels: the
    pipeline's); ``gemm_ok(kind)``: whether cuBLAS can score this kind here."""

    dim: int
    on_gpu: bool
    sms: int
    occupancy: Callable[[str, ScanConfig, int], int]
    gemm_ok: Callable[[str], bool]
    tuning: Tuning = DEFAULT_TUNING
    _plans: dict = field(default_factory=dict)

    def retune(self, tuning: Tuning) -> None:
        self.tuning = tuning
        self.clear()

    def clear(self) -> None:
        self._plans.clear()

    def chunk_rescore(self, capacity: int) -> bool:
        """Whether a single query's chunks re-score their own candidates (``single_chunk_rescore``
        up to ``chunk_rescore_max_rows``): the 8-bit scan depends on it."""
        t = self.tuning
        return bool(t.single_chunk_rescore) and capacity <= int(t.chunk_rescore_max_rows)

    def scan_kind(self, nq: int, k: int, precision: str, *, has_int8: bool, capacity: int) -> str:
        """What a batch of ``nq`` queries scans: "i8" (fast, a single query), "f16" (fast),
        "tf32" (exact batches, certified) or "f32" (exact). All but "f32" serve k <= MAX_FAST_K."""
        if k > MAX_FAST_K:
            return "f32"
        if precision == "fast":
            int8 = has_int8 and self.tuning.single_scan == "int8"
            return "i8" if nq == 1 and int8 and self.chunk_rescore(capacity) else "f16"
        if nq > 1 and not self.fma("f32", next_pow2(nq)) and self.tuning.exact_batch_scan == "tf32":
            return "tf32"
        return "f32"

    def fma(self, kind: str, qb: int) -> bool:
        """Whether a batch of ``qb`` queries (a bucket) of ``kind`` scans by FMA: exact ("f32"),
        2 <= qb <= ``exact_fma_max_q``."""
        return kind == "f32" and 2 <= qb <= int(self.tuning.exact_fma_max_q)

    def plan(self, kind: str, qb: int, kp: int, capacity: int) -> Plan:
        """The plan of a batch bucket: ``qb`` queries (a power of two), ``kp`` = k_bucket(k)."""
        key = (kind, qb, kp, capacity)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make(kind, qb, kp, capacity)
        return plan

    def _make(self, kind: str, qb: int, kp: int, capacity: int) -> Plan:
        tune = self.tuning
        batched = qb > 1
        k1 = kp if kind == "f32" else fast_candidates(kp)
        fma = self.fma(kind, qb)
        scores = qb <= int(tune.scores_max_q)
        gemm = batched and kind != "f32" and qb >= int(tune.gemm_min_q) and self.gemm_ok(kind)
        scores = scores or gemm or fma
        rescore_k = 0
        if kind == "i8" or (kind == "f16" and qb == 1 and scores and not gemm and self.chunk_rescore(capacity)):
            # Each chunk keeps its kp best float32 keys, re-scored from its top rescore_k.
            rescore_k, k1, scores = max(int(tune.chunk_rescore_k), 2 * kp), kp, True
        base = tune.tile(scores, kind, batched, fma)
        block_n = base.block_n if scores else max(base.block_n, k1)
        if fma:  # rows x queries per tile as the tuning says, the queries being the bucket's
            block_n = max(1, base.block_n * base.block_q // qb)
        if not self.on_gpu:
            block_n = max(block_n, int(tune.cpu_block_n))
        # The row chunk keeps the tile's elements (an FMA tile's already count the queries).
        chunk_d = base.block_d if fma else base.block_n * base.block_d // block_n
        # (int8 tensor-core products take K in steps of 32, 16-bit ones in steps of 16)
        block_d = max(32 if kind == "i8" else 16, min(base.block_d, chunk_d, next_pow2(self.dim)))
        if fma:
            block_q = qb
        elif batched:  # (tl.dot takes at least 16 rows)
            block_q = min(base.block_q, max(16, qb))
        else:
            block_q = 1
        cfg = ScanConfig(block_n, block_d, block_q, base.warps, base.stages, base.progs, base.maxnreg)
        n_qblocks = -(-qb // block_q)
        if scores and cfg.progs == 0:  # one row block per program, capacity-wide grid
            progs = -(-capacity // block_n)
        elif cfg.progs > 0:
            progs = cfg.progs
        elif cfg.progs < 0:  # -m: m programs per SM, whatever the occupancy
            progs = max(1, (self.sms * -cfg.progs) // n_qblocks)
        elif self.on_gpu:
            progs = max(1, (self.sms * self.occupancy(kind, cfg, k1)) // n_qblocks)
        else:
            progs = tune.cpu_progs
        chunk_scores = int(tune.chunk_rescore_chunk if rescore_k else tune.score_chunk)
        score_chunk = max(next_pow2(chunk_scores), 2 * k1, 2 * rescore_k)
        slice_rows = max(score_chunk, int(tune.gemm_rows) // score_chunk * score_chunk)
        gemm_rows = slice_rows if gemm else 0
        # A batch's score-writing scan leaves its row blocks' maxima for the threshold selection
        # when a block is a group (the scan's epilogue: no group_max_kernel).
        scan_groups = (batched and scores and not gemm and not fma and not rescore_k and kind in ("tf32", "f16")
                       and qb >= int(tune.scan_threshold_min_q) and block_n == score_chunk // GROUPS_PER_CHUNK)
        threshold = ((gemm or scan_groups) and bool(tune.threshold_select)
                     and _threshold_fits(slice_rows, score_chunk, k1))
        if threshold:  # K keys per whole slice, then K per chunk of a narrower last one
            whole, rest = divmod(capacity, slice_rows)
            count = whole * k1 + -(-rest // score_chunk) * k1
        elif scores:
            count = -(-capacity // score_chunk) * k1
        else:
            count = progs * k1
        ws = count
        levels = []
        chunk = max(int(tune.merge_chunk), 2 * k1)
        while count > max(int(tune.final_max), k1):
            p2 = -(-count // chunk)
            levels.append((chunk, p2))
            count = p2 * k1
        final_chunk = next_pow2(max(count, k1))
        single = qb == 1
        # (With rescore_k the final kernel re-scores nothing: the tile is the chunks' re-score's.)
        if rescore_k:
            tile_elems = tune.chunk_rescore_tile
        else:
            tile_elems = tune.single_final_tile if single else tune.final_tile
        final_rescore = kind != "f32" and not rescore_k  # (16-bit or tf32 scores the chunks did not re-score)
        split_rows = next_pow2(int(tune.final_split_rows)) if int(tune.final_split_rows) > 0 else 0
        splits = batched and final_rescore and 0 < split_rows < k1 <= SPLIT_MAX_CANDIDATES
        final_split = k1 // split_rows if splits else 1
        final_block_d = max(16, min(next_pow2(self.dim), int(tile_elems) // (rescore_k or k1 // final_split)))
        if final_rescore:
            final_warps = int(tune.single_final_warps if single else tune.final_warps)
        else:  # the final kernel selects among float32 keys and re-scores nothing
            final_warps = int(tune.single_exact_final_warps) if single else 4
        topk_warps = int(tune.single_topk_warps) if single else 4
        return Plan(k1, kp, cfg, n_qblocks, progs, levels, count, final_chunk, final_block_d, final_warps, ws,
                    topk_warps, rescore_k, score_chunk if scores else 0, gemm_rows, threshold, fma, final_rescore,
                    final_split, slice_rows if threshold else 0)


def _threshold_fits(slice_rows: int, chunk: int, k1: int) -> bool:
    """Whether whole slices may select by threshold: chunks per slice a power of two (the
    kernels' tile shapes), tau the k1-th of at least 2 * k1 group maxima, and k1 small
    enough that collect_kernel's scratch (k1 groups' rows per query) stays small."""
    chunks = slice_rows // chunk
    return (chunks & (chunks - 1) == 0 and chunk % GROUPS_PER_CHUNK == 0
            and 2 * k1 <= chunks * GROUPS_PER_CHUNK and k1 <= _THRESHOLD_MAX_K)
