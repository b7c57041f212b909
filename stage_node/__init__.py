"""The stage process: loading its layers, the forward, the engine (scheduler, runner, KV blocks),
the last stage's sampling and candidates, its gRPC service and its mDNS advertisement."""
