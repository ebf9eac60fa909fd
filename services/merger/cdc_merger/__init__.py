"""The merger: bronze change log -> silver current state (MERGE), deletes, order-safe."""
