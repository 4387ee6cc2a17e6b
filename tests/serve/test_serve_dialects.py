"""A model family's own tool-call form and thoughts through a real `swarmkv serve` and the
`openai` client: SmolLM2 served with a Qwen-style chat template (tools told by the
template, calls as `<tool_call>` blocks, the answer's thought opened by the prompt as
DeepSeek R1's template opens it). The grammar makes even a model never trained on the
form call in it; arguments stream as they are generated; thoughts come back as
reasoning_content. Exact mode: the same request streamed and whole gives the same tokens.
"""
from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest

from corpus import LICENCE
from serve_process import MODEL, Serve

pytestmark = pytest.mark.slow

#: Qwen 2.5's template in substance (tools in <tools>, calls in <tool_call>, results in
#: <tool_response>), with the generation prompt opening a thought, closed at once when
#: enable_thinking is false (as the pin's DeepSeek R1 and QwQ templates do).
TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools

You may call one or more functions to assist with the user query.
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% if not enable_thinking %}</think>

{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup_section", "parameters": {"type": "object", "properties": {
        "section": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["section"]}}}
TOOLS = [WEATHER, LOOKUP]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "system", "content": "Document.\n" + LICENCE[:600]},
            {"role": "user", "content": "What is the weather in Oslo?"}]


def templated(where, template: str, *flags: str) -> Serve:
    """`swarmkv serve --exact` rendering its chats with `template` (written under `where`)."""
    (where / "chat.jinja").write_text(template)
    return Serve("--exact", "--chat-template-file", str(where / "chat.jinja"), *flags, log=where / "serve.log")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with templated(tmp_path_factory.mktemp("dialects"), TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def ask(client, max_tokens=64, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", QUESTION), max_tokens=max_tokens,
                                          temperature=kw.pop("temperature", 0), **kw)


def checked(calls) -> list[tuple[str, dict]]:
    out = []
    for c in calls:
        arguments = json.loads(c.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[c.function.name])
        out.append((c.function.name, arguments))
    return out


def streamed_calls(client, max_tokens: int, **kw):
    """QUESTION streamed with the client's stream helper: (how many pieces carried each
    call's arguments, the final choice)."""
    pieces = Counter()
    with client.chat.completions.stream(model=MODEL, messages=QUESTION, max_tokens=max_tokens, temperature=0,
                                        **kw) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices and event.chunk.choices[0].delta.tool_calls:
                pieces.update(t.index for t in event.chunk.choices[0].delta.tool_calls if t.function.arguments)
        return pieces, stream.get_final_completion().choices[0]


def loop_prompt(server) -> str:
    """The prompt (/apply-template) of a tool loop: a call to get_weather, its result."""
    import requests
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Oslo", "unit": "celsius"}'}}
    messages = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    return requests.post(server.url + "/apply-template", json={"model": MODEL, "messages": messages, "tools": TOOLS},
                         timeout=60).json()["prompt"]


def test_the_template_tells_the_tools_and_renders_calls_in_its_own_form(server):
    """No generic JSON form told in the system message; an earlier call is written back
    as a <tool_call> block with its arguments as JSON (not JSON text quoted again)."""
    prompt = loop_prompt(server)
    assert '"name": "get_weather"' in prompt and "tool_calls" not in prompt.split("<tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>' \
        in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and prompt.endswith("<think>\n")


def test_a_required_call_in_the_models_form_streams_its_arguments(client):
    """The client's stream helper joins the pieces; more than one piece carries arguments
    (they stream as generated), and the call equals the unstreamed answer's."""
    kw = dict(tools=TOOLS, tool_choice="required")
    whole = ask(client, **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    pieces, streamed = streamed_calls(client, 64, **kw)
    assert sum(pieces.values()) > 1
    assert streamed.finish_reason == "tool_calls"
    assert checked(streamed.message.tool_calls) == checked(whole.message.tool_calls)


def test_parallel_calls_in_the_models_form(client):
    reply = ask(client, max_tokens=160, tools=TOOLS, tool_choice="required", parallel_tool_calls=True, n=3,
                temperature=1.0, seed=4)
    for c in reply.choices:
        if c.finish_reason == "tool_calls":
            assert checked(c.message.tool_calls)
        else:
            assert c.finish_reason == "length" and "<tool_call>" in c.message.content


def test_auto_answers_in_words_or_in_calls(client):
    reply = ask(client, tools=TOOLS, tool_choice="auto", n=4, temperature=1.0, seed=2)
    for c in reply.choices:
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and checked(c.message.tool_calls)
        else:
            assert "<tool_call>" not in (c.message.content or "")


def test_a_thought_the_prompt_opens_is_reasoning_content_whole_and_streamed(client):
    whole = ask(client, max_tokens=24, messages=[{"role": "user", "content": "Hello!"}]).choices[0].message
    assert whole.reasoning_content and not whole.content
    thought = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                                max_tokens=24, temperature=0, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        assert delta is None or not delta.content
        thought += (getattr(delta, "reasoning_content", None) or "") if delta else ""
    assert thought == whole.reasoning_content


def test_a_thought_closed_in_the_answer_splits_it(client):
    """A grammar that writes a thought, then words: the thought is reasoning_content."""
    grammar = 'root ::= "<think>" [a-z]{2,8} " " [a-z]{2,8} "</think>" [a-z]{2,8}'
    kw = dict(max_tokens=40, extra_body={"grammar": grammar}, messages=[{"role": "user", "content": "Hi"}])
    message = ask(client, **kw).choices[0].message
    assert message.reasoning_content and " " in message.reasoning_content
    assert message.content and message.content.isalpha()
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(model=MODEL, temperature=0, stream=True, **kw):
        for field in parts:
            parts[field] += (getattr(chunk.choices[0].delta, field, None) or "") if chunk.choices else ""
    assert (parts["reasoning_content"], parts["content"]) == (message.reasoning_content, message.content)


def test_the_responses_and_messages_apis_give_the_thought_its_own_item(server, client):
    """The same thought as chat's reasoning_content: a reasoning item (Responses API) and
    a thinking block (Messages API), whole and streamed through each SDK's accumulator."""
    import anthropic
    hello = [{"role": "user", "content": "Hello!"}]
    thought = ask(client, max_tokens=24, messages=hello).choices[0].message.reasoning_content
    kw = dict(model=MODEL, input="Hello!", max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kw)
    streamed = list(client.responses.create(stream=True, **kw))[-1].response     # incomplete: cut at 24 tokens
    for response in (whole, streamed):
        assert response.output[0].type == "reasoning" and response.output[0].content[0].text == thought
    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300).messages
    kw = dict(model=MODEL, max_tokens=24, messages=hello, extra_body={"temperature": 0})
    with messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    for message in (messages.create(**kw), streamed):
        assert message.content[0].type == "thinking" and message.content[0].thinking == thought


def test_reasoning_format_none_leaves_the_thought_in_the_text(tmp_path, client):
    hello = [{"role": "user", "content": "Hello!"}]
    thought = ask(client, max_tokens=24, messages=hello).choices[0].message.reasoning_content
    with templated(tmp_path, TEMPLATE, "--reasoning-format", "none") as plain:
        message = ask(plain.client(), max_tokens=24, messages=hello).choices[0].message
    assert message.content.strip() == thought and getattr(message, "reasoning_content", None) is None


def test_the_responses_and_messages_apis_stream_a_calls_arguments_as_written(server, client):
    """A required call through each API's SDK: a call's arguments arrive in more than
    one delta, and the streamed call equals the unstreamed one (exact mode)."""
    import anthropic
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    kw = dict(model=MODEL, input=question, tools=tools, tool_choice="required", max_output_tokens=64, temperature=0)
    whole = client.responses.create(**kw).output[0]
    events = list(client.responses.create(stream=True, **kw))
    per_call = Counter(e.output_index for e in events if e.type == "response.function_call_arguments.delta")
    assert max(per_call.values()) > 1
    streamed = events[-1].response.output[0]
    assert streamed.type == whole.type == "function_call" and streamed.name == whole.name
    assert json.loads(streamed.arguments) == json.loads(whole.arguments)
    jsonschema.validate(json.loads(whole.arguments), PARAMETERS[whole.name])

    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300).messages
    kw = dict(model=MODEL, max_tokens=64, messages=question, tool_choice={"type": "any"},
              tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS],
              extra_body={"temperature": 0})
    whole = messages.create(**kw).content[0]
    with messages.stream(**kw) as stream:
        pieces = Counter(e.index for e in stream
                         if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        streamed = stream.get_final_message().content[0]
    assert max(pieces.values()) > 1 and streamed.type == whole.type == "tool_use"
    assert (streamed.name, streamed.input) == (whole.name, whole.input)


#: Llama 3.1's template in substance: tools told in the first user turn, a call written as
#: {"name": ..., "parameters": ...}, its result in an ipython turn.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set messages = messages[1:] %}
{%- else %}{% set system = '' %}{% endif %}<|start_header_id|>system<|end_header_id|>

{{ system }}<|eot_id|>
{%- for message in messages %}
{%- if message.role == 'user' %}<|start_header_id|>user<|end_header_id|>

{% if loop.first and tools %}Given the following functions, respond with a JSON for a function call.
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.

{% for t in tools %}{{ t | tojson }}

{% endfor %}{% endif %}{{ message.content }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    with templated(tmp_path_factory.mktemp("llama3"), LLAMA3_TEMPLATE) as s:
        yield s


def test_llama3_calls_one_tool_in_its_own_form_streamed_as_written(llama3):
    client = llama3.client()
    prompt = loop_prompt(llama3)
    assert '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}' in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny" in prompt and "tool_calls" not in prompt

    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=True)
    whole = ask(client, **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and len(checked(whole.message.tool_calls)) == 1
    pieces, streamed = streamed_calls(client, 64, **kw)
    assert max(pieces.values()) > 1
    assert checked(streamed.message.tool_calls) == checked(whole.message.tool_calls)
    for c in ask(client, tools=TOOLS, tool_choice="auto", n=4, temperature=1.0, seed=2).choices:
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and checked(c.message.tool_calls)
        else:
            assert not c.message.content.lstrip().startswith("{")


def test_thinking_turned_off_by_a_request_or_for_the_server(server, client, tmp_path):
    """enable_thinking false (chat_template_kwargs, Anthropic's thinking disabled, the
    server's --reasoning off) closes the thought in the prompt: the answer is content."""
    import anthropic
    import requests
    hello = [{"role": "user", "content": "Hello!"}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    prompt = requests.post(server.url + "/apply-template", json={"model": MODEL, "messages": hello, **off},
                           timeout=60).json()["prompt"]
    assert prompt.endswith("<think>\n</think>\n\n")
    message = ask(client, max_tokens=16, messages=hello, extra_body=off).choices[0].message
    assert message.content and getattr(message, "reasoning_content", None) is None
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    answer = claude.messages.create(model=MODEL, max_tokens=16, messages=hello, thinking={"type": "disabled"})
    assert [b.type for b in answer.content] == ["text"]
    clash = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": hello, "chat_template_kwargs": {"messages": []}})
    assert clash.status_code == 400 and "chat_template_kwargs" in clash.text
    with templated(tmp_path, TEMPLATE, "--reasoning", "off") as quiet:
        message = ask(quiet.client(), max_tokens=16, messages=hello).choices[0].message
        on = ask(quiet.client(), max_tokens=16, messages=hello,
                 extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
    assert message.content and getattr(message, "reasoning_content", None) is None
    assert on.reasoning_content and not on.content


#: Mistral 7B v0.3's template in substance: tools in [AVAILABLE_TOOLS] before the last
#: user turn, calls after [TOOL_CALLS] with nine-character ids (it raises on others),
#: results in [TOOL_RESULTS]. [TOOL_CALLS] is a control token of Mistral's vocabulary.
MISTRAL_TEMPLATE = """{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}\
{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}
{%- set ns = namespace(last=-1) %}{% for m in loop_messages %}{% if m.role == 'user' %}\
{% set ns.last = loop.index0 %}{% endif %}{% endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.index0 == ns.last %}[AVAILABLE_TOOLS] [{% for t in tools %}{{ t | tojson }}\
{% if not loop.last %}, {% endif %}{% endfor %}][/AVAILABLE_TOOLS]{% endif %}
{%- if loop.index0 == ns.last and system is defined %}[INST] {{ system }}

{{ message.content }}[/INST]{% else %}[INST] {{ message.content }}[/INST]{% endif %}
{%- elif message.tool_calls %}[TOOL_CALLS] [{% for call in message.tool_calls %}\
{%- if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}\
{% endif %}{% set out = call.function | tojson %}{{ out[:-1] }}, "id": "{{ call.id }}"}\
{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif message.role == 'assistant' %} {{ message.content }}{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS] {"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""
#: SmolLM2's control token renamed to Mistral's opener of calls
MISTRAL_OPENER = "<gh_stars>"


@pytest.fixture(scope="module")
def mistral_gguf(tmp_path_factory):
    """SmolLM2 carrying Mistral's template and [TOOL_CALLS] control token in its own file,
    as a Mistral GGUF does."""
    from swarmkv_ffi import catalog, tiny_gguf
    path = tmp_path_factory.mktemp("mistral") / "smollm2-mistral.gguf"
    return tiny_gguf.retokened(str(catalog.resolve(MODEL)), str(path), {MISTRAL_OPENER: "[TOOL_CALLS]"},
                               MISTRAL_TEMPLATE)


@pytest.fixture(scope="module")
def mistral(mistral_gguf, tmp_path_factory):
    with Serve("--exact", "--model", mistral_gguf, "--name", MODEL,
               log=tmp_path_factory.mktemp("mistral-log") / "serve.log") as s:
        yield s


def test_mistrals_grammar_makes_the_model_write_its_control_token(mistral_gguf):
    """A required call starts with the vocabulary's [TOOL_CALLS] token, the only token
    allowed first; `auto` allows it beside words."""
    import numpy as np
    from swarmkv_ffi.grammar import Constraint
    from swarmkv_ffi.model import Model
    from swarmkv_ffi.serve import structured
    from swarmkv_ffi.serve.dialects import detect
    from swarmkv_ffi.serve.templates import control_tokens
    model = Model(mistral_gguf)
    dialect = detect(model.chat_template).with_vocabulary(control_tokens(model)[1])
    assert dialect.calls == "mistral" and dialect.opener == model.tokenize(
        "[TOOL_CALLS]", add_special=False, parse_special=True)[0]
    functions = [t["function"] for t in TOOLS]
    required = Constraint(model, structured.mistral_grammar(functions, False, True, None, dialect.opener))
    assert np.flatnonzero(required.allowed()).tolist() == [dialect.opener]
    auto = np.flatnonzero(Constraint(model, structured.mistral_grammar(functions, True, True, None,
                                                                       dialect.opener)).allowed())
    assert dialect.opener in auto and len(auto) > 1000


def test_mistral_renders_a_tool_loop_in_its_own_form(mistral):
    import requests
    call = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "unit": "celsius"}'}}
    messages = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"}]
    prompt = requests.post(mistral.url + "/apply-template", timeout=60,
                           json={"model": MODEL, "messages": messages, "tools": TOOLS}).json()["prompt"]
    assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}, ' \
           '"id": "abcDEF123"}]' in prompt
    assert '[TOOL_RESULTS] {"content": "sunny", "call_id": "abcDEF123"}[/TOOL_RESULTS]' in prompt
    assert "[AVAILABLE_TOOLS]" in prompt and "tool_calls" not in prompt


def test_mistral_calls_stream_as_written_and_go_back_into_the_template(mistral):
    """Required, parallel calls: nine-character ids, arguments in several pieces, the
    streamed calls equal to the whole answer's; the calls, sent back with their results,
    render (the template raises on any other id)."""
    client = mistral.client()
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=True)
    whole = ask(client, max_tokens=96, **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = checked(whole.message.tool_calls)
    assert calls and all(len(c.id) == 9 and c.id.isalnum() for c in whole.message.tool_calls)
    pieces, streamed = streamed_calls(client, 96, **kw)
    assert max(pieces.values()) > 1 and checked(streamed.message.tool_calls) == calls
    back = QUESTION + [whole.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in whole.message.tool_calls]
    assert ask(client, messages=back, max_tokens=8, tools=TOOLS).choices[0].finish_reason in ("stop", "length",
                                                                                             "tool_calls")


def test_mistral_auto_answers_in_words_or_in_calls(mistral, mistral_gguf):
    """Under `auto` the model's own [TOOL_CALLS] token opens calls (pushed to it by a
    logit_bias, the answer is calls), and without it the answer is words (pushed away)."""
    from swarmkv_ffi.model import Model
    with Model(mistral_gguf) as model:
        opener = model.tokenize("[TOOL_CALLS]", add_special=False, parse_special=True)[0]
    client = mistral.client()
    for bias, calls in ((100, True), (-100, False)):
        for c in ask(client, tools=TOOLS, tool_choice="auto", n=2, max_tokens=96, temperature=1.0, seed=2,
                     logit_bias={str(opener): bias}).choices:
            assert bool(c.message.tool_calls) == calls, c.message
            if calls:
                assert c.finish_reason == "tool_calls" and checked(c.message.tool_calls)
            else:
                assert "[TOOL_CALLS]" not in (c.message.content or "")
