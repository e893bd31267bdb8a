"""What runs in an agent's process: the client (client), its asyncio twin (aio) and the
optional client-side embedder (embed).
"""
