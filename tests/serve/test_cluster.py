"""Past one machine, simulated on one: a Ray cluster of three nodes (ray.cluster_utils,
each node its own raylet and object store, all on 127.0.0.1, each with a resource that
names it). The fan-out's actors are spread over the nodes, the snapshot is pulled once
per remote node, and a node lost mid-run costs no branch: the answers still equal local
exact copy mode's."""
from __future__ import annotations

import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'swarmkv-ffi[distributed]')")

from swarmkv_ffi import catalog  # noqa: E402
from swarmkv_ffi.distributed import connect, loopback_only, run_fanout_ray  # noqa: E402
from swarmkv_ffi.fanout import BranchSpec, run_fanout  # noqa: E402
from corpus import DOC, QUESTIONS  # noqa: E402

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]
OPTS = dict(n_batch=64, exact=True)


@pytest.fixture(scope="module")
def three_nodes():
    loopback_only()
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node0": 1}, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=2, resources={f"node{i}": 1}, node_ip_address="127.0.0.1") for i in (1, 2)]
    connect(cluster.address)
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def names() -> dict[str, str]:
    """Node id -> the resource that names the node (node0, node1, node2)."""
    return {n["NodeID"]: next(k for k in n["Resources"] if k.startswith("node") and k[4:].isdigit())
            for n in ray.nodes() if n["Alive"]}


def specs(n: int, max_tokens: int = 8) -> list[BranchSpec]:
    return [BranchSpec(QUESTIONS[i % len(QUESTIONS)], max_tokens=max_tokens) for i in range(n)]


@pytest.fixture(scope="module")
def model_path():
    return str(catalog.resolve("smollm2-135m"))


def test_actors_spread_over_the_nodes_and_each_remote_node_pulls_the_snapshot_once(three_nodes, model_path, smol):
    out = run_fanout_ray(model_path, DOC, specs(6), n_actors=3, **OPTS)
    local = run_fanout(smol, DOC, specs(6), mode="copy", cache=False, **OPTS)
    assert [b.token_ids for b in out.branches] == [b.token_ids for b in local.branches]
    named = names()
    nodes = out.extras["nodes"]
    assert sorted(named[n] for n in nodes) == ["node0", "node1", "node2"]     # SPREAD: one actor a node
    assert sorted(i for e in nodes.values() for i in e["branches"]) == list(range(6))
    pulled = sorted(e["snapshot_bytes_pulled"] for e in nodes.values())
    assert pulled[0] == 0 and pulled[1] == pulled[2] > out.snapshot_bytes     # home: none; others: one file


def test_a_node_lost_mid_run_costs_no_branch(three_nodes, model_path, smol):
    cluster, workers = three_nodes
    done: dict = {}
    run = threading.Thread(target=lambda: done.update(
        out=run_fanout_ray(model_path, DOC, specs(6, 24), n_actors=3, **OPTS)))
    cpus = ray.cluster_resources()["CPU"]
    run.start()
    deadline = time.monotonic() + 120
    while ray.available_resources().get("CPU", cpus) > cpus - 3:   # three actors' bundles placed
        assert time.monotonic() < deadline and run.is_alive(), "the actors were never placed"
        time.sleep(0.05)
    time.sleep(1.0)                                                   # their models loading, answering
    lost = workers[0].node_id
    cluster.remove_node(workers[0])
    run.join(timeout=900)
    out = done["out"]
    local = run_fanout(smol, DOC, specs(6, 24), mode="copy", cache=False, **OPTS)
    assert [b.token_ids for b in out.branches] == [b.token_ids for b in local.branches]
    assert out.extras["retries"] >= 1 and lost not in out.extras["branch_nodes"]
    workers[0] = cluster.add_node(num_cpus=2, resources={"node1": 1}, node_ip_address="127.0.0.1")


# ---- swarmkv serve --ray: the OpenAI API from replicas on the cluster, routed by prefix ------
RAY_KEY = "ray-key-0123456789"


@pytest.fixture(scope="module")
def served(three_nodes, tmp_path_factory):
    """`swarmkv serve --ray ADDRESS`, as a user joins it to a cluster: two replicas of one
    thread each (exact mode, so an answer does not depend on where it ran)."""
    from serve_process import Serve
    cluster, _ = three_nodes
    log = tmp_path_factory.mktemp("serve-ray") / "serve.log"
    with Serve("--ray", cluster.address, "--replicas", "2", "--threads", "1", "--exact", "--ctx-size", "4096",
               "--parallel", "8", "--max-requests-per-key", "8", "--api-key", RAY_KEY, "--read-timeout", "3",
               log=log) as server:
        yield server, log


def over(name: str) -> str:
    from corpus import APACHE
    return f"Document {name}.\n" + APACHE[:2400]


def ask_raw(client, doc: str, question: str, max_tokens: int = 8):
    """One chat request; its reply and the replica that answered it."""
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2-135m", max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": doc}, {"role": "user", "content": question}])
    return raw.parse(), raw.headers["x-swarmkv-replica"]


def test_two_documents_go_to_two_replicas_and_each_is_prefilled_once(served):
    import concurrent.futures as cf
    server, _ = served
    client = server.client(RAY_KEY)
    docs = [over("red"), over("blue")]
    first = [ask_raw(client, doc, "Who may use the work?") for doc in docs]      # each to a replica
    with cf.ThreadPoolExecutor(6) as pool:
        rest = list(pool.map(lambda job: ask_raw(client, *job),
                             [(doc, q) for doc in docs for q in ("Is there a warranty?", "What is a Contribution?",
                                                                 "Can I sell copies?")]))
    n_doc = first[0][0].usage.prompt_tokens - 40
    for d, doc in enumerate(docs):
        replies = [first[d]] + rest[3 * d:3 * d + 3]
        assert {replica for _, replica in replies} == {first[d][1]}, f"document {d} went to several replicas"
        prefilled = [r for r, _ in replies if r.usage.prompt_tokens_details.cached_tokens < n_doc]
        assert prefilled == [first[d][0]], f"document {d} was prefilled {len(prefilled)} times"
    assert first[0][1] != first[1][1]


def test_a_killed_replica_costs_the_requests_it_held_and_serve_replaces_it(served):
    """Kill the replica that holds a document while it streams an answer over it: that
    stream ends with an error event; a request sent at once after is answered (by the
    other replica, or retried there); Serve starts a replacement."""
    import openai
    from ray import serve
    server, log = served
    client = server.client(RAY_KEY)
    doc = over("green")
    _, holder = ask_raw(client, doc, "Who may use the work?")
    stream = client.chat.completions.create(model="smollm2-135m", max_tokens=200, temperature=0, stream=True,
                                            messages=[{"role": "system", "content": doc},
                                                      {"role": "user", "content": "Explain the licence."}])
    with pytest.raises(openai.APIError, match="replica"):
        for n, _chunk in enumerate(stream):
            if n == 2:
                ray.kill(replica_actor(holder), no_restart=True)
    reply, replica = ask_raw(client, doc, "Is there a warranty?")
    assert reply.choices[0].message.content and replica != holder
    deadline = time.monotonic() + 180
    while serve.status().applications["swarmkv"].deployments["engine"].replica_states.get("RUNNING", 0) < 2:
        assert time.monotonic() < deadline, "Serve did not replace the replica"
        time.sleep(1)
    assert "Traceback" not in log.read_text()


def replica_actor(unique_id: str):
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(unique_id) and "engine" in actor["name"]:
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no replica actor named for {unique_id}")


def test_routes_are_kept_apart_by_key_unless_keys_share_prefixes():
    """Which replica answers must not tell one key what another asked: the text the router
    matches starts with the caller's key's digest, unless --share-prefixes."""
    import json as jsonlib

    from swarmkv_ffi.serve.on_ray import Forwarded
    body = jsonlib.dumps({"messages": [{"role": "system", "content": over("shared")}]}).encode()

    def route(key: str, shared: bool) -> str:
        return Forwarded.of("POST", "/v1/chat/completions", b"", [("Authorization", f"Bearer {key}")], body,
                            shared).prompt
    assert route("key-a-0123456789", False) != route("key-b-0123456789", False)
    assert route("key-a-0123456789", False) == route("key-a-0123456789", False)
    assert route("key-a-0123456789", True) == route("key-b-0123456789", True)
    assert route("key-a-0123456789", False).endswith(over("shared"))


def test_a_stored_response_is_read_or_deleted_on_the_replica_that_holds_it():
    """GET and DELETE /v1/responses/{id} name the stored response in the path, a next turn
    in previous_response_id: the ingress routes all three to where it was made."""
    import json as jsonlib

    from swarmkv_ffi.serve.on_ray import Forwarded
    auth = [("Authorization", "Bearer key-a-0123456789")]
    for method in ("GET", "DELETE"):
        assert Forwarded.of(method, "/v1/responses/resp_123", b"", auth, b"").continues == "resp_123"
    turn = jsonlib.dumps({"input": "Go on", "previous_response_id": "resp_123"}).encode()
    assert Forwarded.of("POST", "/v1/responses", b"", auth, turn).continues == "resp_123"
    assert Forwarded.of("POST", "/v1/responses", b"", auth, b'{"input": "Hi"}').continues is None


def test_the_responses_and_messages_apis_through_the_ingress(served):
    """Anthropic's client (its key as x-api-key) and the Responses API through the ingress;
    a turn continuing a stored response goes to the replica that holds it, and forks it."""
    import anthropic
    server, _ = served
    claude = anthropic.Anthropic(base_url=server.url, api_key=RAY_KEY, max_retries=0, timeout=300)
    message = claude.messages.create(model="smollm2-135m", max_tokens=4, system=over("claude"),
                                     messages=[{"role": "user", "content": "Who may use the work?"}])
    assert message.usage.output_tokens > 0
    client = server.client(RAY_KEY)
    raw = client.responses.with_raw_response.create(model="smollm2-135m", max_output_tokens=4,
                                                    input=over("turns") + "\nWho may use the work?")
    first, replica = raw.parse(), raw.headers["x-swarmkv-replica"]
    for question in ("Is there a warranty?", "Can I sell copies?", "What is a Contribution?"):
        # (a short input alone: only the stored response tells the router where to go)
        raw = client.responses.with_raw_response.create(model="smollm2-135m", previous_response_id=first.id,
                                                        input=question, max_output_tokens=4)
        assert raw.headers["x-swarmkv-replica"] == replica
        assert raw.parse().usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    import requests
    auth = {"Authorization": f"Bearer {RAY_KEY}"}
    got = requests.get(f"{server.url}/v1/responses/{first.id}", headers=auth, timeout=60)
    assert got.status_code == 200 and got.json()["id"] == first.id
    assert requests.delete(f"{server.url}/v1/responses/{first.id}", headers=auth, timeout=60).status_code == 200


def test_the_ingress_checks_the_key_first_and_counts_its_quota_over_every_replica(served):
    """A wrong key is a 401 before the body is read (here: never sent); a key's choices in
    flight are counted by the ingress over both replicas (--max-requests-per-key 8),
    and given back when a stream closes."""
    import socket

    import openai
    server, _ = served
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong-key-0123\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
        s.settimeout(30)
        assert s.recv(4096).startswith(b"HTTP/1.1 401")
    client = server.client(RAY_KEY)
    running = client.completions.create(model="smollm2-135m", prompt="Once upon a time", n=8, max_tokens=200,
                                        stream=True)
    next(iter(running))
    with pytest.raises(openai.RateLimitError, match="across every replica"):
        client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=2)
    running.close()
    time.sleep(1)
    assert client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=2).choices


def test_the_ingress_reads_two_bodies_of_a_key_at_a_time(served):
    """Two of a key's requests whose bodies never come hold its two gates until
    --read-timeout (3 s, then a 408 each); a third request of the key waits meanwhile with
    its body unread (the ingress read and parsed every body of a key at once, before
    counting any), and is answered only after the first 408."""
    import socket
    import threading

    server, _ = served
    stalled = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
    for s in stalled:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {RAY_KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ".encode())
    time.sleep(0.5)
    answered = []
    third = threading.Thread(target=lambda: answered.append((server.client(RAY_KEY).models.list(), time.monotonic())))
    third.start()
    try:
        stalled[0].settimeout(30)
        first_408 = stalled[0].recv(4096)
        refused_at = time.monotonic()
        third.join(timeout=30)
        assert first_408.startswith(b"HTTP/1.1 408"), first_408[:200]
        assert answered and answered[0][0].data and answered[0][1] >= refused_at - 0.05
    finally:
        for s in stalled:
            s.close()

