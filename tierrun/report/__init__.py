"""What an operator reads: live rendezvous progress, the failure report, the timeline.

Every agent records its own phases and failures (``recorder``) and publishes them to the
job's store (``board``); whoever reports reads everyone's from there.
"""
