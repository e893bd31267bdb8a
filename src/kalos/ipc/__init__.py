"""The shared-memory channel between clients and the sidecar: the segment's byte layout
(protocol), slots and waiting (channel), memory ordering (sync, with the native fence) and the
control socket's wire format (control).
"""
