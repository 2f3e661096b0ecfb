"""The benchmarks' own logic (``benchmarks/``): contenders, ratios, variants."""
