"""A grammar compiled once per request (grammar.Compiled) and copied for each of its
outputs: the copies start at the grammar's start, move independently, and cost no
compile; a compiled grammar handed to another model's output is compiled for that one."""
from __future__ import annotations

import json

import pytest

from swarmkv_ffi import grammar

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def follow(constraint: grammar.Constraint, tokens: list[int]) -> None:
    for t in tokens:
        assert constraint.allowed()[t], t
        constraint.accept(t)


def test_copies_of_one_compiled_grammar_compile_nothing_and_move_apart(smol, monkeypatch):
    compiled = grammar.Compiled(smol, grammar.json_schema(SCHEMA))
    made = []
    real = grammar._matcher
    monkeypatch.setattr(grammar, "_matcher", lambda *a: made.append(a) or real(*a))
    copies = [grammar.Constraint(smol, compiled) for _ in range(16)]
    assert made == []
    text = json.dumps({"name": "x", "n": 1})
    tokens = [int(t) for t in smol.tokenize(text, add_special=False)]
    follow(copies[0], tokens)
    assert copies[0].finished
    assert copies[1].allowed()[tokens[0]] and not copies[1].allowed()[tokens[1]]    # still at the start
    follow(copies[1], tokens)
    assert copies[1].finished and not copies[2].finished


def test_a_grammar_compiled_for_another_model_is_compiled_again(smol, gemma, monkeypatch):
    compiled = grammar.Compiled(smol, grammar.json_schema(SCHEMA))
    made = []
    real = grammar._matcher
    monkeypatch.setattr(grammar, "_matcher", lambda *a: made.append(a) or real(*a))
    constraint = grammar.Constraint(gemma, compiled)
    assert len(made) == 1 and made[0][0] is gemma
    follow(constraint, [int(t) for t in gemma.tokenize('{"name": "y", "n": 2}', add_special=False)])
    assert constraint.finished


def test_a_grammar_that_cannot_compile_is_refused_before_any_output(smol):
    with pytest.raises(grammar.GrammarError, match="cannot be used"):
        grammar.Compiled(smol, grammar.lark("start: undefined_rule"))
