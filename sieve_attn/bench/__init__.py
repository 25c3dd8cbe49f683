"""Benchmarks of the attention ops against dense kernels (``sieve bench ...``)."""
