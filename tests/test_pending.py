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
    assert not b and b.take() == []


def test_a_watching_read_counts_as_its_request():
    b = PendingBatch()
    b.add("c0", b"", (WATCH_MARK, (Op.WAIT, (b"/a",)), None))
    b.add("c0", b"", (WATCH_MARK, (Op.CHECK, (b"/a",)), None))
    assert b.cancel_waits("c0")
    assert [r[1][0] for _, _, r in b.take()] == [Op.CHECK]
    assert not b.cancel_waits("c1")

