"""A differential oracle: seeded histories of raw torch-protocol requests, run against
torch's own TCPStore server and against tierrun (flat, tiered, a two-level tree, and
clients spread over every level), compared byte for byte (sequential histories) or
checked for linearizability (concurrent ones).

    wire        requests as tuples -> bytes; a reply-stream reader per connection
    history     the seeded generator of histories (and their printable form)
    targets     the servers: torch's in a subprocess, tierrun's topologies, reused
    sequential  one client acting at a time; traces compared with torch's
    concurrent  clients pipelining at once; linearizability of each target's answers
    minimize    shrinking a failing history to a small one
    regressions the table of minimized histories (and KNOWN_BUGS) the CI test runs
"""
