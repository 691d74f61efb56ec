"""Benchmarks: each suite measures its contenders side by side in one run and reports ratios."""
