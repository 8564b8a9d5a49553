"""Worker discovery's pure part (file parsing, DNS answers, set differences), the pool's
draining, and `WorkerDiscovery` over a real file and an injected resolver."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from kvserve.gateway.fleet.discovery import (
    DnsName,
    WorkerDiscovery,
    WorkersFileError,
    fleet_change,
    parse_workers_file,
    worker_urls,
)
from kvserve.gateway.fleet.worker_pool import WorkerPool

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def test_a_workers_file_lists_one_url_a_line_with_comments_and_blank_lines() -> None:
    text = f"# the fleet\n{A}/\n\n   {B}   # the second one\n#{C}\n{A}\n"
    assert parse_workers_file(text, "w.txt") == {A, B}
    assert parse_workers_file("# nobody yet\n\n", "w.txt") == frozenset()


@pytest.mark.parametrize("bad", ["10.0.0.1:8000", "ftp://10.0.0.1", "http://", "http://h:x"])
def test_a_bad_line_names_the_file_and_line_and_what_a_line_must_be(bad: str) -> None:
    with pytest.raises(WorkersFileError, match=r"w\.txt:3: .*http://HOST:PORT"):
        parse_workers_file(f"{A}\n# fine\n{bad}\n{B}\n", "w.txt")


def test_dns_names_parse_as_name_and_port_and_refuse_anything_else() -> None:
    assert DnsName.from_spec("kvserve-worker.ns.svc:8000") == DnsName("kvserve-worker.ns.svc",
                                                                      8000)
    assert DnsName.from_spec("[::1]:9") == DnsName("::1", 9)
    for bad in ("kvserve-worker", "worker:http", ":8000", "http://w:8000", "w:0", "w:70000"):
        with pytest.raises(ValueError, match="--worker-dns NAME:PORT"):
            DnsName.from_spec(bad)


def test_dns_answers_become_worker_urls_once_each() -> None:
    answer = ["10.0.0.1", "10.0.0.2", "10.0.0.1", "fd00::1", "fe80::1%eth0", "not-an-ip"]
    assert worker_urls(answer, 8000) == {A, B, "http://[fd00::1]:8000", "http://[fe80::1]:8000"}


def test_fleet_change_is_the_two_set_differences() -> None:
    change = fleet_change({A, B}, {B, C})
    assert (change.added, change.removed) == ((C,), (A,))
    assert not fleet_change({A}, {A})


def test_a_removed_worker_drains_then_is_forgotten_once_its_last_request_ends() -> None:
    forgotten: list[str] = []
    pool = WorkerPool([A, B])
    pool.on_forgotten.append(forgotten.append)
    worker = pool.get(A)
    worker.in_flight = 2
    pool.remove(A)
    assert worker.draining and A in pool.workers and pool.active_urls() == {B}
    assert [v.worker_id for v in pool.views(0.0)] == [B]  # no new request goes there
    assert [w.url for w in pool.serving(0.0)] == [B]
    pool.end_request(worker)
    assert A in pool.workers and not forgotten
    pool.end_request(worker)
    assert A not in pool.workers and forgotten == [A]
    pool.remove(B)  # idle: forgotten at once
    assert pool.workers == {} and forgotten == [A, B]


def test_a_draining_worker_that_comes_back_takes_traffic_again() -> None:
    added: list[str] = []
    pool = WorkerPool([A])
    pool.on_added.append(added.append)
    pool.get(A).in_flight = 1
    pool.remove(A)
    assert pool.add(A + "/") is False  # the same worker, not a new one
    assert not pool.get(A).draining and [v.worker_id for v in pool.views(0.0)] == [A]
    assert pool.add(B) is True and added == [B]


class Answers:
    """A resolver that answers from a table a test edits; a name mapped to an exception
    raises it (what a real lookup does on NXDOMAIN or a timeout)."""

    def __init__(self) -> None:
        self.table: dict[str, list[str] | Exception] = {}
        self.asked = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked += 1
        answer = self.table[host]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_dns_is_re_resolved_and_a_failed_lookup_keeps_the_last_known_workers(
        caplog: pytest.LogCaptureFixture) -> None:
    answers = Answers()
    pool = WorkerPool([C], allow_empty=True)
    discovery = WorkerDiscovery(pool, [C], [DnsName("workers.svc", 8000)], resolver=answers)
    answers.table["workers.svc"] = ["10.0.0.1", "10.0.0.2"]

    async def scenario() -> None:
        change = await discovery.refresh_once()
        assert change.added == (A, B) and pool.active_urls() == {A, B, C}
        answers.table["workers.svc"] = OSError(-2, "Name or service not known")
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                assert not await discovery.refresh_once()
        assert pool.active_urls() == {A, B, C}  # never emptied by a failed lookup
        warnings = [r for r in caplog.records if "cannot read --worker-dns" in r.getMessage()]
        assert len(warnings) == 1 and "Name or service not known" in warnings[0].getMessage()
        assert discovery.errors == {"static": 0, "dns": 3, "file": 0}
        answers.table["workers.svc"] = ["10.0.0.2"]
        change = await discovery.refresh_once()
        assert (change.added, change.removed) == ((), (A,))
        assert pool.active_urls() == {B, C}  # the static worker stays whatever DNS says
        assert discovery.discovered == {"static": 1, "dns": 1, "file": 0}

    asyncio.run(scenario())


def write_atomically(path: Path, text: str) -> None:
    """Write beside the file and rename over it, as a ConfigMap update (or `mv`) does."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_changed_workers_file_is_re_read_and_a_bad_version_keeps_the_last_good_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "workers"
    path.write_text(f"{A}\n")
    pool = WorkerPool([], allow_empty=True)
    discovery = WorkerDiscovery(pool, workers_file=str(path))

    async def scenario() -> None:
        assert (await discovery.refresh_once()).added == (A,)
        write_atomically(path, f"{A}\n{B}\n")
        assert (await discovery.refresh_once()).added == (B,)
        with caplog.at_level(logging.WARNING):
            write_atomically(path, f"{A}\nnot a url\n")
            for _ in range(2):
                assert not await discovery.refresh_once()
        assert pool.active_urls() == {A, B}
        assert [r.getMessage() for r in caplog.records if "workers:2:" in r.getMessage()]
        assert discovery.errors["file"] == 1  # a bad version is read (and counted) once
        path.unlink()  # gone for a moment: keep what we had
        assert not await discovery.refresh_once()
        assert pool.active_urls() == {A, B} and discovery.errors["file"] == 2
        write_atomically(path, f"{B}\n")
        assert (await discovery.refresh_once()).removed == (A,)

    asyncio.run(scenario())


def test_a_configmap_symlink_swap_is_seen(tmp_path: Path) -> None:
    """A mounted ConfigMap: `workers` -> `..data/workers`, `..data` -> a timestamped folder
    that an update replaces by swapping the `..data` link."""
    def version(name: str, text: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "workers").write_text(text)
        os.utime(tmp_path / name / "workers", ns=(0, 0))  # only the inode tells them apart
        (tmp_path / "..data_tmp").symlink_to(name)
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")

    version("..v1", f"{A}\n")
    (tmp_path / "workers").symlink_to("..data/workers")
    pool = WorkerPool([], allow_empty=True)
    discovery = WorkerDiscovery(pool, workers_file=str(tmp_path / "workers"))

    async def scenario() -> None:
        await discovery.refresh_once()
        version("..v2", f"{B}\n")  # same size and mtime: a new inode
        change = await discovery.refresh_once()
        assert (change.added, change.removed) == ((B,), (A,))

    asyncio.run(scenario())


def test_a_missing_or_bad_workers_file_at_start_says_how_to_fix_it(tmp_path: Path) -> None:
    pool = WorkerPool([], allow_empty=True)
    with pytest.raises(ValueError, match=r"one worker URL per line.*ConfigMap"):
        WorkerDiscovery(pool, workers_file=str(tmp_path / "absent"))
    (tmp_path / "bad").write_text("worker-0:8000\n")
    with pytest.raises(WorkersFileError, match="bad:1"):
        WorkerDiscovery(pool, workers_file=str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="--discovery-interval"):
        WorkerDiscovery(pool, interval_s=0)


def test_added_workers_are_handed_on_and_run_refreshes_every_interval(tmp_path: Path) -> None:
    answers = Answers()
    answers.table["w"] = ["10.0.0.1"]
    pool = WorkerPool([], allow_empty=True)
    seen: list[tuple[str, ...]] = []

    async def on_added(urls: tuple[str, ...]) -> None:
        seen.append(tuple(urls))

    discovery = WorkerDiscovery(pool, dns_names=[DnsName("w", 8000)], interval_s=0.01,
                                resolver=answers, on_added=on_added)  # type: ignore[arg-type]

    async def scenario() -> None:
        discovery.start()
        while not seen:
            await asyncio.sleep(0.01)
        answers.table["w"] = ["10.0.0.1", "10.0.0.3"]
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        await discovery.stop()

    asyncio.run(asyncio.wait_for(scenario(), 10.0))
    assert seen == [(A,), (C,)] and answers.asked >= 2


def test_a_round_that_fails_downstream_does_not_stop_discovery(
        caplog: pytest.LogCaptureFixture) -> None:
    answers = Answers()
    answers.table["w"] = ["10.0.0.1"]
    pool = WorkerPool([], allow_empty=True)
    seen: list[tuple[str, ...]] = []

    async def on_added(urls: tuple[str, ...]) -> None:
        seen.append(tuple(urls))
        if len(seen) == 1:
            raise RuntimeError("a tokenizer file that cannot be read")

    discovery = WorkerDiscovery(pool, dns_names=[DnsName("w", 8000)], interval_s=0.01,
                                resolver=answers, on_added=on_added)  # type: ignore[arg-type]

    async def scenario() -> None:
        discovery.start()
        while not seen:
            await asyncio.sleep(0.01)
        answers.table["w"] = ["10.0.0.1", "10.0.0.2", "bad name", "10.0.0.3"]
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        await discovery.stop()

    with caplog.at_level(logging.ERROR):
        asyncio.run(asyncio.wait_for(scenario(), 10.0))
    assert seen == [(A,), (B, C)]
    assert any("discovery round failed" in r.getMessage() for r in caplog.records)
