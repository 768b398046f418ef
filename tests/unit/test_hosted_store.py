"""The rendezvous store hosted by whoever starts a world's ranks (``rendezvous_at_hosted_store``): the
ranks join it as clients, each rendezvous under its own key prefix. Worlds of spawned ranks:
tests/dist/test_rendezvous.py."""

from __future__ import annotations

import datetime
import importlib
import os

import pytest
from rank_cases import sums_in_fresh_worlds

from megagrpo.compat.torch_store import rendezvous_at_hosted_store
from megagrpo.parallel.local import host_store, hosted_store_env, run_in_this_process

pytestmark = pytest.mark.unit

TIMEOUT = datetime.timedelta(seconds=10)


def test_each_rendezvous_at_the_hosted_store_is_a_client_under_its_own_prefix(monkeypatch):
    server = host_store("127.0.0.1", 2, 10.0)
    for key, value in hosted_store_env("127.0.0.1", server.port).items():
        monkeypatch.setenv(key, value)
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    original = rendezvous._create_c10d_store
    with rendezvous_at_hosted_store():
        # Rank 0 as well: the server exists, so no rank may try to bind its port.
        first = rendezvous._create_c10d_store("127.0.0.1", server.port, 0, 2, TIMEOUT)
        second = rendezvous._create_c10d_store("127.0.0.1", server.port, 0, 2, TIMEOUT)
        elsewhere = rendezvous._create_c10d_store("127.0.0.1", 0, 0, 1, TIMEOUT)  # not ours: torch hosts
    assert rendezvous._create_c10d_store is original
    first.set("k", "a")
    second.set("k", "b")
    assert server.get("megagrpo/rendezvous0/k") == b"a"
    assert server.get("megagrpo/rendezvous1/k") == b"b"
    assert elsewhere.port not in (0, server.port)


def test_run_in_this_process_joins_a_store_it_hosts_and_puts_the_environment_back():
    before = {key: os.environ.get(key) for key in ("MASTER_PORT", "MEGAGRPO_HOSTED_STORE")}
    assert run_in_this_process(sums_in_fresh_worlds) == [1, 11]
    assert {key: os.environ.get(key) for key in before} == before
