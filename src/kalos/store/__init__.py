"""The durable store of record: SQLite (sqlite), PostgreSQL (postgres), a follower that
applies another sidecar's changes (follow), and choosing one from its spec (spec).
"""
