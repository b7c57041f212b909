"""The API adapters over the front door: gRPC (service), HTTP (OpenAI-compatible: http_api, its auth, bodies, forms, logprobs and tools), /metrics."""
