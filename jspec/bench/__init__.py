"""Benchmarks of jspec's decoding methods: the harness behind ``jspec bench`` and the scripts
under ``benchmarks/``. Nothing in the serving path imports it.

- :mod:`jspec.bench.run`: methods side by side on the same prompts (tokens/s, acceptance,
  time to first token, token identity with jspec's own greedy decoding);
- :mod:`jspec.bench.peers`: Hugging Face transformers' greedy and prompt-lookup decoding as rows
  of the same table;
- :mod:`jspec.bench.profile`: one step's time by operation, from XLA's profiler.
"""
