"""POST /v1/embeddings (issue 64) through a real server and the `openai` client: a unit
vector per input, the same text the same vector whether asked alone or among others (to a
tolerance: what shares a decode changes the kernels' rounding), token ids as good as text,
both encodings, the embeddings context booked in the ledger, and bad inputs refused by
name."""
from __future__ import annotations

import threading
import time

import numpy as np
import openai
import pytest
import requests

from serve_process import MODEL, Serve, scrape
from swarmkv_ffi.serve.embeddings import EMBED_CELLS

pytestmark = pytest.mark.slow

TEXTS = ["The cat sat on the mat.", "Quarterly revenue rose by four percent.", "The cat sat on the mat."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with Serve("--ctx-size", "2048", "--parallel", "4", log=tmp_path_factory.mktemp("emb") / "serve.log") as s:
        yield s


def vectors(client, inputs, **kw) -> np.ndarray:
    return np.array([d.embedding for d in client.embeddings.create(model=MODEL, input=inputs, **kw).data])


def test_one_unit_vector_per_input_and_alike_texts_alike(server, smol):
    booked_before = scrape(server, None)[("swarmkv_memory_bytes", (("state", "booked"),))]
    v = vectors(server.client(), TEXTS)
    assert v.shape == (3, smol.n_embd)
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)
    assert np.allclose(v[0], v[2], atol=1e-5) and v[0] @ v[1] < 0.99
    assert scrape(server, None)[("swarmkv_memory_bytes", (("state", "booked"),))] > booked_before


def test_alone_or_among_others_token_ids_or_text_floats_or_base64(server, smol):
    client = server.client()
    together = vectors(client, TEXTS)
    alone = vectors(client, TEXTS[1])[0]
    assert np.allclose(alone, together[1], atol=1e-4)
    ids = [int(t) for t in smol.tokenize(TEXTS[1], add_special=True)]
    assert np.allclose(vectors(client, [ids])[0], alone, atol=1e-4)
    floats = vectors(client, TEXTS[1], encoding_format="float")[0]       # the client's default is base64
    assert np.allclose(floats, alone, atol=1e-6)
    usage = client.embeddings.create(model=MODEL, input=TEXTS).usage
    assert usage.prompt_tokens == usage.total_tokens == sum(len(smol.tokenize(t, add_special=True)) for t in TEXTS)


@pytest.mark.parametrize("inputs,param_text", [
    ("", "input[0]: 0 tokens"), ("word " * (EMBED_CELLS + 10), "input[0]: .* too large"),
    (["Hi", [10 ** 9]], "input[1]: token"), ([[10 ** 9]], "not in the model's vocabulary"), ([], "give 1 to"),
    ([[1] * EMBED_CELLS] * 33, "tokens in all")])
def test_bad_inputs_are_refused_by_name(server, inputs, param_text):
    with pytest.raises(openai.BadRequestError, match=param_text.replace("[", r"\[").replace("]", r"\]")):
        server.client().embeddings.create(model=MODEL, input=inputs)


def test_dimensions_other_than_the_models_are_refused(server, smol):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        server.client().embeddings.create(model=MODEL, input="Hi", dimensions=8)
    assert len(vectors(server.client(), "Hi", dimensions=smol.n_embd)[0]) == smol.n_embd


def test_the_bare_route_answers_too(server):
    reply = requests.post(server.url + "/embeddings", json={"input": "Hi"}, timeout=60)
    assert reply.status_code == 200 and reply.json()["data"][0]["object"] == "embedding"


def embed(server, body: dict) -> requests.Response:
    return requests.post(server.url + "/v1/embeddings", json=body, timeout=60)


def test_llama_servers_content_objects_are_their_text(server):
    """{"content": text or text parts}, as llama-server takes it: the same vector as the
    text itself; parts it cannot read (images, audio, unknown) are a 400."""
    got = embed(server, {"input": ["hello world", {"content": [{"type": "text", "text": "hello "},
                                                               {"type": "text", "text": "world"}]},
                                   {"content": "hello world"}], "encoding_format": "float"}).json()["data"]
    assert np.allclose(got[0]["embedding"], got[1]["embedding"], atol=1e-5)
    assert np.allclose(got[0]["embedding"], got[2]["embedding"], atol=1e-5)
    for bad in ({"content": "string"}, [{"content": [{"type": "unknown"}]}],
                [{"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]):
        assert embed(server, {"input": bad}).status_code == 400


def test_pooling_is_the_operators_choice_as_llama_servers(tmp_path):
    """--pooling last gives another vector than the default mean; --pooling none is refused
    by /v1/embeddings (OpenAI's shape is one vector per input), as llama-server refuses it."""
    def served(*flags) -> requests.Response:
        with Serve("--ctx-size", "1024", *flags, log=tmp_path / "serve.log") as s:
            return embed(s, {"input": "The cat sat on the mat.", "encoding_format": "float"})
    mean, last = served(), served("--pooling", "last")
    a, b = np.array(mean.json()["data"][0]["embedding"]), np.array(last.json()["data"][0]["embedding"])
    assert np.isclose(np.linalg.norm(b), 1, atol=1e-5) and a @ b < 0.99
    refused = served("--pooling", "none")
    assert refused.status_code == 400 and "--pooling none" in refused.json()["error"]["message"]


def test_another_keys_sentence_does_not_wait_for_a_long_request(tmp_path):
    """Issue 63: the embeddings context runs one decode at a time. A key's request of many
    long inputs (four decodes here) used to hold it whole; keys now take turns decode by
    decode, so another key's one sentence, sent once the long request runs, is answered
    before the long one ends. A machine that ends the long request before the sentence is
    sent cannot judge this: it skips rather than pass or fail on its speed."""
    keys = tmp_path / "keys"
    keys.write_text("key-a-0123456789 alice\nkey-b-0123456789 bob\n")
    long_inputs = [" ".join(f"word{i} {j}" for j in range(160)) for i in range(8)]   # ~900 tokens each
    done: dict[str, float] = {}

    def ask(key: str, inputs) -> None:
        got = requests.post(s.url + "/v1/embeddings", json={"model": MODEL, "input": inputs},
                            headers={"Authorization": f"Bearer {key}"}, timeout=300)
        assert got.status_code == 200, got.text
        done[key] = time.monotonic()

    with Serve("--ctx-size", "1024", "--api-key-file", str(keys), log=tmp_path / "serve.log") as s:
        ask("key-b-0123456789", "warm the embeddings context up")
        long_one = threading.Thread(target=ask, args=("key-a-0123456789", long_inputs))
        long_one.start()
        time.sleep(0.3)
        sent = time.monotonic()
        ask("key-b-0123456789", "The cat sat on the mat.")
        long_one.join(300)
    if done["key-a-0123456789"] < sent:
        pytest.skip("the long request ended before the sentence was sent")
    assert done["key-b-0123456789"] < done["key-a-0123456789"]
