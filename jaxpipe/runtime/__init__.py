"""The device side: everything that owns or shapes device arrays, below the engine core.

    runner.py          the runner: weights, the paged KV pool, compiled step programs, the
                       sampler, for the current layout; it decides nothing
    pipeline.py        the tick program on a mesh (stages over pp, tp inside each)
    flow.py            the micro-batches in flight through the stages, and their clock
    ticks.py           each layout's flow and carried activations; a tick's inputs stacked
    sharding.py        logical axes -> mesh axes per layout, padding, re-sharding
    sampling.py        the device sampler (SamplingParams packed into tensors)
    host_sampler.py    the same choices in NumPy on worker threads (SiPipe)
    step_inputs.py     a ragged step's inputs, built on the host
    buckets.py         the static shapes the step compiles for
    sizing.py          how memory is divided: weights, activations, the pool, the host tier
    memory.py          memory as the OS and devices see it
    kernel_choice.py   which kernel path runs each matmul and the attention, by measurement
    synthetic_step.py  padding-only steps (warm-up, timing)
    step_timing.py     step times measured once per model, layout and machine (TD-Pipe)
    distributed.py     several processes: joining, the control channel, the mirrored runner
"""
