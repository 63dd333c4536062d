"""The engine: requests in, tokens out.

    engine.py           Engine: generate / chat / stream / add_request / step / abort
    builder.py          an engine's parts built from its config, memory sized once
    executor.py         the engine core: schedule -> launch -> land through the scheduler's loop
    step_builder.py     a scheduled run -> the runner's step and sampling inputs
    output_processor.py a step's tokens on the host, and how sequences end
    structured.py       structured outputs: grammar matchers, a step's token bitmasks
    stats.py            the counters Engine.stats() reports
    timeline.py         when each step was dispatched, finished and landed
"""
