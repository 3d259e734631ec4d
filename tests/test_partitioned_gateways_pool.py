"""The client-side pool that spreads requests over several gateways (gateway/gateway_pool.py), on fake
channels: rendezvous sessions, the fewest in flight, one retry elsewhere on UNAVAILABLE, its addresses."""
from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from gateway.gateway_pool import AsyncGatewayPool, GatewayPool, GatewaySelector, parse_addresses, rendezvous_weight
from protos import inference_pb2

pytestmark = pytest.mark.timeout(300)
ADDRESSES = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


# ---- the pool on fake channels ---------------------------------------------------------------------------
class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"fake {self._code.name}"


class FakeCall:
    """A streaming call playing a script: responses, and an error raised where it stands."""

    def __init__(self, script):
        self._items = iter(script)
        self.cancelled = False

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._items)
        if isinstance(item, Exception):
            raise item
        return item

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return self.__next__()
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeChannel:
    """What InferenceServiceStub asks of a channel. Each Generate plays `self.script` (a list of
    responses and errors) and is recorded with the timeout it was given."""

    def __init__(self, address: str):
        self.address = address
        self.script = [inference_pb2.GenerateResponse(text=address)]
        self.timeouts: list[float | None] = []
        self.calls: list[FakeCall] = []
        self.before_call = lambda: None  # e.g. time passing on a fake clock

    def unary_stream(self, method, **_):
        def call(request, timeout=None, metadata=None):
            self.timeouts.append(timeout)
            self.before_call()
            self.calls.append(FakeCall(self.script))
            return self.calls[-1]
        return call

    def unary_unary(self, method, **_):
        return lambda request, timeout=None, metadata=None: None

    def close(self) -> None:
        pass


class FakeAioChannel(FakeChannel):
    async def close(self) -> None:
        pass


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fake_pool(addresses=ADDRESSES, clock=None, cls=GatewayPool):
    channels = {}

    def open_channel(address):
        channels[address] = (FakeAioChannel if cls is AsyncGatewayPool else FakeChannel)(address)
        return channels[address]

    return cls(addresses, open_channel, unhealthy_s=2.0, clock=clock or FakeClock()), channels


def served_by(pool, session_id="", timeout=None) -> str:
    """Which fake gateway answered one Generate (each answers with its address)."""
    request = inference_pb2.GenerateRequest(prompt="x", session_id=session_id)
    return "".join(r.text for r in pool.generate(request, timeout=timeout))


def test_rendezvous_moves_only_the_sessions_of_a_removed_or_failed_gateway():
    sessions = [f"conversation-{i}" for i in range(3000)]
    three = GatewaySelector(ADDRESSES)
    before = {}
    for s in sessions:
        before[s] = three.acquire(s)
        three.release(before[s])
    counts = {a: list(before.values()).count(a) for a in ADDRESSES}
    assert all(800 < n < 1200 for n in counts.values()), counts  # spread about evenly
    removed = ADDRESSES[1]
    two = GatewaySelector([a for a in ADDRESSES if a != removed])
    after = {s: two.acquire(s) for s in sessions}
    assert all(after[s] == before[s] for s in sessions if before[s] != removed)
    moved = {after[s] for s in sessions if before[s] == removed}
    assert moved == set(ADDRESSES) - {removed}  # its sessions spread over both others
    # A gateway marked unavailable is the same as one removed until its backoff passes.
    clock = FakeClock()
    marked = GatewaySelector(ADDRESSES, unhealthy_s=2.0, clock=clock)
    marked.mark_unavailable(removed)
    assert {s: marked.acquire(s) for s in sessions} == after
    assert marked.healthy() == [ADDRESSES[0], ADDRESSES[2]]
    clock.now += 2.0
    assert {s: marked.acquire(s) for s in sessions} == before
    assert before["conversation-0"] == max(ADDRESSES, key=lambda a: rendezvous_weight(a, "conversation-0"))


def test_requests_without_a_session_go_to_the_fewest_in_flight_ties_in_turn():
    pool, channels = fake_pool()
    assert [served_by(pool) for _ in range(4)] == [ADDRESSES[0], ADDRESSES[1], ADDRESSES[2], ADDRESSES[0]]
    # Streams held open count as in flight until they end.
    request = inference_pb2.GenerateRequest(prompt="x")
    open_streams = [pool.generate(request) for _ in range(3)]
    firsts = [next(s).text for s in open_streams]
    assert sorted(firsts) == ADDRESSES
    assert [pool.selector.in_flight(a) for a in ADDRESSES] == [1, 1, 1]
    held_by = dict(zip(firsts, open_streams))
    list(held_by[ADDRESSES[2]])  # ends: its gateway has the fewest now
    assert served_by(pool) == ADDRESSES[2]
    held_by[ADDRESSES[0]].close()  # a caller that stops reading cancels the call and ends its count
    assert channels[ADDRESSES[0]].calls[-1].cancelled
    assert [pool.selector.in_flight(a) for a in ADDRESSES] == [0, 1, 0]
    assert served_by(pool) == ADDRESSES[0]  # the turn after ADDRESSES[2], among the two at 0
    # A session ignores load: it stays where rendezvous puts it.
    home = served_by(pool, "chat-7")
    assert {served_by(pool, "chat-7") for _ in range(5)} == {home}


def test_unavailable_before_any_response_is_retried_once_elsewhere_and_marks_the_gateway():
    clock = FakeClock()
    pool, channels = fake_pool(clock=clock)
    first = ADDRESSES[0]
    channels[first].script = [FakeRpcError(UNAVAILABLE)]
    assert served_by(pool, timeout=10.0) == ADDRESSES[1]
    assert channels[first].timeouts == [10.0] and channels[ADDRESSES[1]].timeouts == [10.0]
    assert pool.healthy() == ADDRESSES[1:] and pool.selector.in_flight(first) == 0
    assert ADDRESSES[0] not in {served_by(pool) for _ in range(4)}  # left alone during its backoff
    # A session that ranks it first goes to its next-ranked gateway meanwhile, and back after.
    session = next(f"s{i}" for i in range(1000) if GatewaySelector(ADDRESSES).acquire(f"s{i}") == first)
    assert served_by(pool, session) != first
    clock.now += 2.0
    channels[first].script = [inference_pb2.GenerateResponse(text=first)]
    assert served_by(pool, session) == first and pool.healthy() == ADDRESSES
    # The retry gets what is left of the deadline.
    channels[first].script = [FakeRpcError(UNAVAILABLE)]
    channels[first].before_call = lambda: setattr(clock, "now", clock.now + 3.0)  # a slow refusal
    second = served_by(pool, session, timeout=10.0)
    assert second != first and channels[second].timeouts[-1] == 7.0


@pytest.mark.parametrize("script, code", [
    ([inference_pb2.GenerateResponse(text="partial"), FakeRpcError(UNAVAILABLE)], UNAVAILABLE),  # tokens seen
    ([FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)], grpc.StatusCode.RESOURCE_EXHAUSTED),  # the gateway's answer
    ([FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT)], grpc.StatusCode.INVALID_ARGUMENT),
])
def test_no_retry_after_a_response_or_on_another_status(script, code):
    pool, channels = fake_pool()
    channels[ADDRESSES[0]].script = script
    with pytest.raises(grpc.RpcError) as e:
        served_by(pool)
    assert e.value.code() == code
    assert all(not channels[a].timeouts for a in ADDRESSES[1:])  # nobody else was asked
    assert pool.healthy() == ADDRESSES and pool.selector.in_flight(ADDRESSES[0]) == 0


def test_only_one_retry_and_none_with_a_single_gateway():
    pool, channels = fake_pool()
    for channel in channels.values():
        channel.script = [FakeRpcError(UNAVAILABLE)]
    with pytest.raises(grpc.RpcError) as e:
        served_by(pool)
    assert e.value.code() == UNAVAILABLE
    assert [len(channels[a].timeouts) for a in ADDRESSES] == [1, 1, 0]
    single, channels = fake_pool(ADDRESSES[:1])
    channels[ADDRESSES[0]].script = [FakeRpcError(UNAVAILABLE)]
    with pytest.raises(grpc.RpcError):
        served_by(single)
    assert len(channels[ADDRESSES[0]].timeouts) == 1
    # Every gateway believed down: a request still tries one rather than failing untried.
    channels[ADDRESSES[0]].script = [inference_pb2.GenerateResponse(text="back")]
    assert served_by(single) == "back"


def test_the_async_pool_has_the_same_retry_rule():
    async def run():
        pool, channels = fake_pool(cls=AsyncGatewayPool)
        channels[ADDRESSES[0]].script = [FakeRpcError(UNAVAILABLE)]
        request = inference_pb2.GenerateRequest(prompt="x")
        texts = [r.text async for r in pool.generate(request, timeout=5.0)]
        assert texts == [ADDRESSES[1]] and pool.healthy() == ADDRESSES[1:]
        for channel in channels.values():  # tokens, then the gateway goes away: no retry
            channel.script = [inference_pb2.GenerateResponse(text="a"), FakeRpcError(UNAVAILABLE)]
        with pytest.raises(grpc.RpcError):
            [r async for r in pool.generate(request)]
        assert sum(len(c.timeouts) for c in channels.values()) == 3
        assert all(pool.selector.in_flight(a) == 0 for a in ADDRESSES)
        await pool.close()

    asyncio.run(run())


@pytest.mark.parametrize("text, words", [
    ("", "no gateway address"), ("localhost", "not host:port"), ("a:1,,b:2", "''"), ("a:0", "not host:port"),
    ("a:70000", "not host:port"), ("::1:5", "not host:port"), ("a:1,a:1", "more than once"),
])
def test_bad_addresses_are_refused_by_name(text, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_addresses(text)


def test_addresses_parse():
    assert parse_addresses(" a:1, [::1]:50051 ,10.0.0.1:2") == ["a:1", "[::1]:50051", "10.0.0.1:2"]
