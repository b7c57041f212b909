"""The stage process: shard loading, the Llama-family forward for its layers, KV, sampling,
the StageNode gRPC service."""
__version__ = "0.1.0"
