"""Claude-Code-style turns: a billing line whose cch= changes per request, a 1.6k-token
document in the system prompt; turn 2 time / turn 1 time, ours vs llama-server --jinja."""
import sys, time, json, anthropic
sys.path.insert(0, "tests")
from swarmkv_ffi import catalog
from swarmkv_ffi.model import Model
from swarmkv_ffi.bench.measure import document_of
from swarmkv_ffi.bench.peer import server_binary, Server
from swarmkv_ffi.bench.servers import ours
class A: pass
args = A(); args.model = "smollm2-135m"; args.threads = 2; args.model_path = catalog.resolve(args.model)
with Model(args.model_path) as m:
    doc = document_of(m, 1600)
def turns(url):
    c = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=3600)
    def turn(cch, messages):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={cch};"},
                  {"type": "text", "text": doc}]
        t0 = time.perf_counter()
        r = c.messages.create(model="m", max_tokens=16, system=system, messages=messages, extra_body={"temperature": 0})
        return time.perf_counter() - t0, r
    c.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    ask = [{"role": "user", "content": "What is this document about?"}]
    t1, r1 = turn("a5145", ask)
    t2, r2 = turn("0f3e2", ask + [{"role": "assistant", "content": r1.content[0].text}, {"role": "user", "content": "Who may use it?"}])
    return {"turn1_s": t1, "turn2_s": t2, "ratio": t2 / t1, "turn2_cache_read": r2.usage.cache_read_input_tokens,
            "turn2_input": r2.usage.input_tokens}
out = {}
with ours(args, 8192) as s:
    out["ours"] = turns(s.url)
binary = server_binary(None, "cc")
with Server(binary, args.model_path, 2, ["-np", "1", "-c", "8192", "--jinja"]) as s:
    out["llama-server"] = turns(s.url)
print(json.dumps(out, indent=1))
