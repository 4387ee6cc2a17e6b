"""`swarmkv bench serve --scenarios apis`: N agents at once over one document through each
API agents speak: chat completions (`openai`), the Responses API (`openai`'s
responses.create) and Anthropic's Messages API (`anthropic`), each client unmodified.

Per API, a fresh server of each side (ours; stock llama-server --jinja from the same pin,
-np N --kv-unified), `--repeat` runs alternated between the sides, the median reported.
Two ratios: ours through the API against ours through chat completions (what the new
front costs: the same engine path, so about 1.0x), and llama-server's time against ours
on the same API. Greedy on both sides (the `anthropic` 2.x client passes temperature
through extra_body).
"""
from __future__ import annotations

from .measure import at_once
from .peer import log
from .servers import ours, theirs

APIS = ("chat", "responses", "messages")


def ask_by(api: str, url: str, model: str, doc: str, question: str, gen: int) -> tuple[str, int, int]:
    """One agent's request through `api`: (its text, prompt tokens, prompt tokens from cache)."""
    if api == "messages":
        import anthropic
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=3600)
        m = client.messages.create(model=model, max_tokens=gen, system=doc, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": question}])
        u = m.usage
        return "".join(b.text for b in m.content if b.type == "text"), \
            u.input_tokens + (u.cache_read_input_tokens or 0), u.cache_read_input_tokens or 0
    from openai import OpenAI
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    if api == "responses":
        r = client.responses.create(model=model, instructions=doc, input=question, max_output_tokens=gen,
                                    temperature=0)
        details = r.usage.input_tokens_details
        return r.output_text, r.usage.input_tokens, getattr(details, "cached_tokens", 0) or 0
    c = client.chat.completions.create(model=model, max_tokens=gen, temperature=0,
                                       messages=[{"role": "system", "content": doc}, {"role": "user", "content": question}])
    details = c.usage.prompt_tokens_details
    return c.choices[0].message.content, c.usage.prompt_tokens, getattr(details, "cached_tokens", 0) or 0


def one_run(server, api: str, args, doc: str, questions: list[str]) -> dict:
    ask_by(api, server.url, args.model, "Hi", "Hi", 1)            # the warm-up, as every scenario has
    ms, answers = at_once([lambda q=questions[i % len(questions)]: ask_by(api, server.url, args.model, doc, q, args.gen)
                           for i in range(args.n)])
    return {"total_s": ms / 1e3, "texts": [a[0] for a in answers], "prompt_tokens": sum(a[1] for a in answers),
            "cached_tokens": sum(a[2] for a in answers)}


def api_rows(args, doc: str, questions: list[str]) -> list[dict]:
    cells = args.doc_tokens + 128 + args.gen
    runs = {(api, side): [] for api in APIS for side in ("ours", "server")}
    for r in range(args.repeat):
        for api in APIS:
            for side in (("ours", "server") if r % 2 == 0 else ("server", "ours")):
                server = ours(args, args.n * cells) if side == "ours" else theirs(args, args.n, cells, jinja=True)
                with server:
                    runs[api, side].append(one_run(server, api, args, doc, questions))
    median = {k: {**sorted(v, key=lambda x: x["total_s"])[len(v) // 2], "runs_s": [x["total_s"] for x in v]}
              for k, v in runs.items()}
    rows = []
    for api in APIS:
        mine, theirs_ = median[api, "ours"], median[api, "server"]
        row = {"scenario": f"apis:{api}", "ours": mine, "server": theirs_,
               "server_over_ours": theirs_["total_s"] / mine["total_s"],
               "chat_over_this": median["chat", "ours"]["total_s"] / mine["total_s"],
               "same_as_chat": sum(a == b for a, b in zip(mine["texts"], median["chat", "ours"]["texts"])),
               "answers": args.n}
        log(f"  apis {api:>9}: ours {mine['total_s']:.2f} s ({row['chat_over_this']:.2f}x of chat completions' "
            f"speed, same text {row['same_as_chat']}/{args.n}), llama-server {theirs_['total_s']:.2f} s, "
            f"llama-server / ours {row['server_over_ours']:.2f}x; cached prompt tokens ours {mine['cached_tokens']} "
            f"of {mine['prompt_tokens']}, llama-server {theirs_['cached_tokens']} of {theirs_['prompt_tokens']}")
        rows.append(row)
    return rows
