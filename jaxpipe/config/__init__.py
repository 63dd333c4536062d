"""Configuration, the package's lowest layer (it imports nothing else of jaxpipe): validated
once, read everywhere, never mutated at run time.

    model.py      ModelConfig: a model's architecture
    engine.py     EngineConfig: everything an Engine is built with
    cluster.py    the processes of one engine (coordinator, count, index) and their checks
    layout.py     a layout: pp x tp x ep (x dp) of one model replica
    meshes.py     named device topologies (meshes/*.toml) and their hardware constants
    checks.py     the checks config dataclasses share
    flags.py      command-line flags derived from a config dataclass
    cache_dir.py  where jaxpipe keeps what it builds or measures once per machine
"""
