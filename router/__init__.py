"""Worker selection: the KV-aware cost model, simple load-balancing modes, trace replay."""
