"""Data parallelism with ZeRO: `data_parallel.DataParallel` runs it, on the flat per-block
buffers of `buffers`, with the stage as a strategy (`stages`: 0, 1, 2; `stage3`: 3)."""
