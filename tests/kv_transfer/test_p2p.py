"""NcclConnector over gloo on a CPU: a producer instance sends its prompt blocks to a consumer
instance through a two-rank group of their own; the consumer's tokens and logprobs equal one LLM
computing everything, its loaded tokens count as cached, it waits for announced blocks while they
travel, and a producer that dies mid-transfer leaves it computing, never hung."""

from __future__ import annotations

import threading
import time

import pytest

from graphrunner.config import KVTransferConfig
from tests.dist_utils import free_port
from tests.kv_transfer.test_connectors import LOADABLE, PROMPT_BLOCKS, PROMPTS, _assert_same, _generate, _result

NUM_BLOCKS = len(PROMPTS) * PROMPT_BLOCKS


def _p2p(role: str, port: int, **extra) -> dict:
    return {"kv_connector": "NcclConnector", "kv_role": role,
            "kv_connector_extra_config": {"kv_port": port, "timeout_s": 20.0, **extra}}


def _llm(role: str, port: int, **kw):
    from graphrunner.engine import LLM
    from tests.kv_transfer.test_connectors import ARGS

    return LLM("builtin:tiny-llama", kv_transfer_config=_p2p(role, port), **{**ARGS, **kw})


def _wait_for(predicate, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference():
    return _result(_generate()[1])


def test_options_name_bad_values():
    from graphrunner.kv_transfer.p2p import link_config

    def config(role="kv_consumer", **extra):
        return KVTransferConfig("NcclConnector", role, extra)

    with pytest.raises(ValueError, match="kv_role='kv_both' is neither"):
        link_config(config("kv_both", kv_port=1234), "cpu")
    with pytest.raises(ValueError, match=r"kv_port'\], a TCP port in 1..65535, got None"):
        link_config(config(), "cpu")
    with pytest.raises(ValueError, match="got 70000"):
        link_config(config(kv_port=70000), "cpu")
    with pytest.raises(ValueError, match="backend='nccl'.*nccl needs CUDA"):
        link_config(config(kv_port=1234, backend="nccl"), "cpu")
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got 0"):
        link_config(config(kv_port=1234, timeout_s=0), "cpu")
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys \['port'\]"):
        link_config(config(port=1234), "cpu")
    with pytest.raises(ValueError, match=r"nccl_num_channels must be an integer in 1..64, got 0"):
        link_config(config(kv_port=1234, nccl_num_channels=0), "cpu")
    cfg = link_config(config(kv_port=1234), "cpu")
    assert (cfg.ip, cfg.backend, cfg.timeout_s, cfg.num_channels) == ("127.0.0.1", "gloo", 30.0, 8)


def test_consumer_loads_the_producers_blocks(reference):
    port = free_port()
    producer, consumer = _llm("kv_producer", port), _llm("kv_consumer", port)
    outs = producer.generate(PROMPTS, _params(), use_tqdm=False)
    _assert_same(_result(outs), reference)
    link = consumer.scheduler.kv_connector.link
    _wait_for(lambda: link.num_received_blocks == NUM_BLOCKS, "the blocks never arrived")
    assert producer.runner.kv_connector.link.num_sent_blocks == NUM_BLOCKS
    outs = consumer.generate(PROMPTS, _params(), use_tqdm=False)
    _assert_same(_result(outs), reference)
    assert [o.num_cached_tokens for o in outs] == [LOADABLE] * len(PROMPTS)
    assert consumer.scheduler.kv_connector.external_hit_rate == pytest.approx(LOADABLE / 70)
    # A prefix sent once is not sent again.
    producer.generate(PROMPTS, _params(), use_tqdm=False)
    assert producer.runner.kv_connector.link.num_sent_blocks == NUM_BLOCKS


def _params():
    from tests.kv_transfer.test_connectors import _params as params

    return params()


def test_consumer_waits_for_announced_blocks(reference, monkeypatch):
    """The producer's blocks are held back after their announcement: the consumer's requests wait
    (they would otherwise compute everything and count nothing as cached), then load them."""
    from graphrunner.kv_transfer.base import prefix_hashes
    from graphrunner.kv_transfer.p2p import PeerLink

    held: list = []  # blocks counted as sent but not yet on the wire
    enqueue = PeerLink._enqueue_blocks
    monkeypatch.setattr(PeerLink, "_enqueue_blocks", lambda self, *args: held.append((self, args)))
    port = free_port()
    producer, consumer = _llm("kv_producer", port), _llm("kv_consumer", port)
    producer.generate(PROMPTS, _params(), use_tqdm=False)
    link = consumer.scheduler.kv_connector.link
    first = [prefix_hashes(p, 1, 16)[0] for p in PROMPTS]
    _wait_for(lambda: all(link.in_flight(h) for h in first), "the announcement never arrived")
    result: list = []
    worker = threading.Thread(target=lambda: result.append(consumer.generate(PROMPTS, _params(), use_tqdm=False)))
    worker.start()
    worker.join(1.0)
    assert worker.is_alive() and link.num_received_blocks == 0  # waiting, not computing
    for self, args in held:
        enqueue(self, *args)
    worker.join(60)
    assert not worker.is_alive()
    outs = result[0]
    _assert_same(_result(outs), reference)
    assert [o.num_cached_tokens for o in outs] == [LOADABLE] * len(PROMPTS)


def _dying_producer(rank: int, world_size: int, port: int, hashes: list[str]) -> None:
    """Rank 0 of a separate process: announces `hashes`, starts a blocks message (sizes and header
    promising a payload), and exits before the payload."""
    import os

    from graphrunner.kv_transfer.p2p import LinkConfig, PeerLink

    class Dying(PeerLink):
        def _send_loop(self, groups):
            self._send_message(groups, {"kind": "announce", "hashes": hashes}, None)
            time.sleep(1.0)  # the consumer's requests are waiting now
            import torch

            head = torch.frombuffer(bytearray(b'{"kind": "blocks"}'), dtype=torch.uint8)
            groups.control.send([torch.tensor([head.numel(), 1 << 20], dtype=torch.int64)], 1, 0).wait()
            groups.control.send([head], 1, 0).wait()
            os._exit(1)

    import torch

    from graphrunner.kv_shape import KVCacheShape

    Dying(LinkConfig("127.0.0.1", port, "gloo", 20.0, 1 << 30), 0, KVCacheShape(1, 16, 1, 1, torch.float32),
          "dying", torch.device("cpu"))
    time.sleep(30)


def test_producer_dying_mid_transfer_leaves_the_consumer_computing(reference, caplog):
    from graphrunner.kv_transfer.base import prefix_hashes
    from tests.dist_utils import start_world

    port = free_port()
    hashes = [h for p in PROMPTS for h in prefix_hashes(p, LOADABLE // 16, 16)]  # the full blocks
    # Started (forked) before the consumer has threads of its own.
    world = start_world(1, _dying_producer, port, hashes, init_pg=False, timeout_s=60, allow_hang=frozenset({0}))
    consumer = _llm("kv_consumer", port)
    link = consumer.scheduler.kv_connector.link
    _wait_for(lambda: link.in_flight(hashes[0]), "the announcement never arrived")
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="graphrunner.kv_transfer"):
        outs = consumer.generate(PROMPTS, _params(), use_tqdm=False)
    assert time.monotonic() - started < 20  # not the 20 s wait for announced blocks: the death ended it
    _assert_same(_result(outs), reference)
    assert [o.num_cached_tokens for o in outs] == [0] * len(PROMPTS)
    assert not link.alive and "link down" in caplog.text
    world.wait()


def test_a_port_the_producer_cannot_listen_on_is_logged_and_prompts_are_computed(reference, caplog):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with caplog.at_level("WARNING", logger="graphrunner.kv_transfer"):
            producer = _llm("kv_producer", port)
            link = producer.runner.kv_connector.link
            _wait_for(lambda: not link.alive, "the link never gave up on a taken port", 30)
            outs = producer.generate(PROMPTS, _params(), use_tqdm=False)
        _assert_same(_result(outs), reference)
        assert f"cannot listen on 127.0.0.1:{port}" in caplog.text
        assert link.num_dropped_blocks == NUM_BLOCKS  # logged, not sent, the producer unaffected
    finally:
        taken.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_aborted_while_others_wait_for_kv_leaves_the_runner(async_scheduling, monkeypatch):
    """Only requests waiting for announced blocks are left after an abort: the step plans nothing, and
    its finished ids still reach the runner (whose row the aborted request frees)."""
    from graphrunner.kv_transfer.base import prefix_hashes
    from graphrunner.kv_transfer.p2p import PeerLink
    from graphrunner.protocol import SamplingParams

    held: list = []  # blocks counted as sent but not yet on the wire
    enqueue = PeerLink._enqueue_blocks
    monkeypatch.setattr(PeerLink, "_enqueue_blocks", lambda self, *args: held.append((self, args)))
    port = free_port()
    producer = _llm("kv_producer", port)
    consumer = _llm("kv_consumer", port, async_scheduling=async_scheduling)
    producer.generate(PROMPTS[:1], _params()[:1], use_tqdm=False)
    link = consumer.scheduler.kv_connector.link
    _wait_for(lambda: link.in_flight(prefix_hashes(PROMPTS[0], 1, 16)[0]), "the announcement never arrived")
    consumer.add_request("running", [7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        consumer.step()
    consumer.add_request("waiting", PROMPTS[0], _params()[0])
    consumer.abort_request("running")
    for _ in range(3):
        consumer.step()
    assert "running" not in consumer.runner.state.requests.req_id_to_index
    for self, args in held:
        enqueue(self, *args)
    outs = []
    while consumer.has_unfinished_requests():
        outs += [o for o in consumer.step() if o.finished]
    assert [o.request_id for o in outs] == ["waiting"] and outs[0].num_cached_tokens == LOADABLE


def test_fp8_blocks_travel_as_bytes_and_another_dtype_is_refused(caplog):
    """An fp8 KV cache's blocks arrive byte for byte (the consumer gives the fp8 run's tokens and
    logprobs); a consumer whose cache holds fp32 refuses them on arrival and computes its prompts."""
    fp8 = {"kv_cache_dtype": "fp8"}
    want = _result(_generate(**fp8)[1])
    port = free_port()
    producer, consumer = _llm("kv_producer", port, **fp8), _llm("kv_consumer", port, **fp8)
    producer.generate(PROMPTS, _params(), use_tqdm=False)
    link = consumer.scheduler.kv_connector.link
    _wait_for(lambda: link.num_received_blocks == NUM_BLOCKS, "the blocks never arrived")
    outs = consumer.generate(PROMPTS, _params(), use_tqdm=False)
    _assert_same(_result(outs), want)
    assert [o.num_cached_tokens for o in outs] == [LOADABLE] * len(PROMPTS)

    port = free_port()
    producer, consumer = _llm("kv_producer", port, **fp8), _llm("kv_consumer", port)
    with caplog.at_level("WARNING", logger="graphrunner.kv_transfer"):
        producer.generate(PROMPTS, _params(), use_tqdm=False)
        link = consumer.scheduler.kv_connector.link
        _wait_for(lambda: link.num_refused_blocks == NUM_BLOCKS, "the blocks were not refused")
        outs = consumer.generate(PROMPTS, _params(), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] * len(PROMPTS)
    assert "'dtype': 'float8_e4m3fn'" in caplog.text


def test_blocks_past_the_buffer_are_dropped_and_logged_while_the_consumer_is_away(reference, caplog):
    """No consumer yet: the producer queues blocks up to kv_buffer_size and drops the rest (logged)
    and withdraws their announcement; the consumer that connects later (after more than timeout_s)
    gets the queued ones and computes the others at once, without waiting for the dropped ones."""
    from graphrunner.engine import LLM
    from tests.kv_transfer.test_connectors import ARGS

    shape = LLM("builtin:tiny-llama", **ARGS).runner.kv_cache_shape
    block_bytes = shape.num_layers * 2 * shape.block_size * shape.num_kv_heads * shape.head_dim * 4
    port = free_port()
    extra = {"kv_port": port, "timeout_s": 1.0, "kv_buffer_size": 4 * block_bytes}
    producer = LLM("builtin:tiny-llama", **ARGS, kv_transfer_config={
        "kv_connector": "NcclConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra})
    with caplog.at_level("WARNING", logger="graphrunner.kv_transfer"):
        _assert_same(_result(producer.generate(PROMPTS, _params(), use_tqdm=False)), reference)
    link = producer.runner.kv_connector.link
    assert link.num_dropped_blocks == NUM_BLOCKS - 4 and f"over kv_buffer_size={4 * block_bytes}" in caplog.text
    time.sleep(1.5)  # longer than the producer's timeout_s: it still waits for its consumer
    assert link.alive and not link.connected.is_set()
    consumer = _llm("kv_consumer", port)
    received = consumer.scheduler.kv_connector.link
    _wait_for(lambda: received.num_received_blocks == 4, "the queued blocks never arrived")
    started = time.monotonic()
    outs = consumer.generate(PROMPTS, _params(), use_tqdm=False)
    assert time.monotonic() - started < 10
    _assert_same(_result(outs), reference)
    assert sorted(o.num_cached_tokens for o in outs) == [0, 0, 4 * 16]  # the queued blocks, not the tail


def test_a_request_that_ends_before_its_blocks_are_sent_withdraws_them(monkeypatch):
    """The producer aborts a request after announcing its prompt blocks and before computing them:
    the consumer, asked for the same prompt, stops waiting for them at once and computes."""
    from graphrunner.kv_transfer.base import prefix_hashes
    from graphrunner.protocol import SamplingParams

    port = free_port()
    producer, consumer = _llm("kv_producer", port, max_num_batched_tokens=16), _llm("kv_consumer", port)
    producer.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
    producer.step()  # the first 16 of 70 prompt tokens: announced, one block computed
    link = consumer.scheduler.kv_connector.link
    last = prefix_hashes(PROMPTS[0], 4, 16)[3]
    _wait_for(lambda: link.in_flight(last), "the announcement never arrived")
    producer.abort_request("r")
    producer.step()
    _wait_for(lambda: not link.in_flight(last), "the announcement was never withdrawn")
    started = time.monotonic()
    outs = consumer.generate(PROMPTS[:1], _params()[:1], use_tqdm=False)
    assert time.monotonic() - started < 10 and outs[0].num_cached_tokens == 16
