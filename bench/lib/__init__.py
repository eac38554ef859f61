"""The library of the benches, imported by them and by no product code:

- `args`: the common flags (`add_common_args`, `add_model_args`), comma-list types, the prompt suite;
- `results`: the result file (`write_result`: {"config", "rows", "complete"}), other JSON files,
  plots, printed tables;
- `procs`: a verifier process, the core split, the delay proxy, an ASGI app in a thread;
- `stats`: the median, the nearest-rank percentile, the median ms of a timed call;
- `device`: torch device helpers of the forward benches (imports torch);
- `frames`: raw session frames against a live verifier (fuzz, soak, prefill_share).

Nothing here is a benchmark: bench/registry.py lists those.
"""
