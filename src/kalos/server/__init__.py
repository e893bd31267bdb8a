"""The sidecar: its lifecycle, control operations and recall loop (sidecar), the crowd's
gathering (cohort), the TTL schedule (expiry), the embedder it serves (sidecar_embed), the seed
article's protocol (seed_compat), starting one as a child process (launcher), its counters
(metrics) and its BLAS threads (blas).
"""
