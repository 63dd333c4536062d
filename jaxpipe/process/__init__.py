"""Child processes of a jaxpipe command: the lifeline that ties a child to its parent, and a
follower's supervisor (`python -m jaxpipe.process.follower`, what `--process-id N` runs).
"""
