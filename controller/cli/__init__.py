"""The command-line tools: lpctl, and preparing a model (the embedded default, a GGUF file)."""
