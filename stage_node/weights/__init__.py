"""The weights: where an assignment's tensors come from (a local copy, pulled from the controller) and their cache."""
