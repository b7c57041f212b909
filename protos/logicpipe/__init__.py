"""LogicPipe wire contract: generated stubs (v1) and small hand-written helpers."""
