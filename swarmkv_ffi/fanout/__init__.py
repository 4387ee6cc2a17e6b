"""The fan-out engine: prefill a document once, fork its KV cache to N branches.

    document ─layout─▶ budget check ─▶ prefill (n_batch chunks, seq 0, positions 0..n-1)
       ├─ shared: llama_memory_seq_cp(0 → 1..N), one llama_decode per step for all branches
       └─ copy:   snapshot ─▶ per-branch copy ─▶ fresh context ─▶ restore ─▶ branch loop

Both modes run as a DAG (fanout/dag.py). A branch with a watermark W needs only the
first W document tokens: the prefill splits its chunks at W and the branch starts there,
while the rest of the document is still being read.

Timings are taken with time.perf_counter_ns, relative to the start of run_fanout:
  ready_ms        when the branch's share of the document was available
  fork_ms         seq_cp (shared) or copy + fresh context + restore (copy)
  activation_ms   from ready to the branch's first generated token (the "TTFT proxy")
  decode_ms       from the first to the last generated token
  tokens_per_s    the tokens after the first over decode_ms (generate.rate: llama.cpp's
                  eval rate; generate() and lmxd count the same way)

The modules, lowest first:
    types.py     BranchSpec, BranchResult, FanoutResult, MODES
    prompts.py   the document as an exact token prefix of every branch's prompt
    budget.py    the context budget, checked before any context exists
    config.py    FanoutConfig, shared by the fan-out, its baseline, Ray and the benchmarks
    dag.py       the small DAG orchestrator both modes run on
    plan.py      everything decided before any context or buffer exists
    prefill.py   the document's chunks and the loop that decodes them
    shared.py    shared mode: one context, every branch in every llama_decode
    copy.py      copy mode: snapshot bytes restored per branch
    baseline.py  what the fan-out is measured against (each branch alone)
    engine.py    run_fanout: picks a mode and runs it
"""
from .baseline import run_baseline
from .config import FanoutConfig
from .engine import run_fanout
from .plan import plan_fanout
from .types import MODES, BranchResult, BranchSpec, FanoutResult

__all__ = ["MODES", "BranchResult", "BranchSpec", "FanoutConfig", "FanoutResult", "plan_fanout", "run_baseline", "run_fanout"]
