"""`swarmkv bench serve --scenarios models`: several models behind one endpoint.

The seed's scenario through the OpenAI API: three models x --models-agents agents each
(4), every agent a question over a document (--doc-tokens) as its system message,
max_tokens --gen, through the `openai` client. The models: SmolLM2-135M and Gemma 3
270M (packaged) and, as the third, SmolLM2-135M requantised to Q8_0 by the build's
llama-quantize (another file: other weights in memory, other speed). One folder holds
the three:

    ours    `swarmkv serve --models-dir FOLDER` (one conductor and ledger, a pool per
            model, each loaded on its first request)
    theirs  llama-server's router mode from the same pin (`--models-dir FOLDER`: a
            child process per model, `-np N --kv-unified -c N x cells` each)

Part one, a budget that fits all three (every model loaded before timing): each model's
agents alone, then every agent of every model at once (a fresh document per model).
Reported: seconds; together over the slowest alone and over all alone one after the
other (on a CPU the models share its cores, so the sum is the floor); answers; how many
times each of our pools was made (1: no pool closed or rebuilt).

Part two, a budget that fits any two models and not three (ours: --budget-bytes from
the bookings measured in part one; llama-server: --models-max 2), every agent at once
from cold: answers and refusals, loads and unloads per model, and (ours) the ledger's
booking and the server's RSS above its start, sampled every 0.2 s, against the budget.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from .. import catalog, library
from ..procmem import rss_of
from ..shaped_gguf import quantize
from .measure import Peaks, at_once
from .peer import HttpServer, log
from .servers import ask, by_label, openai_client, ours

PACKAGED = ("smollm2-135m", "gemma3-270m")


def folder_of_models(folder: Path, threads: int) -> dict[str, Path]:
    """The three GGUFs in `folder`: links to the packaged two, and the third written by
    llama-quantize. {id both servers give it: its file}."""
    files = []
    for m in PACKAGED:
        path = catalog.resolve(m)
        (folder / path.name).symlink_to(path)
        files.append(folder / path.name)
    smol = catalog.resolve(PACKAGED[0])
    third = folder / smol.name.replace("Q4_1", "Q8_0")
    files.append(quantize(smol, third, "Q8_0", library.tool_path("llama-quantize"), threads, requantize=True))
    return {f.name[:-len(".gguf")]: f for f in files}


def router(args, folder: Path, slots: int, cells_per_slot: int, extra: tuple = ()) -> HttpServer:
    """llama-server in router mode over the GGUFs in `folder`."""
    return HttpServer(lambda port: [str(args.server), "--models-dir", str(folder), "--host", "127.0.0.1",
                                    "--port", str(port), "-t", str(args.threads), "--no-webui",
                                    "-np", str(slots), "--kv-unified", "-c", str(slots * cells_per_slot), *extra],
                      "llama-server (router mode)")


def agents(client, ids: dict[str, str], docs: dict[str, str], questions: list[str], n: int, gen: int) -> dict:
    """n agents of each model in `ids` (our name -> the id the server knows), all at once;
    a refused or failed request is counted, with its error."""
    def one(m: str, i: int):
        try:
            return ask(client, ids[m], [{"role": "system", "content": docs[m]},
                                        {"role": "user", "content": questions[i % len(questions)]}], gen)
        except Exception as exc:          # the openai client's errors: counted, not raised
            return exc
    ms, replies = at_once([lambda m=m, i=i: one(m, i) for m in ids for i in range(n)])
    answered = [r for r in replies if not isinstance(r, Exception)]
    return {"s": ms / 1e3, "answers": sum(bool(r.choices[0].message.content) for r in answered),
            "failed": [str(r)[:200] for r in replies if isinstance(r, Exception)],
            "completion_tokens": sum(r.usage.completion_tokens for r in answered)}


def one_side(client, ids: dict[str, str], make_doc, questions: list[str], args) -> dict:
    for m in ids:                                   # loaded (and warm) before timing
        ask(client, ids[m], [{"role": "user", "content": "Hi"}], 1)
    alone = {m: agents(client, {m: ids[m]}, {m: make_doc(f"for {m} alone")}, questions, args.models_agents, args.gen)
             for m in ids}
    together = agents(client, ids, {m: make_doc(f"for {m} together") for m in ids}, questions,
                      args.models_agents, args.gen)
    slowest, every = max(a["s"] for a in alone.values()), sum(a["s"] for a in alone.values())
    return {"alone": alone, "together": together, "together_over_slowest_alone": together["s"] / slowest,
            "together_over_both_alone": together["s"] / every}


def booked(server) -> int:
    """Bytes our ledger books now."""
    return int(by_label(server, "swarmkv_memory_bytes", by="state")["booked"])


def models_rows(args, make_doc, questions: list[str]) -> list[dict]:
    n, per_agent = args.models_agents, args.doc_tokens + 128 + args.gen
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files = folder_of_models(folder, args.threads)
        ids = {m: m for m in files}
        row = {"scenario": "models", "models": list(files), "agents_per_model": n}
        with ours(args, n * per_agent, models=(), extra=("--models-dir", str(folder))) as server:
            client, bookings = openai_client(server), {}
            for m in files:                              # loaded one by one: what each books
                before = booked(server)
                ask(client, m, [{"role": "user", "content": "Hi"}], 1)
                bookings[m] = booked(server) - before
            row["ours"] = one_side(client, ids, make_doc, questions, args)
            row["ours"]["pool_opens"] = by_label(server, "swarmkv_pool_opens_total")
            row["ours"]["bookings"] = bookings
        with router(args, folder, n, per_agent) as server:
            client = openai_client(server)
            known = [m.id for m in client.models.list().data]
            theirs = {m: next(k for k in known if m in k) for m in files}
            row["server"] = one_side(client, theirs, make_doc, questions, args)
        row["server_over_ours"] = row["server"]["together"]["s"] / row["ours"]["together"]["s"]
        two = sum(bookings.values()) - min(bookings.values()) // 2     # any two fit, three do not
        row["fits_two"] = fits_two(args, folder, files, two, make_doc, questions, n, per_agent)
    report(row)
    return [row]


def fits_two(args, folder: Path, files: dict, budget: int, make_doc, questions, n: int, per_agent: int) -> dict:
    """Every agent of the three models at once, from cold, where two models fit."""
    out = {"budget_bytes": budget}
    docs = {m: make_doc(f"for {m} where two fit") for m in files}
    with ours(args, n * per_agent, models=(), extra=("--models-dir", str(folder), "--budget-bytes",
                                                    str(budget))) as server:
        start_rss = rss_of(server.proc.pid)
        with Peaks(lambda: {"booked": booked(server), "rss": rss_of(server.proc.pid) - start_rss}) as sampled:
            out["ours"] = agents(openai_client(server), {m: m for m in files}, docs, questions, n, args.gen)
        out["ours"].update(loads=by_label(server, "swarmkv_model_loads_total"),
                           unloads=by_label(server, "swarmkv_model_unloads_total"),
                           booked_most=int(sampled.most["booked"]), rss_above_start_most=int(sampled.most["rss"]),
                           samples=sampled.samples)
    with router(args, folder, n, per_agent, ("--models-max", "2")) as server:
        client = openai_client(server)
        known = [m.id for m in client.models.list().data]
        out["server"] = agents(client, {m: next(k for k in known if m in k) for m in files}, docs, questions, n,
                               args.gen)
    out["server_over_ours"] = out["server"]["s"] / out["ours"]["s"]
    return out


def report(row: dict) -> None:
    for side in ("ours", "server"):
        r = row[side]
        log(f"     models: {side}: alone " + ", ".join(f"{m} {a['s']:.1f} s" for m, a in r["alone"].items())
            + f"; together {r['together']['s']:.1f} s ({r['together_over_slowest_alone']:.2f}x the slowest alone, "
            f"{r['together_over_both_alone']:.2f}x all alone), {r['together']['answers']} answers")
    log(f"     models: pool opens (ours) {row['ours']['pool_opens']}; llama-server's together / ours "
        f"{row['server_over_ours']:.2f}x")
    two = row["fits_two"]
    log(f"     models, budget for two ({two['budget_bytes'] >> 20} MiB; llama-server --models-max 2): ours "
        f"{two['ours']['s']:.1f} s, {two['ours']['answers']} answered, {len(two['ours']['failed'])} failed, "
        f"loads {two['ours']['loads']}, unloads {two['ours']['unloads']}, booked at most "
        f"{two['ours']['booked_most'] >> 20} MiB, RSS +{two['ours']['rss_above_start_most'] >> 20} MiB "
        f"({two['ours']['samples']} samples); llama-server {two['server']['s']:.1f} s, "
        f"{two['server']['answers']} answered, {len(two['server']['failed'])} failed "
        f"({two['server_over_ours']:.2f}x ours)")
