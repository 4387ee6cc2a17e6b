import json, sys
from swarmkv_ffi import catalog
from swarmkv_ffi.model import Model
from swarmkv_ffi.bench.measure import document_of
from swarmkv_ffi.bench.serve import QUESTIONS
from swarmkv_ffi.bench.serve_apis import one_run, APIS
from swarmkv_ffi.bench.servers import ours
class A: pass
args = A(); args.model = "smollm2-135m"; args.threads = 2; args.n = 16; args.gen = 32; args.doc_tokens = 1600
args.model_path = catalog.resolve(args.model)
with Model(args.model_path) as m:
    doc = document_of(m, args.doc_tokens)
runs = {a: [] for a in APIS}
for r in range(3):
    for api in APIS[r:] + APIS[:r]:
        with ours(args, args.n * (args.doc_tokens + 128 + args.gen)) as s:
            got = one_run(s, api, args, doc, QUESTIONS)
            runs[api].append(got["total_s"])
            print(api, round(got["total_s"], 2), got["cached_tokens"], got["prompt_tokens"], flush=True)
print(json.dumps({a: {"runs_s": v, "best_s": min(v), "median_s": sorted(v)[len(v) // 2]} for a, v in runs.items()}))
