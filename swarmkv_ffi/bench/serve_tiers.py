"""`swarmkv bench serve --scenarios tiers`: an evicted document comes back from a tier
below the pool, against prefilling it again.

One server per configuration, each with a pool that holds the document (--doc-tokens)
and one more request at most (--ctx-size doc + 1,024), so a request over another
document of the same length evicts it:

    fresh      a question over the document, nothing cached (its prefill)
    (pusher)   a question over another document: the first is evicted
    question   another question over the first document
    (pusher)   a third document: evicted again
    turn       the first conversation's next turn (its answer and a new question)

Configurations: `host` (the default host-RAM tier), `disk` (--host-cache-mib 0 with
--cache-dir: evicted prefixes go straight to disk), `none` (--host-cache-mib 0, no
--cache-dir: evicted prefixes are prefilled again). Reported: each request's seconds
and cached tokens, the ratio of `none`'s time to each tier's for `question` and `turn`
(a disk entry is a whole evicted sequence, so only the turn, which starts with all of
it, finds it there), and host RAM used against its limit, sampled from /metrics every
0.2 s while the requests run. Beside them, the same requests on llama-server from the
same pin with one slot of the same size and its host-RAM prompt cache (`--cache-ram`, on
by default), and its time over each of our tiers'.
"""
from __future__ import annotations

import tempfile
import time

from .measure import Peaks
from .peer import log
from .servers import ask, by_label, cached_of, client_of, ours, theirs

CONFIGS = {"host": (), "disk": ("--host-cache-mib", "0", "--cache-dir", "{tmp}"),
           "none": ("--host-cache-mib", "0")}


def timed(client, args, messages: list[dict]) -> dict:
    t0 = time.perf_counter()
    reply = ask(client, args.model, messages, args.gen)
    return {"s": time.perf_counter() - t0, "cached": cached_of(reply.usage),
            "prompt": reply.usage.prompt_tokens, "text": reply.choices[0].message.content}


def sequence(server, args, docs: list[str], questions: list[str]) -> dict:
    """fresh, (pusher), question, (pusher), turn on `server`: each one's seconds and cache."""
    client = client_of(server, args.model)
    first = [{"role": "system", "content": docs[0]}, {"role": "user", "content": questions[0]}]
    row = {"fresh": timed(client, args, first)}
    timed(client, args, [{"role": "system", "content": docs[1]}, {"role": "user", "content": questions[0]}])
    row["question"] = timed(client, args, [first[0], {"role": "user", "content": questions[1]}])
    timed(client, args, [{"role": "system", "content": docs[2]}, {"role": "user", "content": questions[0]}])
    turn = first + [{"role": "assistant", "content": row["fresh"]["text"]}, {"role": "user", "content": questions[2]}]
    row["turn"] = timed(client, args, turn)
    return row


def one_config(args, flags: tuple[str, ...], docs: list[str], questions: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp, \
            ours(args, args.doc_tokens + 1024, extra=tuple(f.format(tmp=tmp) for f in flags)) as server:
        with Peaks(lambda: by_label(server, "swarmkv_host_cache_bytes", by="state")) as host:
            row = sequence(server, args, docs, questions)
        row["host_bytes_most"], row["host_bytes_limit"], row["samples"] = host.most["used"], host.most["limit"], \
            host.samples
    return row


def tier_rows(args, make_doc, questions: list[str]) -> list[dict]:
    docs = [make_doc(str(k)) for k in range(3)]
    got = {name: one_config(args, flags, docs, questions) for name, flags in CONFIGS.items()}
    with theirs(args, 1, args.doc_tokens + 1024) as server:        # its --cache-ram at its default
        got["llama_server"] = sequence(server, args, docs, questions)
    row = {"scenario": "tiers", **{name: r for name, r in got.items()}}
    for name in ("host", "disk"):
        for step in ("question", "turn"):
            row[f"none_over_{name}_{step}"] = got["none"][step]["s"] / got[name][step]["s"]
            row[f"llama_server_over_{name}_{step}"] = got["llama_server"][step]["s"] / got[name][step]["s"]
    row["host_within_limit"] = got["host"]["host_bytes_most"] <= got["host"]["host_bytes_limit"]
    for name, r in got.items():
        log(f"     tiers: {name}: fresh {r['fresh']['s']:.2f} s; question {r['question']['s']:.2f} s "
            f"({r['question']['cached']} cached); turn {r['turn']['s']:.2f} s ({r['turn']['cached']} cached)")
    log(f"     tiers: prefilled again over restored: question host {row['none_over_host_question']:.1f}x, "
        f"turn host {row['none_over_host_turn']:.1f}x, turn disk {row['none_over_disk_turn']:.1f}x; "
        f"host RAM at most {got['host']['host_bytes_most'] / 2**20:.0f} of "
        f"{got['host']['host_bytes_limit'] / 2**20:.0f} MiB ({got['host']['samples']} samples); llama-server "
        f"(-np 1, --cache-ram default) over host: question {row['llama_server_over_host_question']:.2f}x, "
        f"turn {row['llama_server_over_host_turn']:.2f}x")
    return [row]
