"""Developer tools: the round tracer and the delay proxy."""
