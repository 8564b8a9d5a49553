"""Who a request belongs to (kvserve.gateway.core.tenancy): the API key decides when keys map to
tenants, a tenant header only behind a layer the operator trusts, sharing groups share a salt,
and no salt can be computed without the gateway's secret."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import pytest

from kvserve.gateway.cli.gateway import add_gateway_arguments, tenancy_from
from kvserve.gateway.core.tenancy import Identity, Tenancy, read_api_keys

SECRET = "a-test-secret-of-32-characters!!"
KEY_A, KEY_B = "key-of-team-a-0123456789", "key-of-team-b-0123456789"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"# tenant key\nteam-a {KEY_A}\n\nteam-b {KEY_B}\n", encoding="utf-8")
    return path


@pytest.fixture
def keyed(keys_file: Path) -> Tenancy:
    return Tenancy.from_options(SECRET, ["team-a=ab", "team-b=ab-not"], str(keys_file))


def test_the_key_decides_the_tenant_and_a_tenant_header_is_ignored(keyed: Tenancy) -> None:
    a = keyed.resolve(bearer(KEY_A))
    spoof = keyed.resolve({**bearer(KEY_A), "x-tenant-id": "team-b"})
    assert a.tenant == spoof.tenant == "team-a" and a.salt == spoof.salt
    assert keyed.resolve(bearer(KEY_B)).salt != a.salt


@pytest.mark.parametrize("headers", [{}, {"x-tenant-id": "team-a"}, bearer("not-a-known-key"),
                                     {"authorization": KEY_A}, bearer(KEY_A + "x")])
def test_without_a_listed_key_a_request_is_refused(keyed: Tenancy,
                                                   headers: dict[str, str]) -> None:
    identity = keyed.resolve(headers)
    assert identity.refused is not None and "--api-keys-file" in identity.refused
    assert identity.tenant is None and identity.salt is None


def test_a_tenant_header_decides_only_when_trusted() -> None:
    untrusted = Tenancy(SECRET)
    trusted = Tenancy(SECRET, trust_header=True)
    spoof = {**bearer(KEY_A), "x-tenant-id": "team-b"}
    assert untrusted.resolve(spoof).tenant == untrusted.resolve(bearer(KEY_A)).tenant
    assert untrusted.resolve(spoof).tenant != "team-b"
    assert trusted.resolve(spoof) == Identity("team-b", trusted.salt_for("team-b"))
    # no header: the key is its own tenant; neither: anonymous, unsalted
    assert trusted.resolve(bearer(KEY_A)) == untrusted.resolve(bearer(KEY_A))
    assert untrusted.resolve({"x-tenant-id": "team-b"}) == Identity()


def test_each_key_is_its_own_tenant_without_a_keys_file() -> None:
    tenancy = Tenancy(SECRET)
    a, b = tenancy.resolve(bearer(KEY_A)), tenancy.resolve(bearer(KEY_B))
    assert a.tenant and b.tenant and a.tenant != b.tenant and a.salt != b.salt
    assert KEY_A not in (a.tenant or "")  # the key itself never becomes a label


def test_a_sharing_group_shares_one_salt_and_nobody_else_does() -> None:
    tenancy = Tenancy.from_options(SECRET, ["team-a=shared", "team-c=shared"],
                                   trust_header=True)
    salts = {t: tenancy.resolve({"x-tenant-id": t}).salt for t in ("team-a", "team-b", "team-c")}
    assert salts["team-a"] == salts["team-c"] != salts["team-b"]
    # the group's salt is not any member's own (a member that leaves gets a fresh one)
    assert salts["team-a"] != Tenancy(SECRET).salt_for("team-a")


def test_a_salt_cannot_be_computed_from_the_tenant_name() -> None:
    salt = Tenancy(SECRET).salt_for("team-a")
    guesses = [hashlib.sha256(f"{s}\x00team-a".encode()).hexdigest()[:32]
               for s in ("kvserve", SECRET, "")]
    assert salt not in guesses
    assert Tenancy(SECRET + "x").salt_for("team-a") != salt  # the secret decides
    assert len(salt) == 32


def test_bad_tenancy_settings_are_refused(keys_file: Path) -> None:
    with pytest.raises(ValueError, match="at least 16"):
        Tenancy("kvserve")
    with pytest.raises(ValueError, match="exclude each other"):
        Tenancy.from_options(SECRET, api_keys_file=str(keys_file), trust_header=True)
    with pytest.raises(ValueError, match="TENANT=GROUP"):
        Tenancy.from_options(SECRET, ["team-a"])


@pytest.mark.parametrize(("text", "says"), [
    ("team-a\n", "line 1: expected 'TENANT KEY'"),
    ("team-a short\n", "shorter than 16"),
    (f"team-a {KEY_A}\nteam-b {KEY_A}\n", "line 2: this key already belongs to tenant"),
    ("# nothing\n", "lists no"),
])
def test_a_bad_keys_file_names_what_is_wrong(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "keys"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=says):
        read_api_keys(path)
    with pytest.raises(ValueError, match="No such file"):
        read_api_keys(tmp_path / "missing")


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    return parser.parse_args(list(flags))


def test_a_gateway_without_a_secret_makes_its_own_and_replicas_refuse(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_SALT_SECRET", raising=False)
    first, second = tenancy_from(parse()), tenancy_from(parse())
    assert first.secret != second.secret and len(first.secret) >= 32
    with pytest.raises(ValueError, match="--replicas 2: every replica"):
        tenancy_from(parse("--replicas", "2"))
    assert tenancy_from(parse("--replicas", "2", "--salt-secret", SECRET)).secret == SECRET
    monkeypatch.setenv("KVSERVE_SALT_SECRET", SECRET)
    assert tenancy_from(parse("--replicas", "3")).secret == SECRET


def test_a_worker_key_needs_the_gateway_to_check_keys(keys_file: Path) -> None:
    with pytest.raises(ValueError, match="--worker-api-key"):
        tenancy_from(parse("--salt-secret", SECRET, "--worker-api-key", "w" * 20))
    tenancy = tenancy_from(parse("--salt-secret", SECRET, "--worker-api-key", "w" * 20,
                                 "--api-keys-file", str(keys_file)))
    assert tenancy.authenticates


def test_a_worker_hears_only_what_the_gateway_vouches_for(keyed: Tenancy) -> None:
    client = {**bearer(KEY_A), "x-request-id": "r1", "x-tenant-id": "team-b",
              "x-kvserve-salt-key": "stolen"}
    identity = keyed.resolve(client)
    assert keyed.upstream_headers(client, identity, "worker-key", "salt-key") == {
        "x-request-id": "r1", "authorization": "Bearer worker-key",
        "x-kvserve-salt-key": "salt-key", "x-tenant-id": "team-a"}
    # no worker key: the client's key is still not forwarded; no salt key: no tenant either
    assert keyed.upstream_headers(client, identity) == {"x-request-id": "r1"}
    open_gateway = Tenancy(SECRET)  # keys not checked here: the workers check the client's
    anonymous = {"x-tenant-id": "team-b", "x-kvserve-salt-key": "stolen"}
    assert open_gateway.upstream_headers(anonymous, open_gateway.resolve(anonymous),
                                         None, "salt-key") == {}
    assert open_gateway.upstream_headers(client, open_gateway.resolve(client))[
        "authorization"] == f"Bearer {KEY_A}"
