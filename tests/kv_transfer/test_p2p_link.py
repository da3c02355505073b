"""NcclConnector's link on a CPU (gloo), the parts that decide whether two GPUs can hang: the consumer
posts a payload receive only once a header has promised one (a receive waiting on the GPU would hold up
every device-wide wait of the instance until the producer's next message), every wait is bounded and
names the peer and the request, and a hung test rank shows its threads' stacks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from graphrunner.kv_shape import KVCacheShape
from graphrunner.kv_transfer.p2p import LinkConfig, LinkGroups, PeerLink
from tests.dist_utils import free_port

SHAPE = KVCacheShape(1, 2, 1, 2, torch.float32)


class _Spy:
    """A process group whose sends and receives are recorded (name, time) before they are posted."""

    def __init__(self, group, calls: list) -> None:
        self.group, self.calls = group, calls

    def send(self, tensors, dst, tag):
        self.calls.append(("send", time.monotonic()))
        return self.group.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self.calls.append(("recv", time.monotonic()))
        return self.group.recv(tensors, src, tag)


def _link(rank: int, port: int, timeout_s: float, spy: list | None = None, cls=PeerLink) -> PeerLink:
    if spy is None:
        return cls(LinkConfig("127.0.0.1", port, "gloo", timeout_s, 1 << 20), rank, SHAPE, "m", torch.device("cpu"))

    class Spied(cls):
        def _connect(self):
            groups = super()._connect()
            return None if groups is None else LinkGroups(groups.control, _Spy(groups.payload, spy))

    return Spied(LinkConfig("127.0.0.1", port, "gloo", timeout_s, 1 << 20), rank, SHAPE, "m", torch.device("cpu"))


def _wait_for(predicate, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_the_consumer_posts_a_payload_receive_only_after_its_header():
    """Heartbeats and announcements pass on the control group alone; the payload group sees one send and
    one receive per blocks message, posted once its header has passed."""
    port = free_port()
    sent: list = []
    received: list = []
    producer = _link(0, port, 0.6, sent)
    consumer = _link(1, port, 0.6, received)
    try:
        _wait_for(lambda: producer.connected.is_set() and consumer.connected.is_set(), "never connected")
        producer.announce(["h0"], "r0")
        _wait_for(lambda: consumer.in_flight("h0"), "the announcement never arrived")
        time.sleep(0.7)  # three heartbeats (every 0.2 s)
        assert consumer.alive and sent == [] and received == []  # no payload call is waiting
        data = torch.arange(8, dtype=torch.float32).reshape(1, 2, 1, 2, 1, 2)
        queued = time.monotonic()
        producer.send_blocks(["h0"], [[5, 6]], data, "r0")
        _wait_for(lambda: consumer.num_received_blocks == 1, "the block never arrived")
        assert [c for c, _ in sent] == ["send"] and [c for c, _ in received] == ["recv"]
        assert received[0][1] >= queued  # posted for this message's header, not waiting ahead of it
        assert torch.equal(consumer.lookup("h0", [5, 6]).flatten(), data[:, :, 0].flatten())
    finally:
        producer.close()
        producer.join(5)
        consumer.join(5)


class _Stalling(PeerLink):
    """A producer that announces, sends the header of a blocks message promising a payload, then stays
    connected and silent (no payload, no heartbeat) until released."""

    release = threading.Event()

    def _send_loop(self, groups):
        self._send_message(groups, {"kind": "announce", "hashes": ["h0"], "req_id": "chat-7"}, None)
        head = torch.frombuffer(bytearray(b'{"kind": "blocks", "hashes": ["h0"], "req_id": "chat-7"}'),
                                dtype=torch.uint8)
        groups.control.send([torch.tensor([head.numel(), 64], dtype=torch.int64)], 1, 0).wait()
        groups.control.send([head], 1, 0).wait()
        self.release.wait(30)


def test_a_payload_that_never_comes_ends_the_link_naming_the_peer_and_the_request(caplog):
    port = free_port()
    producer = _link(0, port, 1.0, cls=_Stalling)
    with caplog.at_level("WARNING", logger="graphrunner.kv_transfer"):
        consumer = _link(1, port, 1.0)
        _wait_for(lambda: consumer.connected.is_set(), "never connected")
        started = time.monotonic()
        _wait_for(lambda: not consumer.alive, "the consumer waited past timeout_s for the payload")
    assert time.monotonic() - started < 10
    assert not consumer.in_flight("h0")  # its requests compute instead of waiting
    assert "LinkTimeout" in caplog.text or "LinkError" in caplog.text
    assert f"the producer at 127.0.0.1:{port}" in caplog.text
    assert "receiving a blocks message of 1 blocks from h0 (request 'chat-7')" in caplog.text
    _Stalling.release.set()
    producer.join(5)


def test_a_silent_producer_ends_the_link_after_timeout_s(caplog):
    """Connected, then nothing, not even a heartbeat: the consumer gives up after timeout_s."""

    class Silent(PeerLink):
        def _send_loop(self, groups):
            _Stalling.release.wait(30)

    port = free_port()
    producer = _link(0, port, 1.0, cls=Silent)
    with caplog.at_level("WARNING", logger="graphrunner.kv_transfer"):
        consumer = _link(1, port, 1.0)
        _wait_for(lambda: not consumer.alive, "the consumer waited past timeout_s")
    assert "waiting for a message" in caplog.text and f"the producer at 127.0.0.1:{port}" in caplog.text
    _Stalling.release.set()
    producer.join(5)


def _hang_in_a_named_function(rank: int, world_size: int) -> None:
    if rank == 1:
        threading.Thread(target=time.sleep, args=(60,), name="side-thread", daemon=True).start()
        time.sleep(60)


def test_a_hung_rank_reports_the_stacks_of_its_threads():
    from tests.dist_utils import WorldError, run_world

    with pytest.raises(WorldError) as err:
        run_world(2, _hang_in_a_named_function, timeout_s=5, init_pg=False)
    text = str(err.value)
    assert "rank(s) failed: [1]" in text and "(hung)" in text
    assert "_hang_in_a_named_function" in text and text.count("most recent call first") >= 2


def test_the_consumers_store_lets_go_loaded_and_unwanted_blocks_and_counts_the_unused(caplog):
    """Blocks loaded into the paged cache leave the store at once, and so do the prompt's blocks no request
    will load (also those still on their way, as they arrive); past the store's size the oldest block goes,
    counted and logged as unused."""
    s = SHAPE
    per_block = s.num_layers * 2 * s.block_size * s.num_kv_heads * s.head_dim * 4
    # No producer comes: a short timeout_s ends the link thread's connection attempts soon after close().
    link = PeerLink(LinkConfig("127.0.0.1", free_port(), "gloo", 0.5, 3 * per_block), 1, s, "m",
                    torch.device("cpu"))
    try:
        tokens = {name: [i] * s.block_size for i, name in enumerate(["a1", "a2", "a3", "b1", "b2", "c1", "d1"])}

        def arrive(*names: str) -> None:
            body = torch.arange(len(names) * per_block // 4, dtype=torch.float32).view(torch.uint8)
            link._store({**link.geometry, "hashes": list(names), "tokens": [tokens[n] for n in names]}, body)

        def held() -> set[str]:  # without lookup(), which counts as a use
            return set(link._blocks)

        link._announced["a3"] = 0.0  # announced, on its way
        arrive("a1", "a2", "b1")  # request a's first blocks, request b's first (its prefill goes on)
        link.release(["a1"], unwanted=["a2", "a3"])  # a admitted with a1 loaded, the rest computed
        assert held() == {"b1"} and not link.in_flight("a3")
        arrive("a3", "b2", "c1")  # a3 is let go as it arrives
        assert held() == {"b1", "b2", "c1"} and link.num_evicted_unused_blocks == 0 and link.store_full()
        with caplog.at_level("WARNING", logger="graphrunner.kv_transfer"):
            arrive("d1")  # over the store's size: the oldest waiting block goes, counted and logged
        assert held() == {"b2", "c1", "d1"} and link.num_evicted_unused_blocks == 1
        assert "1 received blocks let go before any request loaded them" in caplog.text
    finally:
        link.close()
        link.join(5.0)


def test_the_producer_sends_only_what_the_consumers_store_has_room_for():
    """Flow control over gloo: a consumer with room for 3 blocks gets 3 of 5 single-block messages; each
    block it loads lets one more come; nothing is let go unused and nothing dropped."""
    s = SHAPE
    per_block = s.num_layers * 2 * s.block_size * s.num_kv_heads * s.head_dim * 4
    port = free_port()
    consumer = PeerLink(LinkConfig("127.0.0.1", port, "gloo", 10.0, 3 * per_block), 1, s, "m", torch.device("cpu"))
    producer = PeerLink(LinkConfig("127.0.0.1", port, "gloo", 10.0, 1 << 20), 0, s, "m", torch.device("cpu"))
    try:
        names = [f"h{i}" for i in range(5)]
        for i, h in enumerate(names):
            data = torch.full((s.num_layers, 2, 1, s.block_size, s.num_kv_heads, s.head_dim), float(i))
            producer.send_blocks([h], [[i] * s.block_size], data)
        _wait_for(lambda: consumer.num_received_blocks == 3, "the first three blocks")
        time.sleep(0.3)  # the producer waits for room instead of sending the fourth
        assert consumer.num_received_blocks == 3 and producer.peer_capacity == 3 * per_block
        for done in range(2):
            consumer.release([names[done]])
            _wait_for(lambda done=done: consumer.num_received_blocks == 4 + done, f"block {4 + done}")
        assert set(consumer._blocks) == set(names[2:])
        assert consumer.num_evicted_unused_blocks == 0 and producer.num_dropped_blocks == 0
        assert producer.num_sent_blocks == 5
        # One message of three blocks with room for two: the two go, the third once a block is loaded.
        data = torch.arange(3.0).view(1, 1, 3, 1, 1, 1).expand(s.num_layers, 2, 3, s.block_size, s.num_kv_heads,
                                                                 s.head_dim).contiguous()
        consumer.release(names[2:4])
        producer.send_blocks(["m0", "m1", "m2"], [[10 + j] * s.block_size for j in range(3)], data)
        _wait_for(lambda: consumer.num_received_blocks == 7, "the message's first two blocks")
        time.sleep(0.3)
        assert consumer.num_received_blocks == 7 and "m2" not in consumer._blocks
        consumer.release(["m0"])
        _wait_for(lambda: consumer.num_received_blocks == 8, "the message's last block")
        assert torch.equal(consumer.lookup("m2", [12] * s.block_size), data[:, :, 2])
        assert consumer.num_evicted_unused_blocks == 0 and producer.num_dropped_blocks == 0
    finally:
        producer.close()
        producer.join(5.0)
        consumer.close()
        consumer.join(5.0)


def test_a_prefill_starts_only_when_its_blocks_fit_the_producers_buffer():
    """The producer counts the blocks waiting to be sent and those announced and not yet computed: a
    prefill whose blocks would overflow kv_buffer_size waits (its scheduler returns None) until blocks
    leave, and starts anyway after timeout_s (its blocks may then be dropped, never waited for)."""
    from types import SimpleNamespace

    from graphrunner.config import KVTransferConfig
    from graphrunner.kv_transfer.p2p import NcclScheduler

    s = SHAPE
    per_block = s.num_layers * 2 * s.block_size * s.num_kv_heads * s.head_dim * 4
    config = KVTransferConfig("NcclConnector", "kv_producer",
                              {"kv_port": free_port(), "timeout_s": 0.5, "kv_buffer_size": 4 * per_block})
    sched = NcclScheduler(config, s, "m")
    link = sched.link
    try:
        def req(name: str, blocks: int):
            tokens = [hash(name) % 97 + i for i in range(blocks * s.block_size)]  # whole blocks: no tail
            return SimpleNamespace(req_id=name, num_prompt_tokens=len(tokens), num_tokens=len(tokens),
                                   block_key_tokens=tokens, prompt_token_ids=tokens, cache_salt=None,
                                   lora_request=None)

        big = req("big", 6)
        assert link.has_room(6) and sched.get_num_new_matched_tokens(big, 0) == 0  # alone: goes, however large
        sched.request_finished(big)  # aborted before its prefill was scheduled: its room is free again
        first, second = req("a", 3), req("b", 2)
        assert sched.get_num_new_matched_tokens(first, 0) == 0
        # Admitted in the same schedule() before the first is announced: it counts the first's blocks.
        assert sched.get_num_new_matched_tokens(second, 0) is None
        assert sched.get_num_new_matched_tokens(first, 0) == 0  # asked again: not counted twice
        sched.prefill_started(first)  # 3 blocks announced, none computed
        assert not link.has_room(2) and sched.get_num_new_matched_tokens(second, 0) is None
        assert link.has_room(1)
        hashes = sched.hashes(first, 3)
        data = torch.zeros(s.num_layers, 2, 3, s.block_size, s.num_kv_heads, s.head_dim)
        link.send_blocks(hashes, [[0] * s.block_size] * 3, data)  # computed: now waiting to be sent
        assert not link.has_room(2)
        sched.request_finished(first)
        time.sleep(0.6)  # past timeout_s the waiting prefill starts, its blocks maybe dropped
        assert sched.get_num_new_matched_tokens(second, 0) == 0
        link.withdraw(hashes)
        link._pending_bytes = 0  # what the sender does once the blocks are out
        assert link.has_room(6)  # nothing outstanding again
    finally:
        link.close()
        link.join(5.0)
