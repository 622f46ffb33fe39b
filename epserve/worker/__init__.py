"""One rank: the Runner (implements the Model traits), its KV pool, sampler and EP comm."""
