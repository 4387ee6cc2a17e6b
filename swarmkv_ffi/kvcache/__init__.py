"""The prefix cache, one folder: how a prompt's opening is matched, kept, demoted and restored.

    prefix.py      how many leading tokens two prompts share
    thresholds.py  every length at which the cache changes its mind
    tier.py        PrefixTier: the interface of a tier below the pool's cells
    costs.py       seconds a token of copying KV, learnt from the copies made
    radix.py       a radix tree of token blocks: the longest held opening, in one walk
    device.py      the pool's own cells kept after a request ends (Kept)
    host.py        HostTier: evicted prefixes in host RAM, booked in the swap ledger
    disk.py        DiskTier: prefixes on disk, through the file store, signed per key
    files.py       PrefixCache: snapshots in a folder that outlives the process (the
                   fan-out's documents, and the disk tier's store)

    pool cells --evicted--> host RAM --full--> disk --> away
    a request  <--restored-- the nearest tier that holds its opening, if cheaper than prefill

This __init__ imports nothing: the fan-out takes files.py without the engine.
"""
