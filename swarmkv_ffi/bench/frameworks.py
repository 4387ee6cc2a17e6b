"""`swarmkv bench frameworks`: agent frameworks no one here wrote, unmodified, against
`swarmkv serve` and llama.cpp's llama-server --jinja from the same pin (issue 43's
held-out run, repeatable).

Seven checks, each the way a framework's own docs use it, on both servers in one run,
with the same model, threads, document and `--max-tokens` (llama-server has no default
cap; ours 1024, so both get the same):

    structured      LangChain ChatOpenAI.with_structured_output(Answer, method="json_schema"), 3 questions
    named_tool      LangChain bind_tools([lookup_section], tool_choice="lookup_section")
    batch           LangChain ChatOpenAI.batch over 16 questions on one document
    map_reduce      LangGraph: Send one node per question (4), the answers reduced
    stream_usage    LangChain streaming with stream_usage=True
    output_type     the OpenAI Agents SDK: Agent(output_type=Answer) on OpenAIChatCompletionsModel
    function_tool   the OpenAI Agents SDK: a function tool with tool_choice="required" (the tool must run)

Reported: pass or fail per check per server, with what it got and its seconds.
Needs the frameworks: `pip install langchain-openai langgraph openai-agents` (the
`bench` extra has them).

    swarmkv bench frameworks --out bench/results/X/frameworks
"""
from __future__ import annotations

import argparse
import operator
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Literal, TypedDict

from pydantic import BaseModel, Field

from .. import catalog
from .measure import EXAMPLES, report_json, settings_of
from .peer import HttpServer, Server, log, server_binary

DOC = (EXAMPLES / "apache-2.0.txt").read_text()[:6000]
QUESTIONS = ["Who may use the work?", "Is there a warranty?", "What is a Contribution?"]


class Answer(BaseModel):
    answer: str = Field(description="one sentence")
    confidence: Literal["low", "medium", "high"]


def checks(base_url: str, model: str, max_tokens: int) -> dict[str, tuple]:
    """Every check against one server: name -> (passed, what it got, seconds)."""
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(base_url=base_url, api_key="none", model=model, temperature=0, max_tokens=max_tokens,
                     max_retries=0)
    ran: list[int] = []
    out = {}
    for name, fn in (("structured", structured), ("named_tool", named_tool), ("batch", batch),
                     ("map_reduce", map_reduce), ("stream_usage", stream_usage)):
        out[name] = timed(fn, llm)
    for name, fn in (("output_type", output_type), ("function_tool", function_tool)):
        out[name] = timed(fn, base_url, model, max_tokens, ran)
    return out


def timed(fn, *args) -> tuple:
    t0 = time.perf_counter()
    try:
        ok, got = fn(*args)
    except Exception as exc:        # a framework's failure is the check's result
        ok, got = False, f"{type(exc).__name__}: {str(exc)[:300]}"
    return ok, got, time.perf_counter() - t0


def structured(llm):
    s = llm.with_structured_output(Answer, method="json_schema")
    parsed = 0
    for q in QUESTIONS:
        try:
            parsed += isinstance(s.invoke([("system", DOC), ("user", q)]), Answer)
        except Exception as exc:
            log(f"  structured: {q!r}: {type(exc).__name__}: {str(exc)[:120]}")
    return parsed == len(QUESTIONS), f"{parsed}/{len(QUESTIONS)} parsed"


def named_tool(llm):
    from langchain_core.tools import tool

    @tool
    def lookup_section(section: int) -> str:
        """Read one numbered section of the licence."""
        return f"Section {section}"
    reply = llm.bind_tools([lookup_section], tool_choice="lookup_section").invoke(
        [("system", DOC), ("user", "What does section 3 say?")])
    calls = reply.tool_calls
    return bool(calls) and calls[0]["name"] == "lookup_section", str(calls)[:200]


def batch(llm):
    replies = llm.batch([[("system", DOC), ("user", f"Question {i}: what is section {i}?")] for i in range(16)])
    return all(r.content for r in replies), f"{sum(bool(r.content) for r in replies)}/16 answered"


def map_reduce(llm):
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send

    class State(TypedDict):
        questions: list
        answers: Annotated[list, operator.add]

    def ask(state):
        return {"answers": [llm.invoke([("system", DOC), ("user", state["q"])]).content]}
    graph = StateGraph(State)
    graph.add_node("ask", ask)
    graph.add_conditional_edges(START, lambda s: [Send("ask", {"q": q}) for q in s["questions"]])
    graph.add_edge("ask", END)
    out = graph.compile().invoke({"questions": [f"Question {i}: what is section {i}?" for i in range(4)],
                                  "answers": []})
    return len(out["answers"]) == 4 and all(out["answers"]), f"{len(out['answers'])} answers"


def stream_usage(llm):
    chunks = list(llm.stream([("user", "Hi")], stream_usage=True))
    total = sum(chunks[1:], chunks[0])
    usage = total.usage_metadata
    return bool(usage and usage["output_tokens"] > 0), str(usage)


def agents_model(base_url: str, model: str):
    from agents import OpenAIChatCompletionsModel, set_tracing_disabled
    from openai import AsyncOpenAI
    set_tracing_disabled(True)
    return OpenAIChatCompletionsModel(model=model, openai_client=AsyncOpenAI(base_url=base_url, api_key="none",
                                                                             max_retries=0))


def output_type(base_url: str, model: str, max_tokens: int, ran: list):
    from agents import Agent, ModelSettings, Runner
    agent = Agent(name="reader", instructions=DOC, model=agents_model(base_url, model), output_type=Answer,
                  model_settings=ModelSettings(temperature=0, max_tokens=max_tokens))
    result = Runner.run_sync(agent, QUESTIONS[0])
    return isinstance(result.final_output, Answer), str(result.final_output)[:200]


def function_tool(base_url: str, model: str, max_tokens: int, ran: list):
    from agents import Agent, ModelSettings, Runner
    from agents import function_tool as tool

    @tool
    def lookup(section: int) -> str:
        """Read one numbered section of the licence."""
        ran.append(section)
        return f"Section {section}: the licence grants rights."
    agent = Agent(name="reader", instructions=DOC, model=agents_model(base_url, model), tools=[lookup],
                  model_settings=ModelSettings(temperature=0, max_tokens=max_tokens, tool_choice="required"),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, "What does section 2 say?", max_turns=3)
    return bool(ran), f"the tool ran with {ran}; final output {str(result.final_output)[:100]!r}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench frameworks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=catalog.DEFAULT_MODEL, help="a packaged short name (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="every request's max_tokens (default 1024)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="CPU threads, both sides")
    ap.add_argument("--server", type=Path, default=None,
                    help="llama-server binary (default: the stock one from ./build_llama.sh --tools)")
    ap.add_argument("--sides", default="ours,llama-server", help="which servers to check (default: both)")
    ap.add_argument("--out", type=Path, default=None, help="folder for frameworks.json")
    args = ap.parse_args(argv)
    try:
        import agents, langchain_openai, langgraph  # noqa: F401 - only checking they are there
    except ImportError as exc:
        print(f"swarmkv bench frameworks: {exc.name} is not installed: "
              "pip install langchain-openai langgraph openai-agents", file=sys.stderr)
        return 2
    sides = args.sides.split(",")
    if "llama-server" in sides:
        args.server = server_binary(args.server, "swarmkv bench frameworks")
        if args.server is None:
            return 2
    model_path = catalog.resolve(args.model)
    results = {}
    for side in sides:
        if side == "ours":
            server = HttpServer(lambda port: [sys.executable, "-m", "swarmkv_ffi.cli", "serve", "--model", args.model,
                                              "--port", str(port), "--threads", str(args.threads)], "swarmkv serve")
        else:
            server = Server(args.server, model_path, args.threads, ["-np", "16", "--kv-unified", "-c", "32768",
                                                                    "--jinja"])
        with server:
            results[side] = checks(server.url + "/v1", args.model, args.max_tokens)
        for name, (ok, got, seconds) in results[side].items():
            log(f"{side:>12} {name:>13}: {'pass' if ok else 'FAIL'} ({seconds:.1f} s) {got}")
    rows = [{"check": name, **{side: {"passed": r[name][0], "got": r[name][1], "seconds": r[name][2]}
                               for side, r in results.items()}} for name in next(iter(results.values()))]
    report = {"benchmark": "frameworks", "model": args.model,
              "passed": {side: sum(r[0] for r in res.values()) for side, res in results.items()},
              "checks": len(rows), "rows": rows,
              "server_flags": "-np 16 --kv-unified -c 32768 --jinja; ours: swarmkv serve on its defaults"}
    report_json(report, args.out / "frameworks.json" if args.out else None, settings_of(args),
                shown={"passed": report["passed"], "checks": len(rows)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
