"""API keys on their own: the key file's format and its errors (which never repeat a key), lookup,
roles, the priority floor, the token buckets and the refusal to serve an exposed address without
keys. Pure Python, on hand-stepped clocks."""
from __future__ import annotations

import math

import pytest

from gateway.auth import ANONYMOUS, ENV_KEY, KeyStore, check_exposure, is_loopback, parse_keys_file, retry_after_ms
from gateway.rate_limit import TokenBucket, TokenCharge
from shared.config import ConfigError, GatewayConfig

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef"


def store(tmp_path, text: str, environ=None) -> KeyStore:
    path = tmp_path / "keys"
    path.write_text(text)
    return KeyStore.from_config(GatewayConfig(api_keys_file=str(path)), environ or {})


def test_the_key_file_gives_names_roles_and_limits(tmp_path):
    keys = store(tmp_path, f"# comment\n{ALICE} name=alice role=admin\n\n{BOB} rpm=60 tpm=1000 streams=2 "
                           f"priority_floor=0  # trailing comment\n")
    alice, bob = keys.authenticate(f"Bearer {ALICE}"), keys.authenticate(f"bearer  {BOB} ")
    assert (alice.name, alice.is_admin, alice.requests, alice.tokens) == ("alice", True, None, None)
    assert (bob.name, bob.is_admin, bob.spec.max_streams) == ("key-4", False, 2)  # named by its line
    assert bob.requests.capacity == 60 and bob.tokens.capacity == 1000
    assert bob.priority(-5) == 0 and bob.priority(3) == 3 and alice.priority(-5) == -5


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", f"Basic {ALICE}", f"Bearer {ALICE}x",
                                    f"Bearer {ALICE[:-1]}", "Bearer " + "x" * 10000])
def test_a_missing_or_wrong_key_is_no_principal(tmp_path, header):
    assert store(tmp_path, ALICE).authenticate(header) is None


def test_without_keys_everyone_is_the_anonymous_admin():
    keys = KeyStore.from_config(GatewayConfig(), {})
    assert not keys.enabled and keys.authenticate(None) is ANONYMOUS and ANONYMOUS.is_admin


def test_the_environment_variable_is_one_admin_key(tmp_path):
    keys = store(tmp_path, ALICE, {ENV_KEY: BOB})
    assert keys.authenticate(f"Bearer {BOB}").is_admin and keys.authenticate(f"Bearer {ALICE}") is not None
    with pytest.raises(ConfigError, match="unique"):
        store(tmp_path, ALICE, {ENV_KEY: ALICE})


@pytest.mark.parametrize("line, message", [
    ("short-key", "at least 16 characters"),
    (f"{ALICE} role=root", "role must be one of"),
    (f"{ALICE} rpm=lots", "could not convert"),
    (f"{ALICE} colour=blue", "is not one of"),
    (f"{ALICE} rpm=-1", "rpm must be 0 .no limit. or a number >= 1, got '-1'"),
    (f"{ALICE} rpm=nan", "rpm must be 0"),
    (f"{ALICE} tpm=inf", "tpm must be 0"),
    (f"{ALICE} rpm=0.5", "rpm must be 0"),  # a minute's bucket that never holds one request
    (f"{ALICE} streams=-2", "streams must be >= 0"),
    (f"{ALICE} name=a\n{BOB} name=a", "unique"),
])
def test_a_bad_key_file_names_the_line_and_never_the_key(tmp_path, line, message):
    with pytest.raises(ConfigError, match=message) as e:
        store(tmp_path, line)
    assert ALICE not in str(e.value) and BOB not in str(e.value) and "short-key" not in str(e.value)
    with pytest.raises(ConfigError, match="cannot read"):
        parse_keys_file(tmp_path / "missing")


def test_a_token_bucket_refills_at_its_rate_and_says_how_long_to_wait():
    bucket = TokenBucket(per_minute=60, now_s=0.0)  # one a second, up to 60
    assert bucket.take(60, 0.0) == 0.0
    assert bucket.take(1, 0.0) == pytest.approx(1.0)
    assert bucket.take(1, 0.5) == pytest.approx(0.5)  # refused: nothing was taken
    assert bucket.take(1, 1.0) == 0.0
    assert bucket.take(61, 100.0) == math.inf  # more than it ever holds
    assert bucket.level(1000.0) == 60  # never above capacity
    bucket.take(10, 1000.0)
    bucket.give_back(10)
    assert bucket.level(1000.0) == 60
    assert retry_after_ms(0.0004) == 1 and retry_after_ms(math.inf) is None


def test_a_charge_gives_back_what_did_not_turn_into_work():
    bucket = TokenBucket(per_minute=1000, now_s=0.0)
    # Three sequences of 10 prompt + 90 max tokens: 300 taken up front.
    assert bucket.take(300, 0.0) == 0.0
    charge = TokenCharge(bucket, per_sequence=100, max_tokens=90, sequences=3)
    charge.queued()
    charge.sequence_ended(30)  # 60 of its 90 unused
    assert bucket.level(0.0) == 760
    charge.queued()
    charge.release_unqueued()  # the third was never queued: its whole 100 back
    assert bucket.level(0.0) == 860
    charge.release_unqueued()  # nothing twice
    charge.sequence_ended(90)  # the second used all it asked for
    charge.sequence_ended(200)  # never more than it took
    assert bucket.level(0.0) == 860


def test_an_exposed_address_needs_keys_or_an_explicit_opt_out(tmp_path):
    no_keys = KeyStore([])
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert is_loopback(host)
        check_exposure(GatewayConfig(host=host), no_keys)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        with pytest.raises(ConfigError, match="api_keys_file.*allow_unauthenticated"):
            check_exposure(GatewayConfig(host=host), no_keys)
        check_exposure(GatewayConfig(host=host, allow_unauthenticated=True), no_keys)
        check_exposure(GatewayConfig(host=host), store(tmp_path, ALICE))
    assert GatewayConfig().host == "127.0.0.1" and GatewayConfig().metrics_host == "127.0.0.1"
