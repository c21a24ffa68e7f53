"""tier.pending: the batch being built, and CANCEL_WAIT's marks (no event loop)."""

from tierrun.protocol import Op
from tierrun.tier.pending import PendingBatch
from tierrun.tier.plan import WATCH_MARK


def test_cancel_drops_only_the_waits_queued_before_it():
    b = PendingBatch()
    b.add("c0", b"", (Op.WAIT, (b"/a",)))
    b.add("c0", b"", (Op.SET, b"/x", b"1"))
    b.add("c1", b"", (Op.WAIT, (b"/a",)))
    b.add("c0", b"", (Op.BARRIER, b"/b", 2))
    assert b.cancel_waits("c0")
    assert not b.cancel_waits("c0")  # (nothing of c0's left to cancel)
    b.add("c0", b"", (Op.WAIT, (b"/a",)))  # after its CANCEL_WAIT: stays
    assert [(w, r[0]) for w, _, r in b.take()] == [("c0", Op.SET), ("c1", Op.WAIT), ("c0", Op.WAIT)]
    assert not b.items and b.take() == []


def test_a_watching_read_counts_as_its_request():
    b = PendingBatch()
    b.add("c0", b"", (WATCH_MARK, (Op.WAIT, (b"/a",)), None))
    b.add("c0", b"", (WATCH_MARK, (Op.CHECK, (b"/a",)), None))
    assert b.cancel_waits("c0")
    assert [r[1][0] for _, _, r in b.take()] == [Op.CHECK]
    assert not b.cancel_waits("c1")



def test_waits_of_keeps_every_group_of_a_client():
    from tierrun.tier.waits_of import WaitsOf

    w = WaitsOf()
    a, b, c = object(), object(), object()
    w.add("c0", a)
    w.add("c1", c)
    w.add("c0", b)  # (a client that pipelines two WAITs)
    w.answered("c0", a)
    assert w.pop("c0") == [b] and w.pop("c0") == []
    w.answered("c1", b)  # (not c1's: nothing happens)
    assert w.pop("c1") == [c]
