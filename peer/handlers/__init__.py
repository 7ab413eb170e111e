"""The peer's RPC handlers: the one table they are registered through, and what each may receive (kinds, sizes)."""
