"""`swarmkv bench grammar`: the two grammar engines on our vocabulary path, llguidance
(what the server uses, grammar.py) against xgrammar (SGLang's and vLLM's default).

Both get the model's vocabulary the way the server reads it (every token's bytes from
libllama, control tokens apart) and the same JSON schemas, compiled with the same
separators and no free whitespace: the response schema of `bench serve --scenarios
structured`, the nested one of tests/serve/test_serve_structured.py, and the tool-call form
(serve/structured.py) over two tools. For each engine and schema:

    vocab_s       building the engine's view of the vocabulary (once per model)
    first_mask_ms compiling the schema and computing the first mask: what a request's first
                  token waits for (median of --repeat, the engine's cache off)
    mask_us       computing one token's mask, median over the steps of writing valid answers
                  under the masks (the work that must fit beside a decode step)
    accepts       the valid answers could be written whole under the masks, then end
    rejects       an answer that breaks the schema could not
    control_bytes_in_strings  a raw control byte (U+0001) is allowed inside a JSON string
                  (free, or with maxLength):
                  JSON forbids it unescaped, so such an answer would not parse

xgrammar is not a dependency (it requires torch, transformers and triton): install it
in the same venv to include it (`pip install xgrammar`); without it only llguidance runs.

    swarmkv bench grammar --out bench/results/X/grammar
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .. import catalog, grammar
from .measure import report_json, settings_of
from .peer import log

SEPARATORS = (", ", ": ")


def schemas() -> dict[str, dict]:
    from ..serve.structured import envelope
    from .serve import SCHEMA
    nested = {"type": "object", "properties": {
        "topic": {"type": "string", "maxLength": 60}, "confidence": {"enum": ["low", "medium", "high"]},
        "sections": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 3},
        "source": {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
                   "required": ["title", "year"], "additionalProperties": False}},
        "required": ["topic", "confidence", "sections", "source"], "additionalProperties": False}
    tools = [{"name": "lookup_section", "parameters": {
                 "type": "object", "properties": {"section": {"type": "integer"}, "reason": {"enum": ["a", "b"]}},
                 "required": ["section", "reason"], "additionalProperties": False}},
             {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"], "additionalProperties": False}}]
    return {"response": SCHEMA, "nested": nested, "tool_call": envelope(tools, auto=True, parallel=True)}


#: Answers valid against each schema, and one that breaks it (at the marked point).
VALID = {
    "response": ['{"answer": "Anyone may use the work under the licence.", "confidence": "high", "sections": [2, 4]}',
                 '{"answer": "No.", "confidence": "low", "sections": []}'],
    "nested": ['{"topic": "the Apache licence", "confidence": "medium", "sections": [1, 9], '
               '"source": {"title": "Apache License 2.0", "year": 2004}}'],
    "tool_call": ['{"tool_calls": [{"name": "lookup_section", "arguments": {"section": 3, "reason": "a"}}, '
                  '{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
                  '{"response": "I can answer without tools."}'],
}
BROKEN = {"response": '{"answer": "x", "confidence": "maybe"}',
          "nested": '{"topic": "x", "confidence": "low", "sections": [10]}',
          "tool_call": '{"tool_calls": [{"name": "delete_everything"'}


def text_pieces(model) -> list[bytes]:
    """Every token's bytes; a control token's empty (xgrammar's mark of a special token)."""
    return [b"" if p.startswith(b"\xff") else p for p in grammar.pieces(model)]


class Llguidance:
    name = "llguidance"

    def __init__(self, model):
        t0 = time.perf_counter()
        self.tok = grammar.vocabulary(model)
        self.vocab_s = time.perf_counter() - t0
        self.n_vocab = model.n_vocab

    def compile(self, schema: dict):
        return grammar.json_schema(schema)

    def matcher(self, compiled):
        return _LlgMatcher(self.tok, compiled, self.n_vocab)


class _LlgMatcher:
    def __init__(self, tok, compiled: str, n_vocab: int):
        import llguidance
        self.m = llguidance.LLMatcher(tok, compiled, log_level=0)
        self.bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self.n_vocab = n_vocab

    def mask(self) -> np.ndarray:
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return self.bits

    def allowed(self) -> np.ndarray:
        return grammar.unpack(self.bits, self.n_vocab)

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, model):
        import xgrammar as xgr
        self.xgr = xgr
        t0 = time.perf_counter()
        ends = [t for t in range(model.n_vocab) if model.is_eog(t)]
        self.info = xgr.TokenizerInfo(text_pieces(model), xgr.VocabType.RAW, vocab_size=model.n_vocab, stop_token_ids=ends)
        self.vocab_s = time.perf_counter() - t0
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False, max_threads=1)
        self.n_vocab = model.n_vocab

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS,
                                                 strict_mode=True)

    def matcher(self, compiled):
        return _XgrMatcher(self.xgr, compiled, self.n_vocab)


class _XgrMatcher:
    def __init__(self, xgr, compiled, n_vocab: int):
        self.m = xgr.GrammarMatcher(compiled)
        self.bits = xgr.allocate_token_bitmask(1, n_vocab)
        self.n_vocab = n_vocab

    def mask(self):
        self.m.fill_next_token_bitmask(self.bits)
        return self.bits

    def allowed(self) -> np.ndarray:
        return grammar.unpack(self.bits[0].numpy(), self.n_vocab)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)


def replay(engine, compiled, vocab: list[bytes], text: str, end: int) -> tuple[list[float], bool, object]:
    """Write `text` under the engine's masks, each step taking the longest allowed token
    that spells the text's next bytes (an engine may insist on its own tokenization of
    bytes the grammar forces): the mask times, whether the whole text and then the end
    were allowed, and the matcher where it stopped."""
    matcher = engine.matcher(compiled)
    left, times = text.encode(), []
    while True:
        t0 = time.perf_counter()
        matcher.mask()
        times.append(time.perf_counter() - t0)
        allowed = matcher.allowed()
        if not left:
            return times, bool(allowed[end]), matcher
        fits = [t for t in np.flatnonzero(allowed) if vocab[t] and left.startswith(vocab[t])]
        if not fits:
            return times, False, matcher
        token = max(fits, key=lambda t: len(vocab[t]))
        matcher.accept(int(token))
        left = left[len(vocab[token]):]


def measure(engine, model, vocab: list[bytes], name: str, schema: dict, repeat: int, control: bool) -> dict:
    """One engine on one schema; `control`: control_in_string's answer for the engine
    (the same for every schema, so found once), repeated in each row."""
    first = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        engine.matcher(engine.compile(schema)).mask()
        first.append(time.perf_counter() - t0)
    compiled = engine.compile(schema)
    times, accepts = [], True
    for text in VALID[name]:
        t, whole, _ = replay(engine, compiled, vocab, text, model.eos)
        times += t
        accepts &= whole
    _, broken_whole, _ = replay(engine, compiled, vocab, BROKEN[name], model.eos)
    return {"first_mask_ms": statistics.median(first) * 1e3, "mask_us": statistics.median(times) * 1e6,
            "mask_us_max": max(times) * 1e6, "steps": len(times), "accepts": accepts,
            "rejects": not broken_whole, "control_bytes_in_strings": control}


def control_in_string(engine, vocab: list[bytes], end: int) -> bool:
    """Inside a JSON string, does the engine allow a token that is a raw control byte
    (U+0001)? JSON forbids it unescaped: an answer holding one does not parse."""
    raw = [t for t, b in enumerate(vocab) if b == b"\x01"]
    found = False
    for string in ({"type": "string"}, {"type": "string", "maxLength": 200}):
        compiled = engine.compile({"type": "object", "properties": {"a": string}, "required": ["a"]})
        _, _, matcher = replay(engine, compiled, vocab, '{"a": "x', end)
        matcher.mask()
        found |= bool(raw) and bool(matcher.allowed()[raw[0]])
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="swarmkv bench grammar", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=catalog.DEFAULT_MODEL, help="a packaged short name (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=5, help="compiles of each schema per engine (default 5)")
    ap.add_argument("--out", type=Path, default=None, help="folder for grammar.json")
    args = ap.parse_args(argv)
    from ..model import Model
    with Model(catalog.resolve(args.model)) as model:
        engines = [Llguidance(model)]
        try:
            engines.append(Xgrammar(model))
        except ImportError as exc:
            log(f"xgrammar not measured ({exc}); `pip install xgrammar` in this venv to include it")
        vocab = text_pieces(model)
        control = {e.name: control_in_string(e, vocab, model.eos) for e in engines}
        rows = []
        for name, schema in schemas().items():
            row = {"schema": name, **{e.name: measure(e, model, vocab, name, schema, args.repeat, control[e.name])
                                      for e in engines}}
            rows.append(row)
            for e in engines:
                r = row[e.name]
                log(f"{name:>9} {e.name:>10}: first mask {r['first_mask_ms']:.2f} ms, mask {r['mask_us']:.0f} us "
                    f"(max {r['mask_us_max']:.0f}) over {r['steps']} steps, accepts {r['accepts']}, "
                    f"rejects {r['rejects']}, raw control bytes in strings {r['control_bytes_in_strings']}")
    report = {"benchmark": "grammar", "model": args.model, "n_vocab": engines[0].n_vocab,
              "vocab_s": {e.name: e.vocab_s for e in engines}, "rows": rows}
    report_json(report, args.out / "grammar.json" if args.out else None, settings_of(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
