"""What waking C sleeping clients costs the waker: C eventfd writes (what the sweep did before
control protocol 3; it now writes one byte to each sleeper's socket) against
one FUTEX_WAKE on a shared word (tried for issue 18, and dropped: no cheaper, since the kernel's
per-process wake-up, not the system calls, is the cost).

    python3 benchmarks/wake_cost.py 8; python3 benchmarks/wake_cost.py 32
"""
import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import platform
import time

import numpy as np


class futex:  # the two calls, through libc's syscall()
    _nr = {"x86_64": 202, "aarch64": 98}[platform.machine()]
    _call = ctypes.CDLL(None, use_errno=True).syscall

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    @classmethod
    def wait(cls, address, expected, timeout_s):
        ts = cls._Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        cls._call(cls._nr, ctypes.c_void_p(address), 0, ctypes.c_uint32(expected), ctypes.byref(ts), None, 0)

    @classmethod
    def wake_all(cls, address):
        cls._call(cls._nr, ctypes.c_void_p(address), 1, 0x7FFFFFFF, None, None, 0)


_parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
_parser.add_argument("clients", type=int, metavar="C", help="sleeping client processes to wake, each round")
C = _parser.parse_args().clients; R = 300
buf = mmap.mmap(-1, 4096)
word = np.frombuffer(buf, dtype=np.uint32, count=2)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
def sleeper(mode, fd, done):
    while True:
        if mode == "futex":
            e = int(word[0]); 
            if e == 0xFFFFFFFF: return
            futex.wait(addr, e, 1.0)
            if int(word[0]) == 0xFFFFFFFF: return
        else:
            import select
            select.select([fd], [], [], 1.0)
            try: os.eventfd_read(fd)
            except BlockingIOError: pass
            if int(word[0]) == 0xFFFFFFFF: return
        with done.get_lock(): done.value += 1
for mode in ("eventfd", "futex"):
    word[0] = 0
    fds = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(C)]
    done = mp.Value("i", 0)
    ps = [mp.get_context("fork").Process(target=sleeper, args=(mode, fds[i], done)) for i in range(C)]
    for p in ps: p.start()
    time.sleep(0.5)
    costs = []
    for r in range(R):
        before = done.value
        t0 = time.perf_counter()
        if mode == "futex":
            word[0] = (int(word[0]) + 1) & 0x7FFFFFFF; futex.wake_all(addr)
        else:
            for fd in fds: os.eventfd_write(fd, 1)
        costs.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        while done.value < before + C and time.perf_counter() - t1 < 0.5: pass
        time.sleep(0.002)
    word[0] = 0xFFFFFFFF
    if mode == "futex": futex.wake_all(addr)
    else:
        for fd in fds: os.eventfd_write(fd, 1)
    for p in ps: p.join(2)
    print(f"C={C} {mode:8s} waker cost p50 {np.percentile(costs,50)*1e6:7.1f} us  p90 {np.percentile(costs,90)*1e6:7.1f} us")
