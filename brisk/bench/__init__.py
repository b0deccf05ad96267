"""Benchmarks: brisk measured side by side with a baseline in the same process."""
