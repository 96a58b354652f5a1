"""rlgate's benchmarks: rlgate against its limits and its peers, as ratios measured in one run.

`make bench` (quick) / `make bench-full` run `python -m bench`; see bench/__main__.py and docs/benchmarks.md.
"""
