"""The model math: a stage's layers and their one forward for every family, products, RoPE, experts, sampling, grammars, a layer's weights by name."""
