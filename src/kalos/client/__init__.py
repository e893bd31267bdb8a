"""What runs in an agent's process: the client (client), its asyncio twin (aio), what their
calls take and return (requests, results) and the optional client-side embedder (embed).
"""
