"""llama-server's POST /rerank on `swarmkv serve --reranking` (issue 64), with `requests` on
loopback: Jina's and TEI's shapes, best first, top_n; a document's score the same whatever
else is ranked with it; llama-server's prompt for a pair; bad bodies refused; keys required;
501 without --reranking. SmolLM2 is no reranker (its scores rank nothing): these tests hold
the route to what llama-server does with the same model, not to a ranking's quality."""
from __future__ import annotations

import pytest
import requests

from serve_process import Serve

pytestmark = pytest.mark.slow

KEY = "key-rerank-0123456789"
QUERY = "Machine learning is"
DOCUMENTS = ["A machine is a physical system that uses power to apply forces.",
             "Learning is the process of acquiring new understanding.",
             "Machine learning is a field of study in artificial intelligence.",
             "Paris, capitale de la France, est une grande ville européenne."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rerank")
    keys = folder / "keys"
    keys.write_text(f"{KEY} ranker\n")
    with Serve("--ctx-size", "1024", "--reranking", "--api-key-file", str(keys), log=folder / "serve.log") as s:
        yield s


def rerank(server, body: dict, path: str = "/rerank", key: str | None = KEY):
    return requests.post(server.url + path, json=body, timeout=120,
                         headers={"Authorization": f"Bearer {key}"} if key else {})


def scores(server, documents: list[str]) -> dict[str, float]:
    results = rerank(server, {"query": QUERY, "documents": documents}).json()["results"]
    return {documents[r["index"]]: r["relevance_score"] for r in results}


def test_jinas_shape_best_first_with_top_n_and_the_pairs_tokens_counted(server):
    whole = rerank(server, {"query": QUERY, "documents": DOCUMENTS}).json()
    ranked = [r["relevance_score"] for r in whole["results"]]
    assert sorted(r["index"] for r in whole["results"]) == [0, 1, 2, 3] and ranked == sorted(ranked, reverse=True)
    counted = [len(requests.post(server.url + "/tokenize", json={"content": text, "add_special": False}, timeout=60,
                                 headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"])
               for text in [QUERY, *DOCUMENTS]]
    # SmolLM2's vocabulary adds no BOS, EOS or SEP: a pair is the query's tokens, then the document's
    assert whole["usage"]["prompt_tokens"] == whole["usage"]["total_tokens"] == 4 * counted[0] + sum(counted[1:])
    assert whole["object"] == "list" and whole["model"] == "smollm2-135m"
    top = rerank(server, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}, path="/v1/rerank").json()
    assert top["results"] == whole["results"][:2]
    assert len(rerank(server, {"query": QUERY, "documents": DOCUMENTS, "top_n": 99}).json()["results"]) == 4


def test_teis_shape_is_a_bare_list_with_the_texts_when_asked(server):
    jina = rerank(server, {"query": QUERY, "documents": DOCUMENTS}).json()["results"]
    tei = rerank(server, {"query": QUERY, "texts": DOCUMENTS, "return_text": True}, path="/reranking").json()
    assert [(r["index"], r["score"]) for r in tei] == [(r["index"], r["relevance_score"]) for r in jina]
    assert [r["text"] for r in tei] == [DOCUMENTS[r["index"]] for r in tei]
    assert "text" not in rerank(server, {"query": QUERY, "texts": DOCUMENTS}).json()[0]


def test_a_documents_score_does_not_depend_on_what_else_is_ranked(server):
    """Each pair is its own sequence: alone, or with the others in another order, a
    document scores the same (within what a different batch rounds)."""
    together = scores(server, DOCUMENTS)
    backwards = scores(server, DOCUMENTS[::-1])
    for document in DOCUMENTS:
        alone = scores(server, [document])[document]
        assert together[document] == pytest.approx(alone, abs=2e-3)
        assert backwards[document] == pytest.approx(alone, abs=2e-3)
    assert len(set(round(v, 3) for v in together.values())) > 1, "every document scored alike"


@pytest.mark.parametrize("body", [{"query": QUERY, "documents": []}, {"query": QUERY, "documents": None},
                                  {"query": QUERY, "documents": 123}, {"query": QUERY, "documents": [1, 2, 3]},
                                  {"documents": DOCUMENTS}, {"query": QUERY, "documents": DOCUMENTS, "top_n": -1},
                                  {"query": QUERY, "documents": DOCUMENTS, "mystery": 1},
                                  {"query": QUERY, "documents": ["word " * 1500] * 50}])
def test_a_bad_body_is_a_400(server, body):
    reply = rerank(server, body)
    assert reply.status_code == 400 and reply.json()["error"]["message"]


def test_the_key_is_required(server):
    assert rerank(server, {"query": QUERY, "documents": DOCUMENTS}, key=None).status_code == 401


def test_without_reranking_the_route_is_not_supported(tmp_path):
    with Serve("--ctx-size", "1024", log=tmp_path / "serve.log") as plain:
        reply = rerank(plain, {"query": QUERY, "documents": DOCUMENTS}, key=None)
    assert reply.status_code == 501 and reply.json()["error"]["type"] == "not_supported_error"


def test_a_pair_is_built_as_llama_server_builds_it(smol):
    """Without a rerank template: the query, then the document, with BOS/EOS/SEP where the
    vocabulary adds them (SmolLM2's adds none); with one, {query} and {document} filled in
    and its special tokens parsed."""
    from swarmkv_ffi.serve.rerank import pair

    def ids(text: str, special: bool = False) -> list[int]:
        return [int(t) for t in smol.tokenize(text, add_special=False, parse_special=special)]
    expected = ([smol.bos] if smol.add_bos else []) + ids("Who?") + ids(" Paris.")
    assert pair(smol, None, "Who?", " Paris.") == expected
    assert pair(smol, "<|im_start|>{query}|{document}<|im_end|>", "Who?", "Paris.") == \
        ids("<|im_start|>Who?|Paris.<|im_end|>", special=True)
    assert len(ids("<|im_start|>", special=True)) == 1
