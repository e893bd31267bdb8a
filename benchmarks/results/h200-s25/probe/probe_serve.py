"""`kalos serve` with the probe's timers installed first (session 25)."""
import runpy, sys
import kalos_probe_timers
kalos_probe_timers.install()
import os
if os.environ.get("KALOS_PROBE_EXTRA"): exec(open(os.environ["KALOS_PROBE_EXTRA"]).read())
sys.argv = ["kalos", *sys.argv[1:]]
runpy.run_module("kalos", run_name="__main__")
