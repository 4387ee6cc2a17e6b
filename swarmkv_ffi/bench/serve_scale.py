"""`swarmkv bench serve --scenarios scale`: many agents at once on the server's defaults.

    one document   N agents (--scale-agents, default 16,64,128,256) at once, each a question
                   over the same document as its system message, max_tokens --gen
    four documents the same N agents split over 4 documents (N/4 each)

Ours runs on its defaults (no --ctx-size, no --parallel: the pool sized from the model
and the machine, each cell booked once); llama-server with `-np N --kv-unified` and a
context of N x the cells one agent needs, for N up to --scale-server-max (beyond that
its N separate prefills of the document take too long on a CPU to be worth the wait;
the row says so). Reported per N: wall seconds, tokens, prompt tokens served from
cache, the server's peak RSS (VmHWM), and for ours the time and RSS over those at the
smallest N (the targets: at most 3x the time and 1.5x the RSS of 16 at 128, 8x the
work); for four documents, each document's prefills (answers whose cached tokens are
under half the document).
"""
from __future__ import annotations

from .measure import at_once
from .peer import HttpServer, log
from .servers import ask, cached_of, client_of, metrics_of, ours, theirs


def peak_rss(server: HttpServer) -> int:
    """The server process's peak resident set (VmHWM), in bytes."""
    for line in open(f"/proc/{server.proc.pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def steps_of(server) -> dict:
    """What the server's steps carried, from its /metrics: steps, their seconds, prompt and
    decode rows, preemptions."""
    got = metrics_of(server)
    return {"steps": got.get(("swarmkv_steps_total", ""), 0), "seconds": got.get(("swarmkv_step_seconds_total", ""), 0),
            "prompt_rows": got.get(("swarmkv_step_rows_total", "prompt"), 0),
            "decode_rows": got.get(("swarmkv_step_rows_total", "decode"), 0),
            "preemptions": got.get(("swarmkv_preemptions_total", ""), 0)}


def run(server, args, docs: list[str], n: int, questions: list[str]) -> dict:
    """n agents at once over `docs` (agent i over docs[i % len(docs)]); a refused agent is
    counted in `errors`, not raised."""
    client = client_of(server, args.model)

    def one(i: int):
        messages = [{"role": "system", "content": docs[i % len(docs)]},
                    {"role": "user", "content": questions[i % len(questions)]}]
        try:
            return ask(client, args.model, messages, args.gen)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"[:200]
    ms, got = at_once([lambda i=i: one(i) for i in range(n)])
    answered = [(i, r) for i, r in enumerate(got) if not isinstance(r, str)]
    cached = [cached_of(r.usage) for _, r in answered]
    prefills = None
    if None not in cached:
        prefills = [sum(1 for (i, _), c in zip(answered, cached) if i % len(docs) == k and c < args.doc_tokens // 2)
                    for k in range(len(docs))]
    return {"total_s": ms / 1e3, "answers": sum(bool(r.choices[0].message.content) for _, r in answered),
            "completion_tokens": sum(r.usage.completion_tokens for _, r in answered),
            "cached_tokens": None if None in cached else sum(cached), "prefills_per_document": prefills,
            "errors": [r for r in got if isinstance(r, str)], "peak_rss_bytes": peak_rss(server)}


def scale_rows(args, make_doc, questions: list[str]) -> list[dict]:
    sizes = [int(x) for x in args.scale_agents.split(",")]
    rows = []
    for docs_n in (1, 4):
        docs = [make_doc(f"{k}") for k in range(docs_n)]
        for n in sizes:
            row = {"scenario": "scale", "documents": docs_n, "agents": n}
            with ours(args, None) as server:
                row["ours"] = run(server, args, docs, n, questions)
                row["ours"]["steps"] = steps_of(server)
            if n <= args.scale_server_max:
                with theirs(args, n, args.doc_tokens + 128 + args.gen) as server:
                    row["server"] = run(server, args, docs, n, questions)
                row["server_over_ours"] = row["server"]["total_s"] / row["ours"]["total_s"]
            else:
                row["server"] = f"not run: more than --scale-server-max {args.scale_server_max} slots"
            first = next((r for r in rows if r["documents"] == docs_n), row)
            row["ours_time_over_smallest"] = row["ours"]["total_s"] / first["ours"]["total_s"]
            row["ours_rss_over_smallest"] = row["ours"]["peak_rss_bytes"] / first["ours"]["peak_rss_bytes"]
            rows.append(row)
            o = row["ours"]
            theirs_s = (f"; llama-server {row['server']['total_s']:.1f} s ({row['server_over_ours']:.2f}x ours)"
                        if isinstance(row["server"], dict) else "")
            log(f"     scale: {n} agents over {docs_n} document(s): ours {o['total_s']:.1f} s "
                f"({row['ours_time_over_smallest']:.2f}x the {first['agents']}), {o['answers']}/{n} answered, "
                f"peak RSS {o['peak_rss_bytes'] / 2**20:.0f} MiB ({row['ours_rss_over_smallest']:.2f}x), "
                f"prefills per document {o['prefills_per_document']}{theirs_s}")
    return rows
