"""torch 2.13's own TCPStore client against tierrun's store, one operation at a time."""

import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist

from tierrun.server import StoreProcess


@pytest.fixture(params=[1, 2], ids=["one-process", "two-front-end-processes"])
def store(request):
    """The store in one process, and with two front-end processes sharing its ports
    (``--workers 2``): torch's client must see no difference."""
    with StoreProcess(host="127.0.0.1", port=0, unix=f"@tierrun-test-{uuid.uuid4().hex}",
                      extra_args=["--workers", str(request.param)]) as sp:
        yield sp


def test_set_get(torch_client):
    c = torch_client()
    c.set("k", "v")
    assert c.get("k") == b"v"
    c.set("k", b"\x00\xffbinary")
    assert c.get("k") == b"\x00\xffbinary"


def test_get_waits_for_a_later_set(torch_client):
    c, other = torch_client(), torch_client()
    threading.Timer(0.3, lambda: other.set("late", "here")).start()
    t0 = time.monotonic()
    assert c.get("late") == b"here"
    assert time.monotonic() - t0 >= 0.25


def test_wait_several_keys_completes_when_the_last_appears(torch_client):
    c, other = torch_client(), torch_client()
    other.set("w1", "1")
    done = threading.Event()

    def waiter():
        c.wait(["w1", "w2", "w3"])
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    other.set("w2", "2")
    assert not done.wait(0.3)
    other.add("w3", 1)
    assert done.wait(5)
    t.join()


def test_wait_timeout_cancels_and_the_connection_stays_usable(torch_client):
    c = torch_client(timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        c.wait(["never"])
    assert time.monotonic() - t0 < 5
    c.set("after", "1")
    assert c.get("after") == b"1"
    c.wait(["after"], timedelta(seconds=1))


def test_wait_woken_by_each_write_op(torch_client):
    c, w = torch_client(), torch_client()
    writers = {
        "set": lambda k: w.set(k, "x"),
        "add": lambda k: w.add(k, 3),
        "append": lambda k: w.append(k, "x"),
        "compare_set": lambda k: w.compare_set(k, "", "x"),
        "multi_set": lambda k: w.multi_set([k], ["x"]),
    }
    for name, write in writers.items():
        key = f"wake-{name}"
        threading.Timer(0.1, write, args=(key,)).start()
        c.wait([key], timedelta(seconds=5))


def test_compare_set_wakes_even_when_it_changes_nothing(torch_client):
    c, w = torch_client(), torch_client()
    threading.Timer(0.1, lambda: w.compare_set("cs-nothing", "expected", "new")).start()
    # the key stays missing, but torch's server wakes the waiter's count for it
    c.set_timeout(timedelta(seconds=5))
    done = threading.Event()

    def waiter():
        try:
            c.wait(["cs-nothing"])
            done.set()
        except Exception:
            pass

    t = threading.Thread(target=waiter)
    t.start()
    t.join(6)
    assert done.is_set()


def test_delete_does_not_wake_and_a_deleted_key_is_waited_for_again(torch_client):
    c, w = torch_client(timeout=0.5), torch_client()
    w.set("d", "1")
    assert w.delete_key("d") is True
    assert w.delete_key("d") is False
    assert not w.check(["d"])
    with pytest.raises(dist.DistStoreError):
        c.wait(["d"])


def test_compare_set_three_cases(torch_client):
    c = torch_client()
    # missing key, empty expected: stores desired, returns desired
    assert c.compare_set("cs1", "", "new") == b"new"
    assert c.get("cs1") == b"new"
    # missing key, non-empty expected: returns expected, stores nothing
    assert c.compare_set("cs2", "old", "new") == b"old"
    assert not c.check(["cs2"])
    # present key: replaced only if equal; returns the current value
    assert c.compare_set("cs1", "wrong", "x") == b"new"
    assert c.compare_set("cs1", "new", "x") == b"x"
    assert c.get("cs1") == b"x"


def test_add_counts_and_stores_decimal(torch_client):
    c = torch_client()
    assert c.add("n", 5) == 5
    assert c.add("n", -7) == -2
    assert c.get("n") == b"-2"
    c.set("m", "40")
    assert c.add("m", 2) == 42


def test_add_on_a_non_number_fails_that_client_only(torch_client, store):
    c, other = torch_client(), torch_client()
    c.set("text", "hello")
    with pytest.raises(dist.DistError):
        c.add("text", 1)
    assert other.add("counter", 1) == 1
    deadline = time.monotonic() + 5
    while "not a number" not in store.output and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "ADD failed" in store.output and "not a number" in store.output


def test_check_and_num_keys(torch_client):
    c = torch_client()
    assert c.check(["a"]) is False
    c.set("a", "1")
    c.set("b", "2")
    assert c.check(["a", "b"]) is True
    assert c.check(["a", "zz"]) is False
    assert c.num_keys() == 2


def test_append(torch_client):
    c = torch_client()
    c.append("ap", "ab")
    c.append("ap", "cd")
    assert c.get("ap") == b"abcd"


def test_multi_get_multi_set(torch_client):
    c = torch_client()
    c.multi_set(["x", "y", "z"], ["1", "2", b"\x00"])
    assert c.multi_get(["z", "x", "y"]) == [b"\x00", b"1", b"2"]


def test_queue_push_pop_len(torch_client):
    c, w = torch_client(), torch_client()
    assert c.queue_len("q") == 0
    c.queue_push("q", "a")
    c.queue_push("q", "b")
    assert c.queue_len("q") == 2
    assert c.queue_pop("q") == b"a"
    assert c.queue_pop("q", block=False) == b"b"
    with pytest.raises(dist.QueueEmptyError):
        c.queue_pop("q", block=False)
    threading.Timer(0.2, lambda: w.queue_push("q", "later")).start()
    assert c.queue_pop("q") == b"later"


def test_queue_is_not_a_key(torch_client):
    c = torch_client()
    c.queue_push("qq", "a")
    assert c.check(["qq"])  # a non-empty queue counts as present
    assert c.num_keys() == 0
    assert c.list_keys() == []


def test_list_keys(torch_client):
    c = torch_client()
    c.set("l1", "1")
    c.add("l2", 1)
    assert sorted(c.list_keys()) == ["l1", "l2"]


def test_barrier(torch_client):
    clients = [torch_client() for _ in range(3)]
    done = []
    threads = [
        threading.Thread(target=lambda c=c: (c.barrier("bar", 3), done.append(1)))
        for c in clients[:2]
    ]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert done == []
    clients[2].barrier("bar", 3)
    for t in threads:
        t.join(5)
    assert len(done) == 2


def test_many_clients_at_once(store):
    n = 64
    errors = []
    results = []

    def worker(i):
        try:
            c = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
            results.append(c.add("many", 1))
            c.set(f"client/{i}", str(i))
            c.wait(["release"])
            assert c.get(f"client/{(i + 1) % n}") == str((i + 1) % n).encode()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    c = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    deadline = time.monotonic() + 30
    while len(results) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    c.wait([f"client/{i}" for i in range(n)])
    c.set("release", "go")
    for t in threads:
        t.join(30)
    assert not errors
    assert sorted(results) == list(range(1, n + 1))


def test_clone_opens_a_second_connection(torch_client):
    c = torch_client()
    c2 = c.clone()
    c.set("cl", "1")
    assert c2.get("cl") == b"1"
