"""`swarmkv bench serve --scenarios preempt`: a request that gives its cells up, its KV
copied to host RAM (swap) against re-read on its return (recompute), and the rule that
picks one by measured cost.

In process, on the server's engine (a RequestPool on a Conductor): two requests with
100-token prompts start together in a pool too small for both to finish, each
generating until max_tokens (end-of-generation tokens banned), so one is preempted when
the pool is full, holding about half of it. Two sizes:

    1,024 cells   600 tokens each (the one preempted holds ~500 tokens)
    2,048 cells   1,100 tokens each (~1,000)

For each shape, policies `swap`, `recompute` and `cost` (the default: swap when copying
out and back has measured cheaper than prefilling what would be re-read), --repeat runs
alternated, medians: seconds until both answered, preemptions, swaps.
"""
from __future__ import annotations

import statistics
import time

from .peer import log

SHAPES = {"1,024 cells": (1024, 100, 600), "2,048 cells": (2048, 100, 1100)}
POLICIES = ("swap", "recompute", "cost")


def once(args, policy: str, cells: int, prompt: int, gen: int, text: str) -> dict:
    from ..conductor import Conductor, Ledger, RequestPool
    conductor = Conductor(Ledger(lambda: 1 << 40), n_threads=args.threads)
    try:
        conductor.scheduler.preempt_by = policy
        pool = RequestPool(conductor, args.model, cells=cells, seqs=6)
        model = pool.model
        tokens = [int(t) for t in model.tokenize(text, add_special=True)]
        ban = {"logit_bias": {t: -1e9 for t in range(model.n_vocab) if model.is_eog(t)}}
        pool.submit(1, tokens[:64], 2).result()            # warm: the prefill cost is measured
        prompts = [tokens[k:k + prompt] for k in (200, 200 + prompt)]
        t0 = time.perf_counter()
        results = [r.result() for r in [pool.submit(1, p, gen, sampling=ban) for p in prompts]]
        seconds = time.perf_counter() - t0
        steps = pool.stats()["steps"]
        answered = all(len(r.generated) == gen for r in results)
        pool.close()
        return {"s": seconds, "preemptions": steps.preemptions, "swapped": steps.swapped, "answered": answered}
    finally:
        conductor.shutdown(0)
        conductor.close()


def preempt_rows(args, text: str) -> list[dict]:
    rows = []
    for shape, (cells, prompt, gen) in SHAPES.items():
        runs = {p: [] for p in POLICIES}
        for _ in range(max(1, args.repeat)):
            for policy in POLICIES:
                runs[policy].append(once(args, policy, cells, prompt, gen, text))
        row = {"scenario": "preempt", "cells": cells, "prompt_tokens": prompt, "max_tokens": gen, "runs": runs}
        for policy, got in runs.items():
            row[f"{policy}_s"] = statistics.median(r["s"] for r in got)
            row[f"{policy}_swapped"] = sum(r["swapped"] for r in got)
            row[f"{policy}_preemptions"] = sum(r["preemptions"] for r in got)
            row[f"{policy}_all_answered"] = all(r["answered"] for r in got)
        row["recompute_over_swap"] = row["recompute_s"] / row["swap_s"]
        rows.append(row)
        log(f"     preempt: {shape}: swap {row['swap_s']:.2f} s, recompute {row['recompute_s']:.2f} s "
            f"({row['recompute_over_swap']:.2f}x), cost rule {row['cost_s']:.2f} s "
            f"({row['cost_swapped']} of {row['cost_preemptions']} preemptions swapped); all answered: "
            f"{all(row[f'{p}_all_answered'] for p in POLICIES)}")
    return rows
