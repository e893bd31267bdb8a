"""Reliability suites: a workload, injected faults, and an oracle that checks every answer.

One module per suite (see RELIABILITY.md at the repository root for what each proves and the
numbers of its long run). Each runs alone (``pytest tests/reliability/test_crash.py``); the
default is the short CI version, ``--long`` runs the long one. Child-process workers and the
oracles live in :mod:`reliability._support`, which imports neither pytest nor hypothesis, so
that the many 'spawn' children start quickly.
"""
