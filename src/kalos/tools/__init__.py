"""The command line and what it runs: cli, doctor, bench (with its GPU and crowd parts),
demo, importer, plot, timing, and the bundled corpus.
"""
