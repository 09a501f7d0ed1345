"""The bridge's counters: one home for their names, the log and the stats message."""
from __future__ import annotations

# Cumulative since the bridge started. out_* is local bus -> NATS, in_* NATS -> local bus.
FIELDS = (
    "out_forwarded",          # messages handed to NATS
    "out_forwarded_bytes",    # their payload bytes
    "out_private",            # '!' keys matched by an export pattern and kept home (not drops)
    "out_dropped_full",       # dropped because the pending buffer was over --max-pending
    "out_dropped_unmappable",  # a subject longer than NATS takes, or a message over its max_payload
    "in_forwarded",           # messages published on the local bus
    "in_forwarded_bytes",     # their payload bytes
    "in_dropped_private",     # the key would start with '!'
    "in_dropped_unmappable",  # bad Sbus-Key header, or a subject that maps to no key
    "in_dropped_oversize",    # larger than the local broker's --max-message
    "in_dropped_refused",     # a key the broker would refuse (a misused '!')
    "in_dropped_local",       # the local broker was away and the backlog full, or NATS
                              # reported this subscriber slow (it dropped for us)
    "in_dropped_full",        # more than --max-pending bytes waiting for the local broker
    "private_out",            # --private: keys under another host's identity, to its subject
    "private_in",             # --private: from this host's private subject, to a process here
    "private_local",          # --private: keys under this host's own identity, delivered here
    "nats_connects",          # successful connections to NATS, the first and reconnections
    "nats_disconnects",       # connections to NATS lost
)
OUT_DROPS = ("out_dropped_full", "out_dropped_unmappable")
IN_DROPS = ("in_dropped_private", "in_dropped_unmappable", "in_dropped_oversize",
            "in_dropped_refused", "in_dropped_local", "in_dropped_full")


class Counters:
    """Plain integer attributes, one per name in FIELDS."""

    __slots__ = FIELDS

    def __init__(self) -> None:
        for name in FIELDS:
            setattr(self, name, 0)

    def as_dict(self, *more: dict) -> dict:
        """Every counter, plus the counts in ``more``: the drops natswire's
        Exporter and Importer count, on either path."""
        out = {name: getattr(self, name) for name in FIELDS}
        for counts in more:
            for name, value in counts.items():
                out[name] += value
        out["out_dropped"] = sum(out[n] for n in OUT_DROPS)
        out["in_dropped"] = sum(out[n] for n in IN_DROPS)
        return out
