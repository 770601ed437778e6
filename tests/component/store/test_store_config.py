"""`store.redis` connection settings: mode, ACL user, TLS; every bad value is refused naming its key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extproc.config import ConfigError, parse_config
from extproc.store.settings import RedisSettings


def redis(**section: Any) -> dict[str, Any]:
    return {"store": {"backend": "redis", "redis": section}}


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"mode": "sentinel"}, "store.redis.mode"),
        ({"mode": "cluster", "url": "unix:///run/redis.sock"}, "store.redis.url"),
        ({"mode": "cluster", "url": "redis://node-0:6379/2"}, "store.redis.url"),
        ({"tls": {"ca_file": "/etc/hostname"}}, "store.redis.tls"),
        ({"url": "rediss://r:6380", "tls": {"verify": "sometimes"}}, "store.redis.tls.verify"),
        ({"url": "rediss://r:6380", "tls": {"ca_file": "/nonexistent/ca.crt"}}, "store.redis.tls.ca_file"),
        ({"url": "rediss://r:6380", "tls": {"cert_file": "/etc/hostname"}}, "store.redis.tls.key_file"),
        ({"url": "rediss://r:6380", "tls": {"pin": "x"}}, "store.redis.tls.pin"),
        ({"password_file": "/nonexistent/password"}, "store.redis.password_file"),
        ({"password_env": "EXTPROC_SURELY_UNSET_VARIABLE"}, "store.redis.password_env"),
        ({"username": ""}, "store.redis.username"),
        ({"password": "inline"}, "store.redis.password"),
    ],
)
def test_bad_connection_settings_name_the_key(section: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(redis(**section))
    assert str(err.value).startswith(key), str(err.value)


def test_password_file_and_env_are_exclusive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "password"
    secret.write_text("x")
    monkeypatch.setenv("EXTPROC_TEST_PW", "y")
    with pytest.raises(ConfigError, match=r"^store\.redis\.password_env"):
        parse_config(redis(password_file=str(secret), password_env="EXTPROC_TEST_PW"))


def test_cluster_tls_and_acl_settings_are_read(tmp_path: Path) -> None:
    ca, secret = tmp_path / "ca.crt", tmp_path / "password"
    ca.write_text("-")
    secret.write_text("-")
    store = parse_config(
        redis(
            url="rediss://node-0.redis:6379",
            mode="cluster",
            username="extproc",
            password_file=str(secret),
            tls={"ca_file": str(ca), "verify": "ca"},
        )
    ).store.options
    assert isinstance(store, RedisSettings)
    assert (store.mode, store.username, store.password_file) == (
        "cluster",
        "extproc",
        str(secret),
    )
    assert (store.tls_ca_file, store.tls_verify) == (str(ca), "ca")


def test_defaults_are_one_redis_without_tls() -> None:
    store = parse_config(redis()).store.options
    assert isinstance(store, RedisSettings)
    assert (store.mode, store.tls_verify, store.username) == ("standalone", "full", None)
