"""A ``--rdzv_conf`` key the backend does not read is named, once per node, with the
setting it resembles (tierrun/rendezvous/__init__.py): torch's backends ignore it in
silence. Creating a handler contacts nothing, so no store or etcd runs here."""

import logging

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from tierrun import rendezvous
from tierrun.settings import Settings

#: What each backend reads, besides what every tierrun backend and the launchers add.
EVERY = {"progress": "off", "progress_interval": "2", "heartbeat_interval": "1", "heartbeat_timeout": "5",
         "store_workers": "1", "tiered": "1", "store_public_clients": "1", "local_world_size": "2",
         "timeout": 900}  # (torch's launcher adds timeout=900, an int, to every backend's without one)
OWN = {
    "tierrun": {"join_timeout": "30", "last_call_timeout": "1", "is_host": "0", "store_fanout": "2"},
    "parallel": {"rank": "0", "store_fanout": "2"},
    "tierrun-etcd": {"join_timeout": "30", "last_call_timeout": "1", "is_host": "0", "protocol": "http",
                     "etcd_timeout": "5", "store_port": "0"},
}


def _create(backend: str, monkeypatch, **conf: str):
    monkeypatch.setenv("TIERRUN_TOKEN", "a-test-token")
    endpoint = "127.0.1.1:29400" if backend != "tierrun-etcd" else "127.0.1.1:2379"  # (nothing is contacted)
    return rendezvous.create(backend, RendezvousParameters(backend, endpoint, "keys", 2, 2, local_addr="127.0.1.2",
                                                           **conf), Settings.from_env())


@pytest.mark.parametrize("backend", sorted(OWN))
def test_every_setting_a_backend_reads_passes_in_silence(backend, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="tierrun.rendezvous"):
        _create(backend, monkeypatch, **EVERY, **OWN[backend])
    assert [r.getMessage() for r in caplog.records] == []


@pytest.mark.parametrize("backend", sorted(OWN))
def test_a_misspelt_setting_is_named_with_the_one_it_resembles(backend, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="tierrun.rendezvous"):
        _create(backend, monkeypatch, **EVERY, **OWN[backend], heartbeat_timout="9")
    assert [r.getMessage() for r in caplog.records] == [
        f"node 127.0.1.2: --rdzv_conf heartbeat_timout is not a setting of the {backend} backend: ignored; "
        "did you mean heartbeat_timeout?"]


def test_another_backends_setting_is_named_with_what_this_one_reads(monkeypatch, caplog):
    """torch's c10d ``read_timeout``, or a tree asked of the etcd backend, which builds none."""
    with caplog.at_level(logging.WARNING, logger="tierrun.rendezvous"):
        _create("tierrun", monkeypatch, read_timeout="60")
        _create("tierrun-etcd", monkeypatch, store_fanout="2", tiered="1")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2
    assert said[0].startswith("node 127.0.1.2: --rdzv_conf read_timeout is not a setting of the tierrun "
                              "backend: ignored (it reads: ")
    assert "join_timeout" in said[0] and "last_call_timeout" in said[0] and "local_world_size" not in said[0]
    assert said[1].startswith("node 127.0.1.2: --rdzv_conf store_fanout is not a setting of the tierrun-etcd "
                              "backend: ignored (it reads: ")


@pytest.mark.parametrize("backend", ["tierrun", "tierrun-etcd"])
def test_a_timeout_written_for_an_elastic_backend_is_named_with_join_timeout(backend, monkeypatch, caplog):
    """torch's launcher adds ``timeout=900`` (an int) to every config; one a person wrote
    (a string, also 900) is not read by the elastic backends, which wait ``join_timeout``."""
    with caplog.at_level(logging.WARNING, logger="tierrun.rendezvous"):
        _create(backend, monkeypatch, timeout="900")
    assert [r.getMessage() for r in caplog.records] == [
        f"node 127.0.1.2: --rdzv_conf timeout is not a setting of the {backend} backend: ignored; "
        "did you mean join_timeout?"]


def test_a_setting_in_capitals_or_with_dashes_is_recognised(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="tierrun.rendezvous"):
        _create("tierrun", monkeypatch, **{"JOIN_TIMEOUT": "5", "last-call-timeout": "1", "password": "hunter2"})
    said = [r.getMessage() for r in caplog.records]
    assert said[:2] == [
        "node 127.0.1.2: --rdzv_conf JOIN_TIMEOUT is not a setting of the tierrun backend: ignored; did you mean "
        "join_timeout?",
        "node 127.0.1.2: --rdzv_conf last-call-timeout is not a setting of the tierrun backend: ignored; did you "
        "mean last_call_timeout?"]
    assert "hunter2" not in " ".join(said)  # (values are not repeated: one may be a secret)
