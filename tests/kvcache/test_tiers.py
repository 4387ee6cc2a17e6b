"""The tiers below a request pool's cells (kvcache/host.py, kvcache/disk.py): a cached
prefix the pool evicts for room goes to host RAM, booked in the swap ledger; when host
RAM is full the oldest goes on to disk; a later request over the same opening restores it
from the nearest tier instead of prefilling, and answers exactly as if it had prefilled;
a tier measured slower than prefilling is not used; one owner never restores another's."""
from __future__ import annotations

import pytest

from corpus import DOC, LICENCE
from swarmkv_ffi.conductor.agents import Conductor
from swarmkv_ffi.admission.ledger import Ledger
from swarmkv_ffi.conductor.requests import RequestPool
from swarmkv_ffi.kvcache.disk import DiskTier
from swarmkv_ffi.kvcache.files import PrefixCache
from swarmkv_ffi.kvcache.host import HostTier

MODEL = "smollm2-135m"
A = 1 << 40


@pytest.fixture
def conductor():
    c = Conductor(Ledger(lambda: 1 << 40), swap=Ledger(lambda: 1 << 30, name="SWAP"), n_threads=2)
    yield c
    c.shutdown(0)
    c.close()


def tokens_of(pool: RequestPool, text: str) -> list[int]:
    return [int(t) for t in pool.model.tokenize(text, add_special=True)]


def ask(pool: RequestPool, tokens: list[int], n: int = 8):
    """A greedy request with its logprobs: two answers are the same bits or not."""
    result = []
    request = pool.submit(A, tokens, n, top_logprobs=1,
                          on_token=lambda token, lp: result.append((token, lp)) or True)
    return request.result(), result


def evicting(pool: RequestPool, tokens: list[int]) -> None:
    """A request long enough that the pool evicts every kept prefix to seat it."""
    assert pool.submit(A, tokens, 4).result().generated


def test_an_evicted_prefix_comes_back_from_host_ram_bit_for_bit(conductor):
    """Exact pool of 2,048 cells: a request over a 700-token document is kept; a
    1,500-token request evicts it (to host RAM); a request over the document with another
    question restores it (tier host, the document's tokens cached) and its tokens and
    logprobs equal those of the same request prefilled in a pool with no tier."""
    plain = RequestPool(conductor, MODEL, cells=2048, seqs=6, exact=True)
    doc = tokens_of(plain, DOC * 5)[:700]
    question = tokens_of(plain, "\nQuestion: who may grant a licence?")[1:]
    other = tokens_of(plain, "Summarise: " + LICENCE)[:1500]
    reference = ask(plain, doc + question)
    assert reference[0].cached == 0
    plain.close()

    tier = HostTier(conductor.swap, 256 << 20)
    pool = RequestPool(conductor, MODEL, cells=2048, seqs=6, exact=True, store=tier)
    ask(pool, doc + tokens_of(pool, "\nQuestion: what is a Contribution?")[1:])
    evicting(pool, other)
    assert len(tier.entries) == 1 and conductor.swap.allocated == tier.nbytes > 0
    result, tokens = ask(pool, doc + question)
    assert result.tier == "host" and result.cached >= len(doc)
    assert tokens == reference[1]
    other_key = pool.submit(A + 1, doc + question, 4).result()
    assert other_key.tier is None and other_key.cached == 0     # A's entry is A's alone
    pool.close()
    tier.clear()
    assert conductor.swap.allocated == 0


def test_host_ram_full_sends_the_oldest_to_disk_and_it_comes_back_from_there(conductor, tmp_path):
    """A host tier that holds one entry, over a disk store: three 600-token documents
    evicted in turn; the first goes down to disk, and the next turn of its conversation
    restores it from there (tier disk). The tier never books more than its limit in the
    swap ledger."""
    disk = DiskTier(PrefixCache(tmp_path / "cache"), key_of=lambda owner: None)
    pool = RequestPool(conductor, MODEL, cells=1536, seqs=6)
    licence = tokens_of(pool, LICENCE)
    docs = [licence[i * 600:(i + 1) * 600] for i in range(3)]
    pusher = tokens_of(pool, "Summarise: " + LICENCE)[:1000]
    one_entry = 620 * pool.model.n_layer * 2 * 3 * 64 * 2          # K and V of 620 cells, f16
    tier = HostTier(conductor.swap, int(one_entry * 1.5), below=disk)
    pool.close()
    pool = RequestPool(conductor, MODEL, cells=1536, seqs=6, store=tier)
    answers = []
    for doc in docs:                 # the pusher evicts each in turn (1,536 cells hold one and it)
        answers.append(ask(pool, doc)[0].generated)
        evicting(pool, pusher)
        assert conductor.swap.allocated == tier.nbytes <= tier.limit
    assert tier.demoted >= 2
    disk.flush()
    result, _ = ask(pool, docs[0] + answers[0] + [docs[1][5]])      # the conversation goes on
    assert result.tier == "disk" and result.cached >= 600
    pool.close()
    tier.clear()


def test_a_tier_measured_slower_than_prefilling_is_not_used(conductor):
    """The same eviction, but the host tier's restores have measured 10 s a token: the
    request prefills (no tier, nothing cached) and answers in full."""
    tier = HostTier(conductor.swap, 256 << 20)
    tier.costs.observe(1, 10.0)
    pool = RequestPool(conductor, MODEL, cells=2048, seqs=6, store=tier)
    doc = tokens_of(pool, DOC * 5)[:700]
    ask(pool, doc)
    evicting(pool, tokens_of(pool, "Summarise: " + LICENCE)[:1500])
    assert len(tier.entries) == 1
    result, tokens = ask(pool, doc + [doc[3]])
    assert result.tier is None and result.cached == 0 and len(tokens) == 8
    pool.close()
    tier.clear()


def test_a_full_host_tier_lets_go_of_the_heaviest_owners_oldest_entry(smol):
    """Room for three 300-token entries: owner 1 keeps one, owner 2 adds two; owner 2's
    third makes room from owner 2's own oldest, never from owner 1's older one (one key's
    evictions cannot flush another's cache). The ledger books what the entries hold, and
    clear() frees it."""
    from swarmkv_ffi import Context
    swap = Ledger(lambda: 1 << 30, name="SWAP")
    texts = [f"Entry {i}. " + LICENCE[i * 1500:] for i in range(4)]
    with Context(smol, n_ctx=1024, flash_attn="on") as ctx:
        def entry(owner: int, text: str) -> list[int]:
            tokens = [int(t) for t in smol.tokenize(text, add_special=True)][:300]
            ctx.decode_tokens(tokens, 0, 0, logits_last=False)
            return tokens
        first = entry(1, texts[0])
        size = ctx.seq_state_size(0)
        tier = HostTier(swap, int(size * 3.5))
        tier.evicted(1, first, ctx, 0)
        ctx.seq_rm(0)
        mine = []
        for text in texts[1:3]:
            mine.append(entry(2, text))
            tier.evicted(2, mine[-1], ctx, 0)
            ctx.seq_rm(0)
        extra = entry(2, texts[3])
        tier.evicted(2, extra, ctx, 0)
        held = sorted((e.owner, e.tokens[:3]) for e in tier.entries.values())
    assert held == sorted([(1, first[:3])] + [(2, t[:3]) for t in mine[1:] + [extra]])
    assert tier.demoted == 1 and swap.allocated == tier.nbytes <= tier.limit
    tier.clear()
    assert swap.allocated == 0 and not tier.entries
