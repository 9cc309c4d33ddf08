"""jspec's CPU kernels: C++ called through XLA's FFI, with the same contracts and references as
the Pallas kernels beside this package (Pallas has no CPU backend outside interpret mode).

- :mod:`pallas_kernels.cpu.small_rows`: a product of a few rows by a weight (float32, or a GGUF
  file's Q4_1 / Q8_0 blocks read as they are), each row's argmax;
- :mod:`pallas_kernels.cpu.paged_attention`: verification attention over the pages, read in place;
- :mod:`pallas_kernels.cpu.layer_tail`: RoPE, and a whole decoder layer (or a step's stack of
  layers) in one call.

:mod:`pallas_kernels.cpu.build` compiles them into one library and registers them with XLA.
"""
