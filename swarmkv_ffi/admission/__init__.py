"""Admission: whether a newcomer fits, before anything is loaded or seated.

    keys.py     the ledgers' keys, typed: what a booking is for and which uid it charges
    ledger.py   bytes reserved per key under one lock, against a budget (device, swap)
    memory.py   device memory, re-read on a timer and at every admission (NVML or host)
    quotas.py   what one user may take of a shared daemon: connections, agents, shares

The conductor (booking.py, swap.py) books every agent, model and swapped state here; the fronts
reach these names through the conductor's door. This __init__ imports nothing, so a
module may import one part without pulling in the engine.
"""
