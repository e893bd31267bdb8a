"""The sidecar: its lifecycle (sidecar), the recall loop and its filter cache (recall_loop), the
control socket's connections and operations (operations), the GPU's polling of the slots that
every writer stops (slot_polling), the crowd's gathering (cohort), the TTL schedule (expiry)
and its side effects (expirer), the embedder it serves (sidecar_embed), the seed article's
protocol (seed_compat), starting one as a child process (launcher), its counters (metrics) and
its BLAS threads (blas).
"""
