"""The conductor: one process owns the accelerator for many agents; lmxd (swarmkv_ffi/lmxd/)
and serve/ are its fronts, and import only this package, the engine's door (the names
below `__all__`), never its modules.

Lowest first (tests/test_layers.py holds the same order):

  its parts (below them: ../admission/, who fits; ../kvcache/, the prefix cache)
    policy.py          fairness between owners: rows, virtual time, the step cap, reopens
    common_prompts.py  prompt tokens that DECODEs starting together share, decoded once
    modelfile.py       a client-named model file, opened once and checked before it is read
    registry.py        models refcounted by file identity: two agents on one GGUF share it
    estimate.py        bytes an agent needs, from its GGUF (weights + KV for n_ctx + compute)
    sandbox.py         an untrusted GGUF loads in a child process first
  the engine
    request_cells.py   a request pool's kept cells: fork, keep, recall, evict (kvcache/ below)
    pool.py            one model's shared context, a KV sequence per seated agent; PoolKey
    agent.py           an agent's record, its Kind and pool key, the doors' errors, the context check
    runs.py            a DECODE's record (Run) and a pool's step tally
    seating.py         which pool is served, which runs are seated (room, preemption)
    step.py            one step: plan the batch, run it, apply the tokens, sample
    scheduler.py       the one thread that runs every llama_decode, batched, fair by owner
    booking.py         what an agent books in the ledger: cells, weights once, compute buffers
    swap.py            paused agents' KV in host RAM (snapshots booked to the swap share)
    own.py             a context of a user's own, made apart instead of reopening a shared pool
    agents.py          the Conductor: registration, DECODE, RESET (with the three parts above)
  its door
    requests.py        request pools: one-shot requests of owners (what serve/ uses)
    __init__.py        the names the fronts use: the Conductor and its parts' settings, request pools

Where each rule lives: admission (admission/ledger.py, with the bytes from estimate.py and
the shares from admission/quotas.py) in Conductor.register (booking.py); fairness
(policy.py) applied by the scheduler; sharing of cells (pool.py: documents;
request_cells.py: kept cells matched per owner; the tiers below in ../kvcache/) and
eviction (request_cells.py: least recently used kept cells first; idle seats paused by
seating._make_room); the context length (agent.check_context) for both doors.
"""
from ..admission import keys as ledger_keys
from ..admission.ledger import Ledger, LedgerDenied
from ..admission.memory import DeviceMemory
from ..admission.quotas import DEFAULT_AGENTS_PER_UID, DEFAULT_CLIENTS_PER_UID, DEFAULT_SHARE_PERCENT, Quotas
from .agents import MAX_PREFIX_BYTES, Conductor, named_source
from .estimate import facts_of, load_table, of_facts
from .modelfile import ModelSource, check_models_dir, on_pseudo_fs
from .policy import STEP_RATIO, Policy
from .requests import (MAX_SEQS, ConductorError, ContextFull, NoRoom, Request, RequestPool,
                       RequestResult, Stopping, vetted)

__all__ = ["Conductor", "ConductorError", "ContextFull", "DEFAULT_AGENTS_PER_UID",
           "DEFAULT_CLIENTS_PER_UID", "DEFAULT_SHARE_PERCENT", "DeviceMemory", "Ledger",
           "LedgerDenied", "MAX_PREFIX_BYTES", "MAX_SEQS", "ModelSource", "NoRoom", "Policy",
           "Quotas", "Request", "RequestPool", "RequestResult", "STEP_RATIO", "Stopping", "check_models_dir",
           "facts_of", "ledger_keys", "load_table", "named_source", "of_facts", "on_pseudo_fs", "vetted"]
