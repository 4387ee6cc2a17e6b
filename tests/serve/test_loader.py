"""serve/loading.py's rules, step by step, with pools that load nothing: a ledger that
holds one model at a time, so every order of events can be forced and checked (the
real models and server: test_serve_loading.py)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from swarmkv_ffi.admission.ledger import LedgerDenied
from swarmkv_ffi.serve.lineup import ModelSpec
from swarmkv_ffi.serve.loading import LOADED, UNLOADED, UNLOADING, Loader


class FakeHosted:
    cells, max_context, longest_token = 512, 511, 8

    def __init__(self, name: str, held: list):
        self.name, self.held = name, held

    def close(self) -> None:
        self.held.remove(self.name)


def loader_of(tmp_path: Path, *names: str, pinned: tuple = (), shared: bool = False) -> tuple[Loader, list[str]]:
    """A loader over one fake file per name whose ledger holds one model; and the log of
    what it opened, in order."""
    held, opened = [], []

    def open_hosted(spec: ModelSpec) -> FakeHosted:
        if held:
            raise LedgerDenied(1, 1, 1)
        held.append(spec.name)
        opened.append(spec.name)
        return FakeHosted(spec.name, held)
    specs = []
    for name in names:
        (tmp_path / f"{name}.gguf").write_bytes(name.encode())
        specs.append(ModelSpec(name, str(tmp_path / f"{name}.gguf"), 512, 8, False, pinned=name in pinned,
                               at_start=name in pinned))
    return Loader(specs, open_hosted, shared), opened


def test_a_busy_model_is_drained_and_the_two_take_turns(tmp_path):
    """B asked while A runs a request: A takes no new request (it would keep B out for
    as long as its agents keep asking), finishes the running one, is unloaded; B loads;
    A's new request waits for B's to end, then A loads again."""
    async def scenario():
        loader, opened = loader_of(tmp_path, "a", "b")
        a, b = loader.named["a"], loader.named["b"]
        loader.start()
        try:
            running = await loader.use(a)
            b_asked = asyncio.create_task(loader.use(b))
            await asyncio.sleep(0.3)
            assert a.state == UNLOADING and not b_asked.done()
            a_again = asyncio.create_task(loader.use(a))
            await asyncio.sleep(0.3)
            assert not a_again.done()                 # drained: the new request waits
            running.release()
            b_use = await asyncio.wait_for(b_asked, 5)
            await asyncio.sleep(0.3)
            assert b.state == UNLOADING and not a_again.done()
            b_use.release()
            (await asyncio.wait_for(a_again, 5)).release()
            assert opened == ["a", "b", "a"] and (a.loads, a.unloads, b.loads, b.unloads) == (2, 1, 1, 1)
        finally:
            loader.stop()
    asyncio.run(scenario())


def test_an_idle_model_goes_first_and_a_pinned_one_never(tmp_path):
    async def scenario():
        loader, opened = loader_of(tmp_path, "a", "b", "c", pinned=("a",))
        a, b, c = (loader.named[n] for n in "abc")
        loader.start()
        try:
            assert a.state == LOADED
            with pytest.raises(Exception, match="does not fit the memory budget beside the models that stay"):
                await loader.use(b)
            assert a.state == LOADED and opened == ["a"]
        finally:
            loader.stop()
        loader, opened = loader_of(tmp_path, "a", "b", "c")
        a, b, c = (loader.named[n] for n in "abc")
        loader.start()
        try:
            (await loader.use(a)).release()
            (await loader.use(b)).release()           # a idle: unloaded for b at once
            assert (a.state, b.state) == (UNLOADED, LOADED)
        finally:
            loader.stop()
    asyncio.run(scenario())


def test_keep_alive_unloads_an_idle_model_and_a_request_overrides_it(tmp_path):
    async def scenario():
        loader, _ = loader_of(tmp_path, "a")
        a = loader.named["a"]
        loader.start()
        try:
            (await loader.use(a, keep_alive=0.2)).release()
            assert a.state == LOADED
            await asyncio.sleep(0.6)
            assert a.state == UNLOADED and a.unloads == 1
            (await loader.use(a)).release()             # the model's own: until its memory is needed
            await asyncio.sleep(0.5)
            assert a.state == LOADED
        finally:
            loader.stop()
        loader, _ = loader_of(tmp_path, "a", shared=True)   # several keys: none may shorten it
        a = loader.named["a"]
        loader.start()
        try:
            (await loader.use(a, keep_alive=0)).release()
            await asyncio.sleep(0.5)
            assert a.state == LOADED and a.unloads == 0
        finally:
            loader.stop()
    asyncio.run(scenario())


def test_two_models_asked_at_once_serve_their_requests_before_giving_way(tmp_path):
    """A model loaded for waiting requests serves them before it is drained for the
    other: no load is undone before its requests ran (they would take turns forever)."""
    async def scenario():
        loader, opened = loader_of(tmp_path, "a", "b")
        loader.start()

        async def one(name: str) -> None:
            use = await loader.use(loader.named[name])
            await asyncio.sleep(0.05)
            use.release()
        try:
            await asyncio.wait_for(asyncio.gather(*(one(n) for n in "abababab")), 10)
            assert len(opened) <= 3, opened
        finally:
            loader.stop()
    asyncio.run(scenario())
