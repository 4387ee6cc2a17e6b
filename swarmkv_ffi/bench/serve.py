"""`swarmkv bench serve`: `swarmkv serve` against llama.cpp's llama-server, as agents use them.

Both servers are driven by the official `openai` Python client with the same requests,
the same model, threads and greedy sampling. llama-server is llama.cpp's stock build from
the same pin (`./build_llama.sh --tools`), started with `-np SLOTS --kv-unified` and a
context of SLOTS x the cells one agent needs; ours with a pool as large. Every scenario
runs on a fresh server of each side (nothing cached from another scenario), after one
warm-up request:

    at_once     N agents: the same document as the system message, a question each, sent together
    one_by_one  the same N requests, one after another (llama-server's prompt cache shares the prefix)
    turns       A agents x T turns, at once: each turn appends the answer and a follow-up
    exact       ours with --exact: the N requests at once vs each sent alone, token for token
    structured  N agents at once, each asking for a JSON object by schema (response_format
                json_schema, streamed), against llama-server --jinja; then, on one server of
                ours, the same N at once with and without the schema, alternated, for what
                the grammar's mask costs per decoded token
    overhead    a 1-token request over HTTP vs the same prompt through generate() in process
    keys        ours alone: two API keys sharing one server, and one attacking the other
                (serve_keys.py says how)
    scale       N agents at once (16..256) over one document and over four, ours on its
                defaults against llama-server -np N (serve_scale.py says how)
    tiers       an evicted document back from host RAM or disk against prefilling it
                again, and against llama-server's --cache-ram (serve_tiers.py)
    preempt     a request preempted for room: its KV to host RAM and back, or re-read,
                in process, ours alone (serve_preempt.py)
    models      three models x N agents at once behind one endpoint, against llama-server's
                router mode; then where only two fit, loaded and unloaded on demand
                (serve_models.py)
    apis        N agents at once through chat completions, the Responses API and Anthropic's
                Messages API, each against ours through chat and llama-server --jinja on the
                same API (serve_apis.py)

Reported: wall seconds per side, llama-server's / ours, tokens, prompt tokens served from
cache (usage.prompt_tokens_details.cached_tokens, where a side reports it), and how many
answers have the same text on both sides (the two builds' kernels round differently).
structured also counts the answers that parse and validate against the schema
(jsonschema) on each side, and the seconds per decoded token of each stream (from its
first piece to its last, so the shared prefill is left out): the median over streams.
Output: serve.json in --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from .. import catalog
from .measure import at_once, document_of, report_json, settings_of
from .peer import log, server_binary
from .servers import ask, cached_of, client_of, ours, theirs

QUESTIONS = ["What is this document about?", "Who may use the work?", "What must be kept in copies?",
             "What is excluded?", "Can I sell copies?", "What happens if I sue?", "What is a Contribution?",
             "Is there a warranty?", "Who is a Contributor?", "What is a Derivative Work?",
             "Can I change the license?", "What is the NOTICE file for?", "Are trademarks granted?",
             "When does the patent license end?", "What is Legal Entity?", "Must I state my changes?"]
FOLLOW_UPS = ["Say more about that.", "Give an example.", "Summarise your answer in one sentence."]


SCHEMA = {"type": "object",
          "properties": {"answer": {"type": "string", "maxLength": 200},
                         "confidence": {"enum": ["low", "medium", "high"]},
                         "sections": {"type": "array", "items": {"type": "integer", "minimum": 1}, "maxItems": 3}},
          "required": ["answer", "confidence", "sections"], "additionalProperties": False}


def summary(wall_s: float, replies: list) -> dict:
    cached = [cached_of(r.usage) for r in replies]
    return {"total_s": wall_s, "texts": [r.choices[0].message.content for r in replies],
            "completion_tokens": sum(r.usage.completion_tokens for r in replies),
            "prompt_tokens": sum(r.usage.prompt_tokens for r in replies),
            "cached_tokens": None if None in cached else sum(cached)}


def agents_of(doc: str, n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": doc}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            for i in range(n)]


def run_at_once(client, args, doc: str) -> dict:
    ms, replies = at_once([lambda m=m: ask(client, args.model, m, args.gen) for m in agents_of(doc, args.n)])
    return summary(ms / 1e3, replies)


def run_one_by_one(client, args, doc: str) -> dict:
    t0 = time.perf_counter()
    replies = [ask(client, args.model, m, args.gen) for m in agents_of(doc, args.n)]
    return summary(time.perf_counter() - t0, replies)


def run_turns(client, args, doc: str) -> dict:
    def conversation(messages: list[dict]) -> list:
        replies = []
        for turn in range(args.turns):
            reply = ask(client, args.model, messages, args.gen)
            replies.append(reply)
            messages = messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                                   {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
        return replies
    ms, out = at_once([lambda m=m: conversation(m) for m in agents_of(doc, args.agents)])
    return summary(ms / 1e3, [r for replies in out for r in replies])


def streamed(client, model: str, messages: list[dict], gen: int, schema: dict | None) -> dict:
    """One streamed request: its text, tokens, and seconds per token after its first piece."""
    kw = {} if schema is None else {"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": schema, "strict": True}}}
    pieces, times, usage = [], [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=gen, temperature=0,
                                                stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            times.append(time.perf_counter())
    tokens = usage.completion_tokens
    per_token = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and len(times) > 1 else None
    return {"text": "".join(pieces), "completion_tokens": tokens, "prompt_tokens": usage.prompt_tokens,
            "cached": cached_of(usage), "per_token_s": per_token}


def valid_json(text: str, schema: dict) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_streams(client, args, doc: str, schema: dict | None) -> dict:
    ms, replies = at_once([lambda m=m: streamed(client, args.model, m, args.gen, schema)
                           for m in agents_of(doc, args.n)])
    rates = [r["per_token_s"] for r in replies if r["per_token_s"] is not None]
    cached = [r["cached"] for r in replies]
    return {"total_s": ms / 1e3, "texts": [r["text"] for r in replies],
            "completion_tokens": sum(r["completion_tokens"] for r in replies),
            "prompt_tokens": sum(r["prompt_tokens"] for r in replies),
            "cached_tokens": None if None in cached else sum(cached),
            "valid": None if schema is None else sum(valid_json(r["text"], schema) for r in replies),
            "per_token_s": statistics.median(rates) if rates else None}


def run_structured(client, args, doc: str) -> dict:
    return run_streams(client, args, doc, SCHEMA)


def mask_cost_row(args, doc: str, cells: int) -> dict:
    """On one server of ours: the N agents at once without and with the schema,
    alternated --repeat times (after a first run that prefills the document)."""
    runs = {"free": [], "constrained": []}
    with ours(args, cells) as server:
        client = client_of(server, args.model)
        run_streams(client, args, doc, None)
        for r in range(max(2, args.repeat)):
            for kind in (("free", "constrained") if r % 2 == 0 else ("constrained", "free")):
                runs[kind].append(run_streams(client, args, doc, SCHEMA if kind == "constrained" else None))
    per_token = {k: statistics.median(x["per_token_s"] for x in v) for k, v in runs.items()}
    row = {"scenario": "mask_cost", "free_per_token_s": per_token["free"],
           "constrained_per_token_s": per_token["constrained"],
           "constrained_over_free": per_token["constrained"] / per_token["free"],
           "valid": [x["valid"] for x in runs["constrained"]], "answers": args.n,
           "runs": {k: [{kk: vv for kk, vv in x.items() if kk != "texts"} for x in v] for k, v in runs.items()}}
    log(f" mask_cost: {per_token['constrained'] * 1e3:.1f} ms per token under the schema, "
        f"{per_token['free'] * 1e3:.1f} ms free: {row['constrained_over_free']:.2f}x "
        f"(medians over {args.n} streams at once, {len(runs['free'])} runs each, alternated)")
    return row


def compared(name: str, ours: dict, server: dict) -> dict:
    row = {"scenario": name, "ours": ours, "server": server, "server_over_ours": server["total_s"] / ours["total_s"],
           "same_text": sum(a == b for a, b in zip(ours["texts"], server["texts"])), "answers": len(ours["texts"])}
    log(f"{name:>10}: ours {ours['total_s']:.2f} s, llama-server {server['total_s']:.2f} s, "
        f"llama-server / ours {row['server_over_ours']:.2f}x; cached prompt tokens ours {ours['cached_tokens']} "
        f"llama-server {server['cached_tokens']}; same text {row['same_text']}/{row['answers']}")
    if ours.get("valid") is not None:
        log(f"{'':>10}  valid against the schema: ours {ours['valid']}/{row['answers']}, llama-server "
            f"{server['valid']}/{row['answers']}; per token ours {ours['per_token_s'] * 1e3:.1f} ms, "
            f"llama-server {server['per_token_s'] * 1e3:.1f} ms; tokens ours {ours['completion_tokens']}, "
            f"llama-server {server['completion_tokens']}")
    return row


def scenario(args, name: str, fn, slots: int, cells_per_slot: int, doc: str, jinja: bool = False) -> dict:
    """`--repeat` runs of each side, alternated (so drift on the machine hits both): the
    run of median time of each, with every run's time."""
    runs = {"ours": [], "server": []}
    for r in range(args.repeat):
        for side in (("ours", "server") if r % 2 == 0 else ("server", "ours")):
            server = (ours(args, slots * cells_per_slot) if side == "ours"
                      else theirs(args, slots, cells_per_slot, jinja))
            with server:
                runs[side].append(fn(client_of(server, args.model), args, doc))
    median = {side: {**sorted(got, key=lambda x: x["total_s"])[len(got) // 2],
                     "runs_s": [x["total_s"] for x in got]} for side, got in runs.items()}
    return compared(name, median["ours"], median["server"])


def exact_row(args, doc: str) -> dict:
    """Ours with --exact: the N requests at once, then each alone on a fresh server."""
    cells = args.n * (args.doc_tokens + 256)
    with ours(args, cells, exact=True) as together:
        at = run_at_once(client_of(together, args.model), args, doc)
    with ours(args, cells, exact=True) as alone_server:
        client = client_of(alone_server, args.model)
        alone = [ask(client, args.model, m, args.gen).choices[0].message.content for m in agents_of(doc, args.n)]
    same = sum(a == b for a, b in zip(at["texts"], alone))
    log(f"     exact: {same}/{args.n} answers among {args.n - 1} others equal the same request alone "
        f"(at once {at['total_s']:.2f} s)")
    return {"scenario": "exact", "at_once": at, "alone_texts": alone, "same_as_alone": same, "answers": args.n}


def overhead_row(args) -> dict:
    """A 1-token request through HTTP, the pool and the scheduler, against the same
    prompt through generate() on a model loaded in this process: `--overhead-requests`
    prompts, each new (nothing cached), the two sides alternated prompt by prompt so that
    drift on the machine hits both; medians."""
    from ..context import Context
    from ..generate import generate
    from ..model import Model
    prompts = [[{"role": "user", "content": f"Request {i}: say hello to {QUESTIONS[i % len(QUESTIONS)]}"}]
               for i in range(args.overhead_requests)]
    with ours(args, 4096) as server:
        client = client_of(server, args.model)
        with Model(args.model_path) as model, Context(model, n_ctx=512, n_threads=args.threads) as ctx:
            generate(ctx, model.tokenize("Hi"), max_tokens=1)          # its warm-up
            http, local = [], []
            for p in prompts:
                t0 = time.perf_counter()
                ask(client, args.model, p, 1)
                http.append(time.perf_counter() - t0)
                tokens = model.tokenize(model.apply_chat_template(p), parse_special=True)
                ctx.clear()
                t0 = time.perf_counter()
                generate(ctx, tokens, max_tokens=1)
                local.append(time.perf_counter() - t0)
    row = {"scenario": "overhead", "http_s": statistics.median(http), "generate_s": statistics.median(local),
           "http_runs_s": http, "generate_runs_s": local}
    row["http_over_generate"] = row["http_s"] / row["generate_s"]
    log(f"  overhead: a 1-token request {row['http_s'] * 1e3:.1f} ms over HTTP, {row['generate_s'] * 1e3:.1f} ms "
        f"through generate(): {row['http_over_generate']:.2f}x (medians of {len(prompts)}, alternated)")
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=catalog.DEFAULT_MODEL, help="a packaged short name (default: %(default)s)")
    ap.add_argument("--n", type=int, default=16, help="agents in at_once, one_by_one and exact (default 16)")
    ap.add_argument("--gen", type=int, default=32, help="max_tokens of every request (default 32)")
    ap.add_argument("--doc-tokens", type=int, default=1600, help="the document's length (default 1600)")
    ap.add_argument("--agents", type=int, default=8, help="agents in turns (default 8)")
    ap.add_argument("--turns", type=int, default=3, help="turns per agent in turns (default 3)")
    ap.add_argument("--overhead-requests", type=int, default=30, help="1-token requests in overhead (default 30)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each side per scenario, alternated; the median is reported (default 1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="CPU threads, both sides")
    ap.add_argument("--server", type=Path, default=None,
                    help="llama-server binary (default: the stock one from ./build_llama.sh --tools)")
    ap.add_argument("--scenarios", default="at_once,one_by_one,turns,exact,overhead,structured",
                    help="which to run, of those and keys, scale, tiers, preempt, models, apis (default: all but those six)")
    ap.add_argument("--attacks", default="idle,flood,big,body",
                    help="the keys scenario's attacks, of idle, flood, big, body (default: all)")
    ap.add_argument("--keys-rows", default="together,attacks,oracle,churn",
                    help="the keys scenario's rows, of together, attacks, oracle, churn (default: all)")
    ap.add_argument("--scale-agents", default="16,64,128,256", help="the scale scenario's N (default: %(default)s)")
    ap.add_argument("--scale-server-max", type=int, default=16,
                    help="the largest N llama-server runs in scale (default: %(default)s)")
    ap.add_argument("--models-agents", type=int, default=4, help="agents per model in models (default 4)")
    ap.add_argument("--oracle-rounds", type=int, default=16, help="the keys oracle's timed guesses (default 16)")
    ap.add_argument("--out", type=Path, default=None, help="folder for serve.json")
    args = ap.parse_args(argv)
    wanted = args.scenarios.split(",")
    unknown = set(wanted) - {"at_once", "one_by_one", "turns", "exact", "overhead", "structured", "keys", "scale",
                             "tiers", "preempt", "models", "apis"}
    if unknown:
        ap.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    from .serve_keys import ATTACKS
    keys_rows = {"together", "attacks", "oracle", "churn"}
    if not set(args.attacks.split(",")) <= set(ATTACKS) or not set(args.keys_rows.split(",")) <= keys_rows:
        ap.error(f"--attacks takes some of {', '.join(ATTACKS)}; --keys-rows some of together, attacks, oracle, churn")
    if {"at_once", "one_by_one", "turns", "structured", "scale", "models", "tiers", "apis"} & set(wanted):   # (exact and overhead: ours alone)
        args.server = server_binary(args.server, "swarmkv bench serve")
        if args.server is None:
            return 2
    args.model_path = catalog.resolve(args.model)
    from ..model import Model
    with Model(args.model_path) as model:
        doc = document_of(model, args.doc_tokens)
        keyed_body = document_of(model, args.doc_tokens - 8)
        n_ctx_train = model.n_ctx_train
    per_agent = args.doc_tokens + 128 + args.gen
    per_conversation = args.doc_tokens + args.turns * (64 + args.gen) + 64
    rows = []
    if "at_once" in wanted:
        rows.append(scenario(args, "at_once", run_at_once, args.n, per_agent, doc))
    if "one_by_one" in wanted:
        rows.append(scenario(args, "one_by_one", run_one_by_one, args.n, per_agent, doc))
    if "turns" in wanted:
        rows.append(scenario(args, "turns", run_turns, args.agents, per_conversation, doc))
    if "exact" in wanted:
        rows.append(exact_row(args, doc))
    if "overhead" in wanted:
        rows.append(overhead_row(args))
    if "structured" in wanted:
        rows.append(scenario(args, "structured", run_structured, args.n, per_agent, doc, jinja=True))
        rows.append(mask_cost_row(args, doc, args.n * per_agent))
    if "keys" in wanted:
        from .serve_keys import keys_rows
        rows += keys_rows(args, lambda name: f"Document of key {name}.\n" + keyed_body, QUESTIONS, n_ctx_train)
    if "scale" in wanted:
        from .serve_scale import scale_rows
        rows += scale_rows(args, lambda name: f"Document {name}.\n" + keyed_body, QUESTIONS)
    if "tiers" in wanted:
        from .serve_tiers import tier_rows
        rows += tier_rows(args, lambda name: f"Document {name}.\n" + keyed_body, QUESTIONS)
    if "models" in wanted:
        from .serve_models import models_rows
        rows += models_rows(args, lambda name: f"Document {name}.\n" + keyed_body, QUESTIONS)
    if "apis" in wanted:
        from .serve_apis import api_rows
        rows += api_rows(args, doc, QUESTIONS)
    if "preempt" in wanted:
        from .serve_preempt import preempt_rows
        rows += preempt_rows(args, doc)
    report = {"benchmark": "serve", "model": args.model,
              "server_flags": f"-np SLOTS --kv-unified -c SLOTS*cells -t {args.threads} (its defaults otherwise)",
              "rows": rows}
    shown = [{k: v for k, v in r.items() if not isinstance(v, (dict, list))} for r in rows]
    report_json(report, args.out / "serve.json" if args.out else None, settings_of(args), shown={"rows": shown})
    return 0


if __name__ == "__main__":
    sys.exit(main())
