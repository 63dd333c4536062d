"""Child processes of a jaxpipe command: the lifeline that ties a child to its parent, and a
follower's supervisor (`python -m jaxpipe.process.follower`, what `--process-id N` runs).

    lifeline.py  children that die with their parent (`spawn`, `die_with_parent`)
    follower.py  a follower of a multi-process engine, rejoining the cluster after failures
"""
