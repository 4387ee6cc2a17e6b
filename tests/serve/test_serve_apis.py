"""The Responses API and Anthropic's Messages API (issue 61), through a real `swarmkv serve`
on loopback, driven by the clients agents use, unmodified: `openai` (responses.create,
plain and streamed), `openai-agents` (its Responses model, a required tool, an
output_type) and `anthropic` (messages.create, messages.stream, count_tokens, tools).

The server runs in exact mode with two keys, so an answer does not depend on what ran
beside it: the same conversation through chat completions, the Responses API and the
Messages API is one internal request and must give the same tokens.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import jsonschema
import pytest
import requests

from corpus import LICENCE
from serve_process import MODEL, Serve

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "key-a-0123456789", "key-b-0123456789"
DOC = "Document for agents.\n" + LICENCE[:1400]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
#: The `anthropic` SDK (2.x) has no temperature argument; the API still takes the field.
GREEDY = {"extra_body": {"temperature": 0}}
ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("apis")
    (folder / "keys").write_text(f"{KEY_A} alice\n{KEY_B} bob\n")
    with Serve("--exact", "--ctx-size", "16384", "--parallel", "16", "--api-key-file", str(folder / "keys"),
               log=folder / "serve.log") as s:
        yield s


def claude(server, key: str = KEY_A) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=300)


def post(server, path: str, body: dict, key: str = KEY_A) -> requests.Response:
    return requests.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)


# ---- one engine: the three APIs give the same tokens --------------------------------------------

def test_the_three_apis_run_one_request(server):
    chat = server.client(KEY_A).chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}])
    response = server.client(KEY_A).responses.create(model=MODEL, instructions="Be brief.", input="Name a fruit.",
                                                     max_output_tokens=24, temperature=0)
    message = claude(server).messages.create(model=MODEL, max_tokens=24, **GREEDY, system="Be brief.",
                                             messages=[{"role": "user", "content": "Name a fruit."}])
    text = chat.choices[0].message.content
    assert text and response.output_text == text and message.content[0].text == text
    assert response.id.startswith("resp_") and response.output[0].id.startswith("msg_")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    total = message.usage.input_tokens + message.usage.cache_read_input_tokens + message.usage.cache_creation_input_tokens
    assert total == chat.usage.prompt_tokens
    assert response.usage.output_tokens == message.usage.output_tokens == chat.usage.completion_tokens
    finished = {"length": ("incomplete", "max_tokens"), "stop": ("completed", "end_turn")}
    assert (response.status, message.stop_reason) == finished[chat.choices[0].finish_reason]


def test_a_model_name_the_server_does_not_know_is_its_one_model(server):
    """llama-server's own tests send "test" and "gpt-4.1": a server of one model answers them."""
    message = claude(server).messages.create(model="test", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert message.model == MODEL and message.usage.output_tokens > 0


# ---- the Responses API --------------------------------------------------------------------------

def test_responses_stream_reassembles_to_the_answer(server):
    client = server.client(KEY_A)
    whole = client.responses.create(model=MODEL, input="Tell me about books.", max_output_tokens=20, temperature=0)
    events = list(client.responses.create(model=MODEL, input="Tell me about books.", max_output_tokens=20,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert all(e.item_id == final.output[0].id for e in events if e.type == "response.output_text.delta")
    # the SDK's own accumulator agrees
    with client.responses.stream(model=MODEL, input="Tell me about books.", max_output_tokens=20,
                                 temperature=0) as stream:
        for _ in stream:
            pass
    if whole.status == "completed":
        assert stream.get_final_response().output_text == whole.output_text


def test_responses_tool_loop(server):
    """A required function tool: a function_call item whose arguments follow its schema;
    then the call and its output sent back give a final message."""
    client = server.client(KEY_A)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model=MODEL, input=ask, tools=tools, tool_choice="required",
                                    max_output_tokens=64, temperature=0)
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert first.status == "completed"
    back = ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                  {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C"}]
    final = client.responses.create(model=MODEL, input=back, tools=tools, tool_choice="none", max_output_tokens=32,
                                    temperature=0)
    assert final.output[0].type == "message" and final.output_text
    streamed = list(client.responses.create(model=MODEL, input=ask, tools=tools, tool_choice="required",
                                            max_output_tokens=64, temperature=0, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert len(done) == 1 and done[0].arguments == deltas == call.arguments


def test_responses_json_schema_format(server):
    out = server.client(KEY_A).responses.create(
        model=MODEL, input="Paris is sunny today. Which city, and is it sunny?", max_output_tokens=64,
        temperature=0, text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}})
    jsonschema.validate(json.loads(out.output_text), ANSWER)


def test_previous_response_id_forks_the_stored_prefix_for_its_key_only(server):
    a = server.client(KEY_A)
    document = "Read this first.\n" + DOC          # (no other test sends it: nothing cached for it yet)
    first = a.responses.create(model=MODEL, instructions=document, input="What is this document?", max_output_tokens=16,
                               temperature=0)
    second = a.responses.create(model=MODEL, instructions=document, previous_response_id=first.id,
                                input="Who wrote it?", max_output_tokens=16, temperature=0)
    # the second turn's prompt is the first turn's, its answer, then the new question
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert a.responses.retrieve(first.id).output_text == first.output_text
    b = server.client(KEY_B)
    with pytest.raises(Exception) as refused:
        b.responses.create(model=MODEL, previous_response_id=first.id, input="Who wrote it?", max_output_tokens=4)
    assert refused.value.status_code == 400 and "not found" in str(refused.value)
    with pytest.raises(Exception) as hidden:
        b.responses.retrieve(first.id)
    assert hidden.value.status_code == 404
    # the same conversation sent whole by the other key forks nothing of the first key's cells
    replay = [{"role": "user", "content": "What is this document?"},
              {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Who wrote it?"}]
    other = b.responses.create(model=MODEL, instructions=document, input=replay, max_output_tokens=16, temperature=0)
    assert other.usage.input_tokens_details.cached_tokens == 0
    assert other.output_text == second.output_text          # the same prompt, in exact mode
    a.responses.delete(first.id)
    with pytest.raises(Exception) as gone:
        a.responses.retrieve(first.id)
    assert gone.value.status_code == 404


@pytest.mark.parametrize("field,value", [
    ("background", True), ("reasoning", {"effort": "high"}), ("include", ["file_search_call.results"]),
    ("truncation", "auto"), ("conversation", "conv_1"),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
    ("tools", [{"type": "web_search"}]), ("keep_alive", "soon"), ("stop", ["a", "b", "c", "d", "e"])])
def test_responses_fields_not_acted_on_are_refused_by_name(server, field, value):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, field: value}
    answer = post(server, "/v1/responses", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"].split(".")[0] == field
    if field == "input":
        assert "image input is not supported" in error["message"]


def test_the_agents_sdk_runs_a_required_tool_and_an_output_type(server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI
    from pydantic import BaseModel
    set_tracing_disabled(True)
    model = OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY_A,
                                                                        max_retries=0, timeout=300))
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    class Answer(BaseModel):
        city: str
        sunny: bool

    async def run():
        tool_agent = Agent(name="weather", instructions="Answer about the weather.", model=model, tools=[get_weather],
                           tool_use_behavior="stop_on_first_tool",
                           model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0))
        ran = await Runner.run(tool_agent, "What is the weather in Paris?")
        typed = Agent(name="extract", instructions="Extract the city and whether it is sunny.", model=model,
                      output_type=Answer, model_settings=ModelSettings(max_tokens=64, temperature=0))
        plain = await Runner.run(typed, "Paris is sunny today.")
        streamed = Runner.run_streamed(typed, "Paris is sunny today.")
        async for _ in streamed.stream_events():
            pass
        return ran, plain, streamed
    ran, plain, streamed = asyncio.run(run())
    assert calls and ran.final_output == f"Sunny in {calls[0]}"
    assert isinstance(plain.final_output, Answer) and plain.final_output == streamed.final_output


# ---- Anthropic's Messages API -------------------------------------------------------------------

def test_messages_stream_and_count_tokens(server):
    client = claude(server)
    ask = dict(model=MODEL, max_tokens=20, **GREEDY, system=[{"type": "text", "text": "Be brief."}],
               messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me about books."}]}])
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    counted = client.messages.count_tokens(model=MODEL, system=ask["system"], messages=ask["messages"])
    usage = final.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert usage.cache_read_input_tokens > 0          # the same prompt again: forked from the key's cells


def test_messages_stop_sequence_is_named(server):
    client = claude(server)
    ask = dict(model=MODEL, max_tokens=24, **GREEDY, messages=[{"role": "user", "content": "Tell a story."}])
    free = client.messages.create(**ask).content[0].text
    word = free.split()[3]
    stopped = client.messages.create(**ask, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == free[:free.index(word)]


def test_messages_forced_tool_and_tool_loop(server):
    client = claude(server)
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    used = client.messages.create(model=MODEL, max_tokens=64, **GREEDY, tools=tools, messages=ask,
                                  tool_choice={"type": "tool", "name": "get_weather"})
    block = used.content[0]
    assert used.stop_reason == "tool_use" and block.type == "tool_use" and block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER)
    with client.messages.stream(model=MODEL, max_tokens=64, **GREEDY, tools=tools, messages=ask,
                                tool_choice={"type": "any"}) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].type == "tool_use" and streamed.content[0].input == block.input
    loop = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": block.id, "name": block.name,
                                                     "input": block.input}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                "content": "Sunny, 25 C"}]}]
    final = client.messages.create(model=MODEL, max_tokens=32, **GREEDY, tools=tools, messages=loop,
                                   tool_choice={"type": "none"})
    assert final.content[0].type == "text" and final.content[0].text


def test_messages_errors_in_anthropics_shape(server):
    client = claude(server)
    with pytest.raises(anthropic.AuthenticationError):
        claude(server, "not-a-key-at-all").messages.create(model=MODEL, max_tokens=4,
                                                            messages=[{"role": "user", "content": "Hi"}])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert "image input is not supported" in str(refused.value)
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    for body in ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},                   # no max_tokens
                 {"model": MODEL, "max_tokens": 4, "messages": [], "tools": [{"type": "bash_20250124", "name": "bash"}]},
                 {"model": MODEL, "max_tokens": 4, "messages": [], "service_tier": "priority"}):
        answer = requests.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY_A}, timeout=60)
        assert answer.status_code == 400 and answer.json()["type"] == "error", answer.text
        assert answer.json()["error"]["type"] == "invalid_request_error"


def test_a_changing_billing_header_does_not_defeat_the_prefix_cache(server):
    """Claude-Code-style turns: the billing line's cch= changes on every request; the
    second turn still forks the document from the first."""
    client = claude(server, KEY_B)

    def turn(cch: str, messages: list):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; "
                                           f"cch={cch};"},
                  {"type": "text", "text": DOC}]
        return client.messages.create(model=MODEL, max_tokens=12, **GREEDY, system=system, messages=messages)
    ask = [{"role": "user", "content": "What is this document?"}]
    first = turn("a5145", ask)
    second = turn("0f3e2", ask + [{"role": "assistant", "content": first.content[0].text},
                                  {"role": "user", "content": "Who may use it?"}])
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_metrics_count_requests_by_api(server):
    def counts() -> dict[str, float]:
        scrape = requests.get(server.url + "/metrics", headers={"x-api-key": KEY_A}, timeout=30).text
        return {line.split('api="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines()
                if line.startswith("swarmkv_requests_by_api_total")}
    before = counts()
    server.client(KEY_A).responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    claude(server).messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    claude(server).messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    after = counts()
    assert {api: after[api] - before[api] for api in after} == {"chat": 0, "completions": 0, "responses": 1,
                                                                "messages": 2, "embeddings": 0, "rerank": 0}


# ---- what llama-server's own clients read (its suite, test_compat_*.py) -------------------------

def sse_data(response: requests.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines(decode_unicode=True)
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_llama_server_telemetry_on_a_responses_stream(templated):
    """timings_per_token and return_progress, on the bare /responses route as llama-server's
    clients call it: prompt_progress events before the text (the cache, then the prompt
    read: one step for a prompt this short), timings on every delta and on the last
    event; the second same request reports its prompt from the cache (on a server nothing
    else has used, so its pool still holds the first)."""
    body = {"model": MODEL, "input": "Telemetry. " + DOC[700:950], "max_output_tokens": 6, "temperature": 0, "stream": True,
            "timings_per_token": True, "return_progress": True}
    runs = []
    for _ in range(2):
        with requests.post(templated.url + "/responses", json=body, stream=True, timeout=300) as answer:
            assert answer.status_code == 200, answer.text
            runs.append(sse_data(answer))
    for events in runs:
        progress = [e for e in events if "prompt_progress" in e]
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        last = events[-1]
        assert len(progress) == 2 and {e["type"] for e in progress} == {"response.in_progress"}
        assert events.index(progress[-1]) < events.index(deltas[0])
        cache, read = (e["prompt_progress"] for e in progress)
        assert cache["processed"] == cache["cache"] and read["processed"] == read["total"]
        assert read["total"] == last["response"]["usage"]["input_tokens"]
        assert [d["timings"]["predicted_n"] for d in deltas] == sorted(d["timings"]["predicted_n"] for d in deltas)
        assert last["timings"]["predicted_n"] == last["response"]["usage"]["output_tokens"]
        assert last["timings"]["cache_n"] == last["response"]["usage"]["input_tokens_details"]["cached_tokens"]
    first, second = ([e for e in events if "prompt_progress" in e][-1]["prompt_progress"] for events in runs)
    assert second["cache"] > first["cache"] and second["processed"] == second["total"]


def test_routes_answer_without_v1_as_llama_servers_do(server):
    auth = {"Authorization": f"Bearer {KEY_A}"}
    assert requests.get(server.url + "/models", headers=auth, timeout=30).json()["data"][0]["id"] == MODEL
    assert requests.get(server.url + "/v1/health", timeout=30).status_code == 200
    chat = post(server, "/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1


#: A chat template that renders an assistant's reasoning, as thinking models' templates do.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>\n{% endif %}"
    "{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """A server with --chat-template-file and the smallest pool llama-server's tests use."""
    folder = tmp_path_factory.mktemp("templated")
    (folder / "thinking.jinja").write_text(THINKING_TEMPLATE)
    with Serve("--chat-template-file", str(folder / "thinking.jinja"), "--ctx-size", "256",
               log=folder / "serve.log") as s:
        yield s


def test_apply_template_renders_reasoning_through_a_chat_template_file(templated):
    messages = [{"role": "user", "content": "Fix the bug"},
                {"role": "assistant", "content": "Done.", "reasoning_content": "Check main.py first."},
                {"role": "user", "content": "Thanks"}]
    got = post(templated, "/apply-template", {"messages": messages})
    assert got.status_code == 200, got.text
    assert got.json()["prompt"] == ("<|im_start|>user\nFix the bug<|im_end|>\n<|im_start|>assistant\n"
                                    "<think>Check main.py first.</think>\nDone.<|im_end|>\n"
                                    "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    wrong = post(templated, "/apply-template", {"messages": [{"role": "user", "content": "Hi",
                                                              "reasoning_content": "no"}]})
    assert wrong.status_code == 400 and "reasoning_content" in wrong.text


def test_anthropic_thinking_blocks_reach_the_template(templated):
    """An earlier turn's thinking block is that turn's reasoning_content: counted where the
    template renders it (llama-server's test_anthropic_thinking_history_in_count_tokens)."""
    def count(blocks: list) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Fix the bug"},
                                             {"role": "assistant", "content": blocks},
                                             {"role": "user", "content": "Go on"}]}
        answer = requests.post(templated.url + "/v1/messages/count_tokens", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["input_tokens"]
    said = {"type": "text", "text": "Looking."}
    thought = {"type": "thinking", "thinking": "I should list the files first.", "signature": "x"}
    assert count([thought, said]) > count([said])
    redacted = {"type": "redacted_thinking", "data": "opaque"}
    assert count([redacted, said]) == count([said])


def test_a_built_in_template_by_name_renders_the_chat(tmp_path):
    """--chat-template NAME is libllama's built-in template (llama-server's test_apply_chat_template)."""
    with Serve("--chat-template", "command-r", "--ctx-size", "256", log=tmp_path / "serve.log") as s:
        got = post(s, "/apply-template", {"messages": [{"role": "system", "content": "You are a test."},
                                                       {"role": "user", "content": "Hi there"}]})
        assert got.status_code == 200, got.text
        assert got.json()["prompt"] == (
            "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
            "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
            "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
        assert requests.get(s.url + "/props", timeout=30).json()["chat_template"] == "command-r"
        answer = post(s, "/v1/chat/completions", {"model": MODEL, "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1, answer.text


@pytest.mark.parametrize("value,said", [("command-rr", "neither a built-in template"),
                                        ("{% for %}", "neither a built-in template")])
def test_a_chat_template_that_is_neither_a_name_nor_jinja_is_refused(value, said):
    from swarmkv_ffi.serve.settings import Settings
    with pytest.raises(ValueError, match=said):
        Settings(chat_template=value).check()
    with pytest.raises(ValueError, match="not both"):
        Settings(chat_template="llama3", chat_template_file=Path("t.jinja")).check()


@pytest.mark.parametrize("text,said", [(None, "No such file"), ("{% for %}", "not a Jinja template")])
def test_a_chat_template_file_that_cannot_be_used_is_refused_before_loading(tmp_path, text, said):
    from swarmkv_ffi.serve.settings import Settings
    path = tmp_path / "template.jinja"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=said) as info:
        Settings(chat_template_file=path).check()
    assert str(path) in str(info.value)
