"""Benchmark harnesses (also `swarmkv bench …`). They print figures and write JSON/CSV/PNG
into one output folder; tests never assert timings."""
