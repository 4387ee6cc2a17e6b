"""`swarmkv bench serve --scenarios models`: several models behind one endpoint.

The packaged models (SmolLM2-135M and Gemma 3 270M) x --models-agents agents each (4),
every agent a question over a document (--doc-tokens) as its system message, max_tokens
--gen, through the `openai` client:

    ours    one `swarmkv serve --model A --model B` (one conductor, a pool per model)
    theirs  llama-server's router mode from the same pin (`--models-dir` holding both
            GGUFs: a child process per model, `-np N --kv-unified -c N x cells` each),
            both models loaded before timing

On each side: each model's agents alone (one model at a time, its own document), then
every agent of both models at once (a fresh document per model, so nothing is cached
from the first part). Reported: seconds; together over the slowest model alone and
over both alone one after the other; answers; for ours, how many times each pool's
context was made (1 each: no pool closed or rebuilt while the models took turns).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from .. import catalog
from .measure import at_once
from .peer import HttpServer, log
from .servers import ask, client_of, openai_client, ours, scrape

MODELS = ("smollm2-135m", "gemma3-270m")


def router(args, folder: Path, slots: int, cells_per_slot: int) -> HttpServer:
    """llama-server in router mode over the GGUFs in `folder`."""
    return HttpServer(lambda port: [str(args.server), "--models-dir", str(folder), "--host", "127.0.0.1",
                                    "--port", str(port), "-t", str(args.threads), "--no-webui",
                                    "-np", str(slots), "--kv-unified", "-c", str(slots * cells_per_slot)],
                      "llama-server (router mode)")


def agents(client, ids: dict[str, str], docs: dict[str, str], questions: list[str], n: int, gen: int) -> dict:
    """n agents of each model in `ids` (our name -> the id the server knows), all at once."""
    calls = [lambda m=m, i=i: ask(client, ids[m], [{"role": "system", "content": docs[m]},
                                                    {"role": "user", "content": questions[i % len(questions)]}], gen)
             for m in ids for i in range(n)]
    ms, replies = at_once(calls)
    return {"s": ms / 1e3, "answers": sum(bool(r.choices[0].message.content) for r in replies),
            "completion_tokens": sum(r.usage.completion_tokens for r in replies)}


def one_side(client, ids: dict[str, str], make_doc, questions: list[str], args) -> dict:
    for m in ids:                                   # loaded (and warm) before timing
        ask(client, ids[m], [{"role": "user", "content": "Hi"}], 1)
    alone = {m: agents(client, {m: ids[m]}, {m: make_doc(f"for {m} alone")}, questions, args.models_agents, args.gen)
             for m in ids}
    together = agents(client, ids, {m: make_doc(f"for {m} together") for m in ids}, questions,
                      args.models_agents, args.gen)
    slowest, both = max(a["s"] for a in alone.values()), sum(a["s"] for a in alone.values())
    return {"alone": alone, "together": together, "together_over_slowest_alone": together["s"] / slowest,
            "together_over_both_alone": together["s"] / both}


def models_rows(args, make_doc, questions: list[str]) -> list[dict]:
    n, per_agent = args.models_agents, args.doc_tokens + 128 + args.gen
    row = {"scenario": "models", "models": list(MODELS), "agents_per_model": n}
    with ours(args, n * per_agent, models=MODELS) as server:
        client = client_of(server, MODELS[0])
        row["ours"] = one_side(client, {m: m for m in MODELS}, make_doc, questions, args)
        row["ours"]["pool_opens"] = {m: metrics_of_model(server, m) for m in MODELS}
    with tempfile.TemporaryDirectory() as folder:
        for m in MODELS:
            path = catalog.resolve(m)
            (Path(folder) / path.name).symlink_to(path)
        with router(args, Path(folder), n, per_agent) as server:
            client = openai_client(server)
            known = [m.id for m in client.models.list().data]
            ids = {m: next(k for k in known if Path(catalog.resolve(m).name).stem in k) for m in MODELS}
            row["server"] = one_side(client, ids, make_doc, questions, args)
    row["server_over_ours"] = row["server"]["together"]["s"] / row["ours"]["together"]["s"]
    for side in ("ours", "server"):
        r = row[side]
        log(f"     models: {side}: alone " + ", ".join(f"{m} {a['s']:.1f} s" for m, a in r["alone"].items())
            + f"; together {r['together']['s']:.1f} s ({r['together_over_slowest_alone']:.2f}x the slowest alone, "
            f"{r['together_over_both_alone']:.2f}x both alone), {r['together']['answers']} answers")
    log(f"     models: pool opens (ours) {row['ours']['pool_opens']}; llama-server's together / ours "
        f"{row['server_over_ours']:.2f}x")
    return [row]


def metrics_of_model(server, model: str) -> float:
    """How many times `model`'s pool context was made (our /metrics)."""
    return next(s.value for s in scrape(server)
                if s.name == "swarmkv_pool_opens_total" and s.labels.get("model") == model)
