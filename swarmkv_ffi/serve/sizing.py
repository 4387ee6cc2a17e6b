"""The request pool's default size (`--ctx-size`), from the model and the memory budget.

A request books only the cells it adds (pool.py), so the pool's size decides how many
agents run at once over their documents, not a count of slots fixed in advance. The
default is FULL_CONTEXTS contexts of the model's trained length (four requests of the
model's full length at once, or hundreds of agents over one document), and less where
BUDGET_SHARE of the memory budget left after the weights cannot hold that many cells (the
estimate per cell is the ledger's own: KV and its share of the compute buffer); never
less than one full context (below that some requests could never run: an error says how
much memory it would take). Whatever is chosen, and why, goes to the startup log.

The host-RAM tier below the pool (kvcache/host.py, `--host-cache-mib`) takes an eighth
of the machine's RAM by default, at most 4 GiB: about 110 evicted 1.6k-token documents of
SmolLM2-135M, while a prefill of one costs seconds on a CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

FULL_CONTEXTS = 4
BUDGET_SHARE = 0.25
STEP = 256          # cells are chosen in multiples of this
HOST_CACHE_SHARE = 8          # the host tier takes at most an eighth of the machine's RAM
HOST_CACHE_MAX = 4 << 30      # and at most 4 GiB


@dataclass(frozen=True)
class Size:
    cells: int
    why: str


def for_model(path, budget: int) -> Size:
    """The default for the model file at `path` (read through a mapping: its weights are not
    copied) under `budget` bytes."""
    from ..conductor import facts_of, of_facts
    from ..model import Model
    with Model(path, n_gpu_layers=0, repack=False) as model:
        facts, n_ctx_train = facts_of(model), model.n_ctx_train
    empty, one = of_facts(facts, 0), of_facts(facts, 1)
    return default_cells(n_ctx_train, one.total - empty.total, empty.total, budget)


def host_cache_bytes(mib: int | None) -> int:
    """Bytes of host RAM for evicted prefixes (kvcache/host.py): `mib` as set, else an
    eighth of the machine's RAM, at most HOST_CACHE_MAX. 0: no host tier."""
    if mib is not None:
        return mib << 20
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(HOST_CACHE_MAX, ram // HOST_CACHE_SHARE)


def default_cells(n_ctx_train: int, per_cell: int, fixed: int, budget: int) -> Size:
    """cells for a pool of a model whose context is n_ctx_train, whose cells cost per_cell
    bytes each beyond `fixed` (its weights and compute floor), under `budget` bytes."""
    wanted = FULL_CONTEXTS * n_ctx_train
    room = int(BUDGET_SHARE * max(0, budget - fixed))
    fit = room // max(1, per_cell) // STEP * STEP
    if fit >= wanted:
        return Size(wanted, f"{FULL_CONTEXTS} x the model's {n_ctx_train}-token context "
                            f"({wanted * per_cell / 2**30:.2f} GiB, within a quarter of the memory budget)")
    least = -(-n_ctx_train // STEP) * STEP
    if fit < least:
        need = fixed + least * per_cell / BUDGET_SHARE
        raise ValueError(f"the memory budget ({budget / 2**30:.2f} GiB) is too small for one full context of "
                         f"this model ({n_ctx_train} cells at {per_cell} bytes each, within a quarter of the budget "
                         f"after the weights; that takes a budget of {need / 2**30:.2f} GiB): pass --ctx-size")
    return Size(fit, f"what a quarter of the memory budget holds after the weights "
                     f"({room / 2**30:.2f} GiB at {per_cell} bytes a cell; {FULL_CONTEXTS} x the model's "
                     f"{n_ctx_train}-token context would need more)")
