"""Structured output and tool calls (issue 43), through a real `swarmkv serve` on loopback
and the official `openai` client, as agents send them: response_format json_schema and
json_object, tools under tool_choice required / named / auto, a streamed tool call the
client reassembles, a tool loop rendered through the chat template, llama-server's
`grammar` extra, and LangChain's structured output and tool binding unmodified.

Every JSON answer is checked with `jsonschema` against the schema the request gave, so a
mask that lets one wrong token through fails here. The server runs in exact mode, so an
answer does not depend on what decodes beside it: a constrained request alone must equal
the same request among other constrained and free ones, token for token.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from corpus import LICENCE
from serve_process import MODEL, Serve

pytestmark = pytest.mark.slow

DOC = "Document for structured answers.\n" + LICENCE[:1200]

ANSWER = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 60},
        "confidence": {"enum": ["low", "medium", "high"]},
        "sections": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 3},
        "source": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                                    "year": {"type": "integer"}},
                   "required": ["title", "year"]},
    },
    "required": ["topic", "confidence", "sections", "source"],
}

LOOKUP = {"type": "function", "function": {
    "name": "lookup_section", "description": "Read one numbered section of the licence.",
    "parameters": {"type": "object", "properties": {"section": {"type": "integer", "minimum": 1, "maximum": 9},
                                                    "reason": {"enum": ["definition", "permission", "limit"]}},
                   "required": ["section", "reason"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                      "maxLength": 30}},
                                          "required": ["city"]}}}
TOOLS = [LOOKUP, WEATHER]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with Serve("--exact", "--ctx-size", "16384", "--parallel", "24",
               log=tmp_path_factory.mktemp("structured") / "serve.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": DOC}, {"role": "user", "content": question}]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def ask(client, question: str, max_tokens: int = 96, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", None) or chat(question),
                                          max_tokens=max_tokens, temperature=kw.pop("temperature", 0), **kw)


def valid_calls(message) -> list[tuple[str, dict]]:
    """The message's tool calls as (name, arguments), each checked against its tool."""
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def test_json_schema_answers_validate_nested_enums_and_arrays(client):
    """Greedy and sampled answers alike (seeded draws reach paths greedy never takes)."""
    replies = [ask(client, "Summarise the licence.", response_format=schema_format(ANSWER))]
    replies.append(ask(client, "Summarise the licence.", response_format=schema_format(ANSWER), n=4,
                       temperature=1.0, seed=11))
    choices = [c for r in replies for c in r.choices]
    for c in choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), ANSWER)
    assert len({c.message.content for c in choices}) > 1       # the draws differ, the schema holds


def test_json_object_mode_answers_one_object(client):
    reply = ask(client, "Describe the licence as JSON.", response_format={"type": "json_object"}, max_tokens=64)
    text = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


def test_a_grammar_extra_decides_the_answer(client):
    reply = ask(client, "Is there a warranty? Answer yes or no.", max_tokens=8,
                extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert reply.choices[0].message.content in ("yes", "no") and reply.choices[0].finish_reason == "stop"


def test_tool_choice_required_calls_a_tool_with_valid_arguments(client):
    reply = ask(client, "What does the licence say about patents?", tools=TOOLS, tool_choice="required",
                parallel_tool_calls=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = valid_calls(choice.message)
    assert calls and all(name in PARAMETERS for name, _ in calls)


def test_a_named_tool_choice_calls_that_tool_once(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = ask(client, "Read section 3 of the licence.", tools=TOOLS, tool_choice=named)
    calls = valid_calls(reply.choices[0].message)
    assert [name for name, _ in calls] == ["get_weather"] and reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [{"parallel_tool_calls": False}, {}])
def test_one_call_unless_parallel_calls_are_asked_for(client, parallel):
    """Left out, parallel_tool_calls follows the template, as llama-server's does:
    SmolLM2's knows no tools, so it is offered one call (an open list, it repeats one)."""
    reply = ask(client, "Read sections 1, 2, 3 and 4, then tell me the weather in Paris and Rome.",
                tools=TOOLS, tool_choice="required", n=3, temperature=1.0, seed=5, **parallel)
    for c in reply.choices:
        assert len(valid_calls(c.message)) == 1


def test_tool_choice_auto_answers_in_words_or_calls_well_formed(client):
    """auto lets the model choose; either way the answer is read back, never the raw envelope."""
    reply = ask(client, "Hello! Who are you?", tools=TOOLS, tool_choice="auto", n=4, temperature=1.0, seed=3)
    for c in reply.choices:
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and valid_calls(c.message)
        else:
            assert c.finish_reason == "stop" and isinstance(c.message.content, str)
            assert not c.message.content.lstrip().startswith('{"response"'), c.message.content


def test_tool_choice_none_answers_in_words(client):
    reply = ask(client, "Hello!", tools=TOOLS, tool_choice="none", max_tokens=12)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


def test_a_streamed_tool_call_reassembles_into_the_whole_answer(client):
    """The client's own stream helper joins delta.tool_calls by index; it must give the
    tool call the same request gets unstreamed (exact mode: the same tokens)."""
    kw = dict(model=MODEL, messages=chat("What does the licence say about patents?"), max_tokens=96,
              temperature=0, tools=TOOLS, tool_choice="required")
    whole = client.chat.completions.create(**kw).choices[0].message
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert valid_calls(streamed.message) == valid_calls(whole)


def test_a_tool_loop_continues_from_the_tool_result(client, smol):
    """assistant tool_calls -> tool result -> the final answer: the template gets the call
    and the result (the prompt grows by both), and the model answers in words."""
    question = chat("What does section 2 define?")
    first = ask(client, "", messages=question, tools=TOOLS, tool_choice={"type": "function",
                                                                          "function": {"name": "lookup_section"}})
    call = first.choices[0].message.tool_calls[0]
    result = "Section 2: Grant of Copyright License, perpetual, worldwide, non-exclusive."
    loop = question + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = ask(client, "", messages=loop, tools=TOOLS, tool_choice="auto", max_tokens=48)
    told = len(smol.tokenize(result, add_special=False)) + len(smol.tokenize(call.function.arguments,
                                                                            add_special=False))
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + told
    message = final.choices[0].message
    assert message.content or valid_calls(message)


@pytest.mark.fidelity
def test_a_constrained_request_alone_equals_it_among_others(server, client):
    """Exact mode: masks are per row, so the batch around a constrained request does not
    change it: alone, then beside free and other constrained requests, token for token."""
    kw = dict(response_format=schema_format(ANSWER))
    alone = ask(client, "Summarise the licence.", **kw).choices[0].message.content
    tool_alone = valid_calls(ask(client, "What about patents?", tools=TOOLS, tool_choice="required")
                             .choices[0].message)
    others = [lambda: ask(client, "Who may use the work?", max_tokens=48),
              lambda: ask(client, "What is excluded?", **kw),
              lambda: ask(client, "Summarise the licence.", **kw),
              lambda: ask(client, "What about patents?", tools=TOOLS, tool_choice="required"),
              lambda: ask(server.client(), "Is there a warranty?", max_tokens=40, temperature=0.8, seed=1)]
    with cf.ThreadPoolExecutor(len(others)) as pool:
        replies = [f.result() for f in [pool.submit(o) for o in others]]
    assert replies[2].choices[0].message.content == alone
    assert valid_calls(replies[3].choices[0].message) == tool_alone
    jsonschema.validate(json.loads(replies[1].choices[0].message.content), ANSWER)


def test_sixteen_agents_with_the_same_tools_share_one_prefill(server):
    """The tools are part of the prompt: agents with the same document and tools fork it."""
    client = server.client()
    doc = "A document for tool agents.\n" + LICENCE[1200:2600]
    messages = [[{"role": "system", "content": doc}, {"role": "user", "content": f"Question {i}: read a section."}]
                for i in range(16)]
    with cf.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda m: client.chat.completions.create(
            model=MODEL, messages=m, max_tokens=48, temperature=0, tools=TOOLS, tool_choice="required"), messages))
    prompt = replies[0].usage.prompt_tokens
    cached = sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    assert cached >= 14 * (prompt - 24), ([r.usage.prompt_tokens_details.cached_tokens for r in replies], prompt)    # all but the first fork the document and tools
    for r in replies:
        valid_calls(r.choices[0].message)


class Verdict(BaseModel):
    """What LangChain's structured output asks for, as a pydantic model."""
    topic: str = Field(max_length=60)
    warranty: Literal["yes", "no", "unclear"]
    sections: list[int] = Field(max_length=3)


def test_langchain_structured_output_and_a_named_tool(server):
    """LangChain's ChatOpenAI, unmodified: with_structured_output(method="json_schema")
    parses into its pydantic model, and bind_tools with a named tool_choice calls it."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def lookup_section(section: int) -> str:
        """Read one numbered section of the licence."""
        return f"Section {section}"
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=96,
                     max_retries=0)
    verdict = llm.with_structured_output(Verdict, method="json_schema").invoke(chat("Is there a warranty?"))
    assert isinstance(verdict, Verdict)
    reply = llm.bind_tools([lookup_section], tool_choice="lookup_section").invoke(chat("What does section 3 say?"))
    assert [c["name"] for c in reply.tool_calls] == ["lookup_section"]
    assert isinstance(reply.tool_calls[0]["args"]["section"], int)
