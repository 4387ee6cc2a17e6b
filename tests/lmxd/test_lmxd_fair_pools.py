"""Shared pools under a hostile second user, each lever of the fair-pools review tried on a
real daemon run as root with clients run as two other uids (VICTIM and MALLORY): a long
prompt, a newcomer against a user with history, cell churn in an exact pool, pools that
grow and shrink, and bookings inflated by others (the scheduler-thread stall and the
prompt rows shared across users: tests/conductor/test_conductor_fair.py, in process). Each test
asserts what only the fair behaviour gives (who finishes first, how many rows a step
took, what was rebuilt), never a timing threshold."""
from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from corpus import LICENCE
from lmxd_daemon import SYSTEM_PYTHON, Daemon, as_user, eventually, shared_tmp
from swarmkv_ffi.bench.multiuser import LADDER   # issue #50's n_ctx, each beyond the victim's pool

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow,
              pytest.mark.skipif(os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                                 reason="needs root and a system python to connect as other uids")]

VICTIM, MALLORY = 4242, 65534
DOC = LICENCE[:1200]
QUESTIONS = ["Question: who may use it? Answer:", "Question: what is a Contribution? Answer:",
             "Question: may I sell it? Answer:"]


def fields(reply: list[str]) -> dict:
    return {k: v for line in reply if line.startswith("OK ") for k, _, v in
            (pair.partition("=") for pair in line[3:].split()) if _}


def body(reply: list[str]) -> str:
    return "\n".join(reply[reply.index("BEGIN_RESPONSE") + 1:reply.index("END_RESPONSE")])


def ok(reply: list[str]) -> list[str]:
    assert reply[-1] == "OK done", reply
    return reply


class Background:
    """as_user(...) on a thread; .replies and .done_at (time.monotonic()) once it ends."""

    def __init__(self, uid: int, daemon: Daemon, *requests):
        self.replies, self.done_at = None, None
        self._thread = threading.Thread(target=self._run, args=(uid, daemon, requests), daemon=True)
        self._thread.start()

    def _run(self, uid, daemon, requests):
        self.replies = as_user(uid, daemon, *requests, timeout=500)
        self.done_at = time.monotonic()

    def join(self) -> list[list[str]]:
        self._thread.join(timeout=550)
        assert self.replies is not None, "the background client never finished"
        return self.replies


def decoding(daemon: Daemon) -> set[str]:
    value = daemon.client().status()["fields"].get("decoding", "-")
    return set() if value in ("-", "None") else set(value.split(","))


def pool_line(daemon: Daemon, alone: str | None = None) -> dict:
    """The STATUS line of the one open pool (or of the one that is, or is not, a user's own)."""
    (line,) = [x for x in daemon.client().status()["lines"] if x.startswith("OK pool ")
               and (alone is None or f" alone={alone} " in x)]
    return fields([line.replace("OK pool ", "OK ")])


@pytest.fixture(scope="module")
def tmp():
    folder = shared_tmp("lmxd-fair-")
    (folder / "doc.txt").write_text(DOC)
    os.chmod(folder / "doc.txt", 0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def daemon(tmp):
    d = Daemon(tmp, "--allow-uid", str(VICTIM), "--allow-uid", str(MALLORY), "--threads", "2")
    yield d
    d.stop()


def test_a_long_prompt_goes_in_beside_another_users_decodes(daemon):
    """The victim has decoded for a while; Mallory's ~2,000-token prompt (one DECODE of
    one token) is under way; the victim's 8-token DECODE, sent after it, ends long before
    it. Charged per DECODE rather than per row, the victim would be the one ahead and sit
    out Mallory's whole prompt. (Cost by rows, or the step budget alone, each keep it so:
    tests/conductor/test_conductor_fair.py guards each of them apart.)"""
    ok(as_user(VICTIM, daemon, "REGISTER v smollm2-135m n_ctx=512", "DECODE v 300 Count: 1, 2, 3,",
               "RESET v")[2])
    ok(as_user(MALLORY, daemon, "REGISTER m smollm2-135m n_ctx=4096")[0])
    prompt = " ".join(LICENCE.split())[:9000]
    hog = Background(MALLORY, daemon, f"DECODE m 1 {prompt}")
    eventually(lambda: "m" in decoding(daemon), what="Mallory's prompt to be under way")
    (victim,) = as_user(VICTIM, daemon, "DECODE v 8 Count with me: 1, 2, 3,")
    victim_done = time.monotonic()
    (mallory,) = hog.join()
    assert int(fields(ok(victim))["generated_tokens"]) == 8
    assert int(fields(ok(mallory))["prompt_tokens"]) > 1500
    assert victim_done < hog.done_at, "the victim waited for another user's whole prompt"


def test_a_newcomer_does_not_starve_a_user_with_history(daemon):
    """The victim has used the device for a few seconds, then goes idle; a fresh uid starts
    three streams; the victim's short DECODE is served beside them at once. A newcomer
    who started at zero would take the device until it had used as much as the victim
    (400 tokens' worth, against the 100 of each of its streams)."""
    ok(as_user(VICTIM, daemon, "REGISTER v smollm2-135m n_ctx=512", "DECODE v 400 Count: 1, 2, 3,")[1])
    for i in range(3):
        ok(as_user(MALLORY, daemon, f"REGISTER m{i} smollm2-135m n_ctx=512")[0])
    streams = [Background(MALLORY, daemon, f"DECODE m{i} 100 Count: 1, 2, 3,") for i in range(3)]
    eventually(lambda: len(decoding(daemon)) == 3, what="Mallory's three streams")
    (victim,) = as_user(VICTIM, daemon, "RESET v", "DECODE v 8 Hello again.")[1:]
    victim_done = time.monotonic()
    for s in streams:
        ok(s.join()[0])
    assert int(fields(ok(victim))["generated_tokens"]) >= 1
    assert victim_done < min(s.done_at for s in streams), "the victim waited for the newcomer's streams"


def test_cell_churn_in_an_exact_pool_rebuilds_nobody(daemon, tmp):
    """Mallory's prefix agent loops DECODE 1 token + RESET in the exact pool the victim's
    prefix agent decodes in. Cells Mallory leaves go to the pool's tomb: the pool is never
    rebuilt, nothing of the victim's is paused or restored, and its answers are the ones
    it gives alone, token for token."""
    doc = tmp / "doc.txt"
    ok(as_user(VICTIM, daemon, ("REGISTER v smollm2-135m n_ctx=1024 prefix=@fd", [doc]))[0])
    ok(as_user(MALLORY, daemon, ("REGISTER m smollm2-135m n_ctx=1024 prefix=@fd", [doc]),
               "DECODE m 1 hi", "RESET m")[1])     # both have DECODEd: the pool never grows below
    alone = []
    for q in QUESTIONS:
        reset, answer = as_user(VICTIM, daemon, "RESET v", f"DECODE v 12 {q}")
        alone.append(body(ok(answer)))
    churn = Background(MALLORY, daemon, *[line for i in range(40) for line in (f"DECODE m 1 guess {i}", "RESET m")])
    eventually(lambda: "m" in decoding(daemon) or churn.replies is not None, what="the churn to start")
    together = []
    for q in QUESTIONS:
        reset, answer = as_user(VICTIM, daemon, "RESET v", f"DECODE v 12 {q}")
        together.append(answer)
    replies = churn.join()
    assert all(r[-1] == "OK done" for r in replies), [r[-1] for r in replies if r[-1] != "OK done"]
    assert [body(ok(r)) for r in together] == alone
    assert all(fields(r)["kv_swap_restored"] == "false" for r in together), [fields(r) for r in together]
    pool = pool_line(daemon)
    assert pool["exact"] == "true" and pool["rebuilds"] == "0", pool
    assert int(pool["tomb_cells"]) > 0, pool               # the churn's cells went to the tomb


def test_bookings_are_the_agents_own_whoever_registers_beside_them(daemon):
    """The victim's booking is what libllama allocated for its context: the same alone and
    while another user registers large agents at the same moment."""
    ok(as_user(VICTIM, daemon, "REGISTER v0 smollm2-135m n_ctx=512")[0])
    (listing,) = as_user(VICTIM, daemon, "LIST")
    alone = fields(listing)["reserved_bytes"]
    big = Background(MALLORY, daemon, *[f"REGISTER m{i} smollm2-135m n_ctx=16384" for i in range(3)])
    booked = []
    for i in range(1, 4):
        ok(as_user(VICTIM, daemon, f"REGISTER v{i} smollm2-135m n_ctx=512")[0])
        (listing,) = as_user(VICTIM, daemon, "LIST")
        booked += [line for line in listing if f"agent_id=v{i} " in line]
    for r in big.join():
        assert r[-1] == "OK done" or r[-1].startswith("ERR VRAM_LEDGER_DENY"), r
    assert [fields([line])["reserved_bytes"] for line in booked] == [alone] * 3


def test_a_pool_grows_for_its_users_and_shrinks_when_they_leave(daemon):
    """The victim's own agents of growing n_ctx, registered one at a time and decoded, make
    its pool reopen larger (nobody else sits in it); Mallory's, registered beside them,
    go to a context of her own, rebuilt larger for each. Once all are unregistered, the
    victim's pool holds no more cells than the agents left booked plus one agent's n_ctx,
    and Mallory's context is gone with everything booked to her."""
    ok(as_user(VICTIM, daemon, "REGISTER v smollm2-135m n_ctx=512", "DECODE v 4 Hello")[1])
    sizes = (1024, 2048, 4096)
    for i, n_ctx in enumerate(sizes):
        ok(as_user(VICTIM, daemon, f"REGISTER w{i} smollm2-135m n_ctx={n_ctx}", f"DECODE w{i} 2 Hi")[1])
        ok(as_user(MALLORY, daemon, f"REGISTER m{i} smollm2-135m n_ctx={n_ctx}", f"DECODE m{i} 2 Hi")[1])
    shared, own = (pool_line(daemon, alone) for alone in ("false", "true"))
    assert int(shared["cells"]) >= 512 + sum(sizes) and int(own["cells"]) >= sum(sizes), (shared, own)
    assert int(shared["opens"]) > 1, shared       # it did grow: reopened for the victim's agents
    for i in range(3):
        ok(as_user(VICTIM, daemon, f"UNREGISTER w{i}")[0])
        ok(as_user(MALLORY, daemon, f"UNREGISTER m{i}")[0])
    ok(as_user(VICTIM, daemon, "DECODE v 4 Still here?")[0])
    cells = int(pool_line(daemon)["cells"])      # (one pool left: Mallory's is gone)
    assert cells <= 512 + 512 + 256, (shared, cells)
    (status,) = as_user(MALLORY, daemon, "STATUS")
    assert fields(ok(status))["uid_ledger_bytes"] == "0", status


def test_another_users_growing_agents_never_pause_the_victim(daemon):
    """The victim keeps one conversation going, 4 tokens a DECODE, while Mallory registers
    agents of growing n_ctx one at a time, DECODEs 1 token with each and unregisters it.
    None fits the pool the victim is seated in: each runs in a context of its own, so the
    victim's pool is never reopened (no DECODE of its restored from host RAM) and, once
    Mallory has left, no context of hers is left holding cells."""
    ok(as_user(VICTIM, daemon, "REGISTER v smollm2-135m n_ctx=2048", "DECODE v 4 Count with me: 1, 2, 3,")[1])
    before = pool_line(daemon)
    ladder = Background(MALLORY, daemon, *[line for i, n_ctx in enumerate(LADDER) for line in (
        f"REGISTER g{i} smollm2-135m n_ctx={n_ctx}", f"DECODE g{i} 1 hi", f"UNREGISTER g{i}")])
    victim = []
    while ladder.replies is None and len(victim) < 200:
        victim += as_user(VICTIM, daemon, "DECODE v 4 and on:")
    for reply in ladder.join():
        ok(reply)
    victim += as_user(VICTIM, daemon, "DECODE v 4 and on:")
    assert len(victim) > 2, "the ladder ended before the victim's DECODEs ran beside it"
    restored = [fields(ok(r)) for r in victim if fields(ok(r))["kv_swap_restored"] != "false"]
    assert not restored, restored
    after = pool_line(daemon)        # (one line: Mallory's contexts are gone)
    assert (after["opens"], after["rebuilds"], after["cells"]) == (before["opens"], before["rebuilds"],
                                                                   before["cells"]), (before, after)
