"""Our server before #62's split (3dedb1b) and now (HEAD), alternated on one machine, on
`swarmkv bench serve`'s own scenarios (16 at once, 16 one after another, 8 x 3 turns),
ours only: the same libllama for both sides, the server's Python code switched by the
folder `python -m swarmkv_ffi.cli serve` runs from."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, "/work/main")
from swarmkv_ffi import catalog                                   # noqa: E402
from swarmkv_ffi.bench.measure import document_of                 # noqa: E402
from swarmkv_ffi.bench.peer import HttpServer                     # noqa: E402
from swarmkv_ffi.bench.serve import run_at_once, run_one_by_one, run_turns   # noqa: E402
from swarmkv_ffi.bench.servers import client_of                   # noqa: E402
from swarmkv_ffi.model import Model                               # noqa: E402

SIDES = {"before": "/tmp/ab-before", "after": "/work/main"}


#: Runs swarmkv_ffi.cli from the folder given first (the editable install's finder set aside).
RUN = ("import sys, runpy; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
       "sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'swarmkv'; runpy.run_module('swarmkv_ffi.cli', "
       "run_name='__main__')")


def server(side: str, cells: int) -> HttpServer:
    os.environ["SWARMKV_LIBLLAMA"] = "/work/main/libllama/lib"
    return HttpServer(lambda port: [sys.executable, "-c", RUN, SIDES[side], "serve", "--model", "smollm2-135m",
                                    "--port", str(port), "--threads", "2", "--ctx-size", str(cells),
                                    "--parallel", "128"], f"serve ({side})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="/tmp/ab.json")
    a = ap.parse_args()
    args = argparse.Namespace(model="smollm2-135m", n=16, gen=32, agents=8, turns=3)
    with Model(catalog.resolve("smollm2-135m")) as model:
        doc = document_of(model, 1600)
    per_agent = 1600 + 128 + 32
    scenarios = {"at_once": (run_at_once, 16 * per_agent), "one_by_one": (run_one_by_one, 16 * per_agent),
                 "turns": (run_turns, 8 * (1600 + 3 * 96 + 64))}
    runs = {name: {"before": [], "after": []} for name in scenarios}
    texts = {name: {"before": None, "after": None} for name in scenarios}
    for r in range(a.rounds):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            for name, (fn, cells) in scenarios.items():
                with server(side, cells) as s:
                    got = fn(client_of(s, "smollm2-135m"), args, doc)
                runs[name][side].append(got["total_s"])
                texts[name][side] = got["texts"]
                print(f"round {r} {side} {name}: {got['total_s']:.2f} s", flush=True)
    out = {}
    for name in scenarios:
        b, f = runs[name]["before"], runs[name]["after"]
        ratios = [x / y for x, y in zip(f, b)]
        out[name] = {"before_s": b, "after_s": f, "median_before": statistics.median(b),
                     "median_after": statistics.median(f), "after_over_before": statistics.median(f) / statistics.median(b),
                     "per_round_ratio": ratios,
                     "same_text": sum(x == y for x, y in zip(texts[name]["before"], texts[name]["after"])),
                     "answers": len(texts[name]["after"])}
        print(name, json.dumps({k: v for k, v in out[name].items() if k.startswith(("median", "after_over", "same"))}))
    json.dump({"settings": {"rounds": a.rounds, "before": "3dedb1b", "after": subprocess.check_output(
        ["git", "-C", "/work/main", "rev-parse", "--short", "HEAD"]).decode().strip(), "machine": "2-core AMD EPYC",
        "date": time.strftime("%Y-%m-%d %H:%M")}, "results": out}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
