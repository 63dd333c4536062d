"""The KV bytes: where each sequence's keys and values are, and the moves between the device
and the host. The scheduler's ledgers decide that a sequence moves and count the blocks and
tokens; this package moves the bytes.

    device_cache.py  the device KV store: a pool of blocks, block tables, block reads / writes
    host_buffer.py   the host KV tier (`HostKVBuffer`) and the prefetcher that brings sequences
                     back into the decode layout's shards on a thread
    manager.py       `KVManager`: swap-outs, swap-ins, drops and the prefix cache's host-tier
                     moves, for the engine (mirrored to followers over several processes)
"""
