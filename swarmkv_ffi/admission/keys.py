"""Ledger keys, typed: what each booking is for and which uid it charges, read as fields,
never parsed back out of a string. A booking with no owner is shared (a model's weights,
a pool's compute buffer or spare cells): no user's share counts it.

    kind        owner            name                     booked by
    agent       its uid          its id                   conductor/booking.py (its KV cells)
    model       -                the model file's key     conductor/booking.py (weights, once)
    compute     - (own ctx: uid) model, mode, pool kind   conductor/booking.py, own.py
    excess      -                model, mode, pool        conductor/booking.py (a pool's spare cells)
    swap        its uid          the agent's id           conductor/swap.py (a paused agent's KV)
    prefix      its uid          the document's key       conductor/swap.py (a document's KV)
    tier        its uid          the tokens' hash         kvcache/host.py (an evicted prefix)
    embeddings  -                the model's name         serve/embeddings.py (its context)
    ranker      -                the model's name         serve/embeddings.py (its rank context)
"""
from __future__ import annotations

from typing import NamedTuple


class Key(NamedTuple):
    kind: str
    owner: int | None      # the uid whose share it counts in; None: shared
    name: str

    def __str__(self) -> str:
        return ":".join([self.kind, *([] if self.owner is None else [str(self.owner)]), self.name])


def agent(owner: int, agent_id: str) -> Key:
    return Key("agent", owner, agent_id)


def model(file_key: str) -> Key:
    return Key("model", None, file_key)


def swap(owner: int, agent_id: str) -> Key:
    return Key("swap", owner, agent_id)


def prefix(owner: int, document: str) -> Key:
    return Key("prefix", owner, document)


def tier(owner: int, tokens_hash: str) -> Key:
    return Key("tier", owner, tokens_hash)


def embeddings(model_name: str) -> Key:
    return Key("embeddings", None, model_name)


def ranker(model_name: str) -> Key:
    return Key("ranker", None, model_name)
