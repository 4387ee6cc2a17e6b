"""Routing by prefix for `swarmkv serve --ray`: a request goes to the replica that was sent
the longest start of it, because that replica's pool holds those cells.

Ray ships a prefix-aware router (PrefixCacheAffinityRouter), but it records a request in
its prefix tree only after routing it, through an actor: requests sent together over a
new document are all routed before the tree knows the document. Measured with 32
requests over 4 documents at once on 2 replicas: 10 prefills instead of 4, and 0.86x the
time of routing by load alone. This router decides and records in one step, in the
ingress's process, so the first request over a document picks a replica and every later
one, however close behind, follows it.

Starts are compared at a few lengths (LEVELS characters), longest first, by exact match
of that many leading characters: a document in the system message matches at the
longest level its requests share. A request that matches nothing goes to the replica
with the fewest requests in flight, and among those the one that holds the fewest
starts (so two new documents go to two replicas); so does one whose match sits
`imbalance` requests above the least loaded replica (the guard that keeps one hot document from pinning all
traffic to one replica: that document is then prefilled on a second replica too).
"""
from collections import Counter, OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

LEVELS = (8192, 2048, 512, 128)    # characters of a prompt's start compared, longest first
MEMORY = 4096                      # starts remembered per level (least recently routed go first)


class PrefixRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 16):
        self.imbalance = imbalance
        self.starts = {n: OrderedDict() for n in LEVELS}     # start -> replica it was last sent to
        self.in_flight: Counter = Counter()                   # replica -> requests routed, not completed
        self.held: Counter = Counter()                        # replica -> starts it holds (shortest level)
        self.chosen: dict[str, ReplicaID] = {}                # request id -> replica counted for it

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        text = str(getattr(pending_request.args[0], "prompt", "")) if pending_request.args else ""
        pinned = getattr(pending_request.args[0], "replica", None) if pending_request.args else None
        by_id = {r.replica_id: r for r in candidate_replicas}
        least = min(candidate_replicas, key=lambda r: (self.in_flight[r.replica_id], self.held[r.replica_id]))
        holder = next((r for r in candidate_replicas if r.replica_id.unique_id == pinned), None)
        if holder is not None:          # it continues a stored response: only that replica has it
            self._count(pending_request, holder.replica_id)
            return [[holder], [r for r in candidate_replicas if r is not holder]]
        target = self._holder(text, by_id)
        if target is None or self.in_flight[target.replica_id] - self.in_flight[least.replica_id] > self.imbalance:
            target = least
        self._count(pending_request, target.replica_id)
        self._remember(text, target.replica_id)
        return [[target], [r for r in candidate_replicas if r is not target]]

    def _holder(self, text: str, by_id: dict) -> RunningReplica | None:
        """The live replica sent the longest start of `text`, or None."""
        for n in LEVELS:
            if len(text) >= n:
                replica = self.starts[n].get(text[:n])
                if replica in by_id:
                    return by_id[replica]
        return None

    def _remember(self, text: str, replica: ReplicaID) -> None:
        for n in LEVELS:
            if len(text) >= n:
                table, start = self.starts[n], text[:n]
                before = table.get(start)
                table[start] = replica
                table.move_to_end(start)
                evicted = table.popitem(last=False)[1] if len(table) > MEMORY else None
                if n == LEVELS[-1]:
                    self.held.update({replica: 1} if before != replica else {})
                    self.held.subtract({r: 1 for r in (before, evicted) if r is not None and r != replica})

    def _count(self, pending: PendingRequest, replica: ReplicaID) -> None:
        """Count the request against `replica` now (before it is sent), so the requests of
        one burst see each other's load."""
        request_id = pending.metadata.internal_request_id
        previous = self.chosen.get(request_id)
        if previous is not None:                   # routed again (its first choice was full)
            self.in_flight[previous] -= 1
        self.chosen[request_id] = replica
        self.in_flight[replica] += 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """Where it really went (the first choice may have been full): count it there."""
        if self.chosen.get(pending_request.metadata.internal_request_id) != replica_id:
            self._count(pending_request, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = self.chosen.pop(internal_request_id, None)
        if replica is not None:
            self.in_flight[replica] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)
