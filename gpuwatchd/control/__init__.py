"""The control socket: protocol v1 (pure), the asyncio server and the blocking client."""
