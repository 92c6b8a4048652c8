"""Shared settings of the pipeline tests."""

# a throughput_ar run small enough for a test: one tiny preset, 2 batch sizes x 1 context, 2 samples
TINY = ["experiment=throughput_ar", "profile=cpu", "bench.presets=[tiny-mamba2]", "bench.batch=[1,2]",
        "bench.context=[8]", "bench.warmup=0", "bench.iters=2"]
