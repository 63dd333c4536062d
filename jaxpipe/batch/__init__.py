"""Offline batch jobs over JSONL (`python -m jaxpipe.batch`), in OpenAI's batch format.

    openai.py    request lines -> BatchLine; results -> output records
    jobfile.py   streamed input, resumable append-only output
    job.py       one run of a job: skip done, run the rest, summary
    lookahead.py the prefix cache's order within each window of the next N requests
    runners.py   LocalRunner (Engine in this process) / RemoteRunner (a jaxpipe server);
                 inside a server, its Batch API's ClientRunner (`serve/batch_runner.py`)
                 keeps their contract
    __main__.py  `python -m jaxpipe.batch`: the command line
"""
