"""The clients agents use, unmodified, against ours and stock llama-server --jinja (same pin,
same model, 2 threads), one process run: which checks pass on each."""
import asyncio, json, sys
import anthropic
from openai import OpenAI, AsyncOpenAI
from pydantic import BaseModel
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from swarmkv_ffi import catalog
from swarmkv_ffi.bench.peer import server_binary, Server
from swarmkv_ffi.bench.servers import ours
set_tracing_disabled(True)
class A: pass
args = A(); args.model = "smollm2-135m"; args.threads = 2; args.model_path = catalog.resolve(args.model)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
class Answer(BaseModel):
    city: str
    sunny: bool
def check(name, fn, out):
    try:
        out[name] = bool(fn())
    except Exception as e:
        out[name] = f"no: {type(e).__name__}: {str(e)[:120]}"
def checks(url):
    out = {}
    oa = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    cl = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=600)
    check("responses text", lambda: oa.responses.create(model="m", input="Say hello", max_output_tokens=16).output_text, out)
    def streamed():
        ev = list(oa.responses.create(model="m", input="Say hello", max_output_tokens=16, stream=True))
        text = "".join(e.delta for e in ev if e.type == "response.output_text.delta")
        return text and text == ev[-1].response.output_text
    check("responses streamed", streamed, out)
    def agent_tool():
        calls = []
        @function_tool
        def get_weather(city: str) -> str:
            """Weather in a city."""
            calls.append(city); return f"Sunny in {city}"
        model = OpenAIResponsesModel(model="m", openai_client=AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600))
        agent = Agent(name="w", instructions="Answer about the weather.", model=model, tools=[get_weather],
                      tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0))
        r = asyncio.run(Runner.run(agent, "What is the weather in Paris?"))
        return calls
    check("agents required tool", agent_tool, out)
    def agent_output():
        model = OpenAIResponsesModel(model="m", openai_client=AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600))
        agent = Agent(name="o", instructions="Extract.", model=model, output_type=Answer,
                      model_settings=ModelSettings(max_tokens=64, temperature=0))
        return isinstance(asyncio.run(Runner.run(agent, "Paris is sunny today.")).final_output, Answer)
    check("agents output_type", agent_output, out)
    check("messages text", lambda: cl.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "Say hi"}]).content[0].text, out)
    def mstream():
        with cl.messages.stream(model="m", max_tokens=16, messages=[{"role": "user", "content": "Say hi"}]) as s:
            t = "".join(s.text_stream); f = s.get_final_message()
        return t and t == f.content[0].text
    check("messages streamed", mstream, out)
    def forced():
        m = cl.messages.create(model="m", max_tokens=64, tools=[{"name": "get_weather", "input_schema": WEATHER}],
                               tool_choice={"type": "tool", "name": "get_weather"}, messages=[{"role": "user", "content": "Weather in Paris?"}])
        return any(b.type == "tool_use" and b.name == "get_weather" for b in m.content)
    check("messages forced tool", forced, out)
    def counted():
        msgs = [{"role": "user", "content": "Say hi"}]
        n = cl.messages.count_tokens(model="m", system="Be kind.", messages=msgs).input_tokens
        u = cl.messages.create(model="m", max_tokens=4, system="Be kind.", messages=msgs).usage
        return n == u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    check("count_tokens agrees with usage", counted, out)
    return out
res = {}
with ours(args, 8192) as s:
    res["ours"] = checks(s.url)
with Server(server_binary(None, "x"), args.model_path, 2, ["-np", "4", "-c", "8192", "--jinja"]) as s:
    res["llama-server"] = checks(s.url)
print(json.dumps(res, indent=1))
for side, r in res.items():
    print(side, sum(v is True for v in r.values()), "/", len(r))
