"""A resident GPU kernel that serves the sidecar's slots by itself: no Python on the recall path.

Why. On the H200 one exact recall of 65,536 x 1024 rows costs ~79 us of GPU work, but ~140 us
end to end through the sidecar: the rest is Python (finding the request, validating it, the
launch, the wait, publishing; ``benchmarks/NOTES-gpu.md``). :func:`~kalos.engine.triton_kernels.serve_slots_kernel`
takes all of that off the path: program 0 polls the slots' ``req_seq`` words in the
page-locked segment, every program scans its share of the rows, and the last one writes the
answer and ``resp_seq`` into the slot, which the client is spinning on.

What it serves. A single query (``n_queries == 1``) with ``k <= max_k``, all namespaces, no time
window, and a query that is finite and non-zero. Anything else (batches, filters, larger k,
bad input), and every request that arrives while the kernel is busy with another, is *handed*
to the host: the kernel records its ``req_seq`` in :attr:`SlotServer.handed`, and the sidecar's
sweep answers it through the engine's ordinary (batched) path, concurrently. Fast mode
re-scores its candidates in float32 and hands the request over when the certificate fails.

Ownership of a slot's answer. A request is the kernel's when the kernel took it, the host's
when it is in ``handed``: the two never answer the same one. :attr:`SlotServer.answered` is the
sidecar's own record of answered sequence numbers (the channel adopts it), written by the
kernel for its answers and by the sweep for the host's.

Lifetime. :meth:`SlotServer.start` launches the kernel on its own high-priority stream; it
exits by itself after ``idle_s`` without a request (a resident kernel spinning forever would
take GPU time from the LLM next to it), or when :meth:`SlotServer.stop` asks. The sidecar
stops it before anything changes the engine (adds, deletes, compaction) or the slots
(clients coming and going) and starts it again on the next request. All its programs must be
resident at once (they wait for each other): the grid is sized from the compiled kernel's
registers and shared memory, and leaves room on every SM for the host path's kernels.

On PyTorch's CPU device (tests, under ``TRITON_INTERPRET=1``) the kernel runs as one program,
synchronously: :meth:`SlotServer.start` returns after it has served what was pending and
polled ``idle_polls`` more times.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from kalos.engine.torch_engine import TorchEngine, _kf, _kp, _next_pow2
from kalos.errors import InvalidArgument
from kalos.protocol import NAMESPACE_BYTES, Layout, Op, RequestFlag, SlotWords

__all__ = ["SlotServer", "DEFAULT_MAX_K"]

#: Largest k the kernel serves itself (larger ones go to the host path).
DEFAULT_MAX_K = 16

_CTL_WORDS = 10  # CTL[0..9] (see serve_slots_kernel), then one arrival counter per group
_MAX_NAMES = 256  # namespaces the kernel resolves itself (requests naming others go to the host)
_RESIDENT_WAIT_S = 0.05  # how long program 0 waits for every program to be resident


class SlotServer:
    """The resident kernel of one engine and one shared segment (see the module docstring).

    ``engine``: a Triton-backend :class:`TorchEngine` with the segment attached
    (:meth:`~TorchEngine.attach_host`). ``layout``: the segment's layout. ``answered``: the
    channel's current record of answered sequence numbers (copied into page-locked memory,
    which the channel then adopts). ``idle_s``: how long the kernel polls without a request
    before it exits. ``max_k``: largest k served (rounded up to a power of two).
    ``programs_per_sm``: the scan's programs per SM (capped by occupancy). ``tile``:
    ``(rows, dims)`` of one scan step (fewer dims than that widen it to more rows); ``rchunk``:
    rows per top-K selection.
    """

    def __init__(
        self,
        engine: TorchEngine,
        layout: Layout,
        answered: np.ndarray,
        *,
        idle_s: float = 0.002,
        max_k: int = DEFAULT_MAX_K,
        programs_per_sm: int = 4,
        group: int = 16,
        tile: tuple[int, int] | None = None,
        warps: int | None = None,
        rchunk: int = 256,
        idle_polls: int = 2,
    ) -> None:
        if engine.backend != "triton" or engine._attached is None:
            raise InvalidArgument("the slot server needs the Triton engine with the segment attached (attach_host)")
        if not 1 <= max_k <= 256:
            raise InvalidArgument(f"max_k must be in [1, 256], got {max_k}")
        if idle_s < 0 or programs_per_sm < 1 or group < 1 or (warps is not None and warps < 1):
            raise InvalidArgument("idle_s must be >= 0; programs_per_sm, group and warps >= 1")
        if len(answered) != layout.n_slots:
            raise InvalidArgument(f"answered has {len(answered)} entries for {layout.n_slots} slots")
        self.engine = engine
        self.layout = layout
        self.words = SlotWords.of(layout)
        if NAMESPACE_BYTES != 64:
            raise AssertionError("serve_slots_kernel compares namespaces as 8 int64 words")
        self.on_gpu = engine._is_cuda
        self.kout = _kp(max_k)
        self.rescore = engine.precision == "fast"
        self.keys = _kf(self.kout) if self.rescore else self.kout
        self.mchunk = max(256, self.keys)  # keys per selection step of the merges
        dev = engine._dev
        # Whole-row tiles, two in flight per program (benchmarks/NOTES-gpu.md, "resident
        # kernel"). Exact: 2 rows, 4 warps. Fast: 8 rows, 4 warps, 2 programs per SM (16 rows
        # at 8 warps measured faster in process, 107.6 us, but one program then fills an SM).
        block_n, block_d = tile if tile is not None else ((8, 1024) if self.rescore else (2, 1024))
        self.block_d = max(16, min(_next_pow2(block_d), _next_pow2(engine.dim)))
        self.block_n = max(1, _next_pow2(block_n * _next_pow2(block_d) // self.block_d))
        self.rchunk = max(_next_pow2(rchunk), self.keys, self.block_n)
        self.warps = int(warps) if warps is not None else 4
        self.group = int(group)
        self.idle_s = float(idle_s)
        self.idle_polls = int(idle_polls)
        self.ns = _next_pow2(layout.n_slots)
        self._requested_per_sm = int(programs_per_sm)
        self._cap_per_sm = self._requested_per_sm  # lowered when a launch found too few resident

        pin = self.on_gpu
        # Page-locked host words the kernel writes and the sweep reads (and the reverse).
        self._host = torch.zeros(2 * self.ns + 4, dtype=torch.int64, pin_memory=pin)
        host = self._host.numpy()
        #: Sequence number answered, per slot: the channel's record (the kernel writes it too).
        self.answered = host[: layout.n_slots].view(np.uint64)
        #: Sequence number the kernel handed to the host, per slot.
        self.handed = host[self.ns : self.ns + layout.n_slots].view(np.uint64)
        self._hctl = host[2 * self.ns :]  # [0] stop, [1] answered by the kernel, [2] rounds, [3] not resident
        self.answered[:] = answered
        self._t_answered = self._host[: self.ns]
        self._t_handed = self._host[self.ns : 2 * self.ns]
        self._t_hctl = self._host[2 * self.ns :]

        base = np.array([layout.slot_offset(s) for s in range(layout.n_slots)], np.int64)
        self._slot_words = base // 8
        self._slot_at = torch.full((self.ns,), -1, dtype=torch.int64, device=dev)
        self._seen = torch.zeros((2, self.ns), dtype=torch.int64, device=dev)
        self._dq = torch.zeros(engine.dim, dtype=torch.float32, device=dev)
        self._agree = torch.zeros(4 * self.ns + 16, dtype=torch.int64, device=dev)
        self._ns_tab = torch.zeros((_MAX_NAMES, 9), dtype=torch.int64, device=dev)
        self._ns_ids = torch.zeros(_MAX_NAMES, dtype=torch.int64, device=dev)
        self._names: dict[bytes, int] = {}
        self._stream = torch.cuda.Stream(device=dev, priority=-100) if self.on_gpu else None
        self._done: torch.cuda.Event | None = None
        # The grid's buffers, sized by _size_grid; these minimal ones serve its compile.
        self._ctl = torch.zeros(_CTL_WORDS + 1, dtype=torch.int64, device=dev)
        self._keys = self._gkeys = torch.empty(self.keys, dtype=torch.int64, device=dev)
        self._scores = torch.empty(1, dtype=torch.float32, device=dev)
        self.resident_per_sm = 0
        self.not_resident = 0  # launches that found too few programs resident (grid halved)
        self._grid_for: tuple | None = None
        self.programs = 1
        self.launches = 0

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._stream) if self.on_gpu else contextlib.nullcontext()

    # -- sizing ------------------------------------------------------------------------------

    def _constexprs(self) -> dict:
        w = self.words
        eng = self.engine
        return dict(
            W_REQ=w.req_seq, W_OPK=w.op_k, W_NQF=w.nq_flags, W_NSLEN=w.ns_len, W_NSB=w.ns_bytes, W_RESP=w.resp_seq,
            W_STATN=w.status_n, E_Q=w.queries, E_IDS=w.ids, E_SC=w.scores, D=eng.dim, NS=self.ns, NSMAX=_MAX_NAMES,
            K=self.keys, KOUT=self.kout, BLOCK_N=self.block_n, BLOCK_D=self.block_d, RCHUNK=self.rchunk, BLOCK_DQ=min(256, _next_pow2(eng.dim)),
            MCHUNK=self.mchunk, FINAL_BLOCK_D=max(16, min(_next_pow2(eng.dim), 2048 // self.keys)),
            HALF=self.rescore, RESCORE=self.rescore, ON_GPU=self.on_gpu, CTL_GROUPS=_CTL_WORDS,
        )

    def _size_grid(self) -> None:
        """Programs (all co-resident, with room to spare for the host path) and the merge tree."""
        eng = self.engine
        if not self.on_gpu:
            programs = 1
        else:
            ker = eng._tk.serve_slots_kernel.warmup(*self._args(1, 1), grid=(1,), num_warps=self.warps, num_stages=1,
                                                    **self._constexprs(), G=self.group, GCHUNK=self.mchunk,
                                                    FCHUNK=self.mchunk)
            ker._init_handles()
            threads = self.warps * 32
            by_regs = eng._regs_per_sm // max(1, ker.n_regs * threads)
            by_smem = eng._smem_per_sm // max(1, ker.metadata.shared) if ker.metadata.shared else 32
            by_threads = 2048 // threads
            resident = min(by_regs, by_smem, by_threads)
            self.resident_per_sm = resident
            if resident < 2:
                # One program would fill an SM: the sweep's kernels (handed-over requests) could
                # not run beside it. Measured (H200, fast mode, 8 warps, ~252 registers): the
                # sweep's service time rose to 12.6 ms, and a run under GPU load ended in an
                # illegal memory access that is not yet explained (benchmarks/NOTES-gpu.md).
                raise InvalidArgument(
                    f"the resident kernel needs {ker.n_regs} registers per thread at {self.warps} warps: only "
                    f"{resident} program fits per SM, leaving no room for the sweep's kernels"
                )
            # One program fewer than fits, so the sweep's own kernels (handed-over requests)
            # find room on every SM instead of waiting for this kernel to exit.
            per_sm = max(1, min(self._requested_per_sm, resident - 1, self._cap_per_sm))
            programs = eng._sms * per_sm
        self.programs = programs
        self.groups = -(-programs // self.group)
        self.gchunk = -(-min(self.group, programs) * self.keys // self.mchunk) * self.mchunk
        self.fchunk = -(-self.groups * self.keys // self.mchunk) * self.mchunk
        with self._on_stream():  # the stream that uses them
            self._ctl = torch.zeros(_CTL_WORDS + self.groups, dtype=torch.int64, device=eng._dev)
            self._keys = torch.empty(programs * self.keys, dtype=torch.int64, device=eng._dev)
            self._gkeys = torch.empty(self.groups * self.keys, dtype=torch.int64, device=eng._dev)
            self._scores = torch.empty(eng.rows.capacity, dtype=torch.float32, device=eng._dev)

    def _args(self, n: int, rows_per_prog: int) -> tuple:
        eng = self.engine
        x = eng._x16 if self.rescore else eng._x32
        ea, eb, ec = eng._err["f16" if self.rescore else "f32"]
        idle = int(self.idle_s * 1e9) if self.on_gpu else self.idle_polls
        att = eng._attached
        return (
            att.i64, att.f32, x, eng._x32, eng._live, eng._ns, eng._ids, self._ns_tab, self._ns_ids, self._slot_at,
            self._seen, self._t_answered, self._t_handed, self._t_hctl, self._ctl, self._dq, self._agree,
            self._scores, self._keys, self._gkeys,
            n, self.layout.n_slots, len(self._names), min(self.kout, self.layout.max_k), rows_per_prog,
            eng._max_norm, ea, eb, ec, idle, int(_RESIDENT_WAIT_S * 1e9), int(Op.RECALL), int(RequestFlag.ALL_NAMESPACES),
        )

    # -- running -----------------------------------------------------------------------------

    def running(self) -> bool:
        """Whether the kernel is live (it may exit by itself when idle)."""
        if self._done is None:
            return False
        if self._done.query():
            self._done = None
            self._check_resident()
            return False
        return True

    def warm(self) -> None:
        """Compiles the kernel now (a launch that exits at once), not on the first request."""
        if self.start(np.zeros(self.layout.n_slots, bool), exit_at_once=True):
            self.stop()

    def set_namespaces(self, names: dict[bytes, int]) -> None:
        """The namespaces (UTF-8 name -> id) a request may name (call while stopped); the
        first ``_MAX_NAMES`` go to the device, requests naming others go to the host."""
        names = dict(list(names.items())[:_MAX_NAMES])
        if names == self._names:
            return
        tab = np.zeros((_MAX_NAMES, 9), np.int64)
        ids = np.full(_MAX_NAMES, -1, np.int64)
        for row, (name, ns_id) in enumerate(names.items()):
            tab[row, :8] = np.frombuffer(name.ljust(NAMESPACE_BYTES, b"\0")[:NAMESPACE_BYTES], np.int64)
            tab[row, 8] = len(name)
            ids[row] = ns_id
        with self._on_stream():
            self._ns_tab.copy_(torch.from_numpy(tab))
            self._ns_ids.copy_(torch.from_numpy(ids))
        self._names = names

    def start(self, active: np.ndarray, *, exit_at_once: bool = False) -> bool:
        """Launches the kernel for the slots marked in ``active`` (those with a client now);
        False when there is nothing to serve (no rows). Call only while it is not running."""
        if self.running():
            raise InvalidArgument("the slot server is already running")
        eng = self.engine
        n = eng.rows.size
        if n == 0:
            return False
        eng._settle()
        if self._grid_for != (eng.rows.capacity, id(eng._x32)):
            self._size_grid()
            self._grid_for = (eng.rows.capacity, id(eng._x32))
        rows_per_prog = -(-n // self.programs)
        rows_per_prog = -(-rows_per_prog // self.block_n) * self.block_n
        slot_at = np.full(self.ns, -1, np.int64)
        slot_at[: self.layout.n_slots] = np.where(active, self._slot_words, -1)
        seen = np.zeros((2, self.ns), np.int64)
        seen[0, : self.layout.n_slots] = self.answered.view(np.int64)
        seen[1, : self.layout.n_slots] = self.handed.view(np.int64)
        self._hctl[0] = 1 if exit_at_once else 0
        with self._on_stream():
            self._slot_at.copy_(torch.from_numpy(slot_at))
            self._seen.copy_(torch.from_numpy(seen))
            self._ctl[:3].zero_()  # round, round done, groups arrived (the round-robin turn and
            self._ctl[8:].zero_()  # the count of answers carry over from the last launch)
            eng._tk.serve_slots_kernel[(self.programs,)](
                *self._args(n, rows_per_prog), num_warps=self.warps, num_stages=1,
                **self._constexprs(), G=self.group, GCHUNK=self.gchunk, FCHUNK=self.fchunk,
            )
            if self.on_gpu:
                self._done = torch.cuda.Event()
                self._done.record(self._stream)
        self.launches += 1
        return True

    def stop(self) -> None:
        """Asks the kernel to exit and waits until it has (it finishes the request in hand)."""
        if self._done is None:
            return
        self._hctl[0] = 1
        try:
            self._done.synchronize()
        finally:
            self._hctl[0] = 0
            self._done = None
        self._check_resident()

    def _check_resident(self) -> None:
        """After a launch that exited because not all its programs were resident at once
        (another kernel held SMs, MPS limits, a wrong occupancy estimate): halve the grid."""
        if self._hctl[3] == 0:
            return
        self._hctl[3] = 0
        self.not_resident += 1
        if self.programs <= self.engine._sms:
            raise RuntimeError(f"the slot server's {self.programs} programs were not all resident at once")
        self._cap_per_sm = max(1, self.programs // self.engine._sms // 2)
        self._grid_for = None

    def forget(self, slot: int) -> None:
        """A new client took ``slot``: its sequence numbers start again (call while stopped)."""
        self.handed[slot] = 0

    @property
    def served(self) -> int:
        """Requests the kernel has answered, over all its launches."""
        return int(self._hctl[1])

