import os
import uuid
from datetime import timedelta

import pytest

from tierrun.server import StoreProcess


@pytest.fixture(autouse=True)
def _environ_restored():
    """Rendezvous handlers run in the test process set variables for torch's agent in
    ``os.environ`` (TORCH_ELASTIC_WORKER_IDENTICAL); the nodes later tests launch must
    not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def store():
    """A fresh tierrun store in its own process, on a free port and an abstract socket."""
    with StoreProcess(host="127.0.0.1", port=0, unix=f"@tierrun-test-{uuid.uuid4().hex}") as sp:
        yield sp


@pytest.fixture
def torch_client(store):
    """Factory of torch's own TCPStore clients connected to ``store``."""
    import torch.distributed as dist

    clients = []

    def make(timeout: float = 10.0):
        c = dist.TCPStore(
            "127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=timeout)
        )
        clients.append(c)
        return c

    yield make
    clients.clear()
