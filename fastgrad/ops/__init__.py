"""op_api layer: per-op validation -> plan -> backend dispatch."""
