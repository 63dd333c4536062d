"""The request side: what a caller asks for and what it gets back, above the scheduler and the
model (it knows their sequences and tokenizer) and below the engine.

    params.py     SamplingParams (vLLM's names and meanings), StructuredOutputsParams
    errors.py     RequestError: a bad request, naming the field
    validate.py   a client's request -> what the engine accepts, or a RequestError naming the
                  field (the one validator of the engine, the server and batch jobs)
    grammar.py    output constraints compiled by llguidance against the model's tokenizer
    openai.py     OpenAI request bodies -> what validate.prepare takes
    tools.py      a chat body's tools and tool_choice: the template's tools, the constraint
    tool_parsers.py  tool calls in a model's own output (tool_choice "auto"): hermes, ...
    tool_calls.py the answer of a chat with tools as OpenAI tool_calls, whole or streamed
    stopping.py   when a request ends, and its text (EOS, stop ids and strings, min/max)
    outputs.py    what a caller gets back: vLLM-shaped outputs and streaming deltas
"""
