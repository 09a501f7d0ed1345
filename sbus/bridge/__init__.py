"""``sbus bridge``: join sbus brokers on many hosts through NATS (docs/bridge.md).

- ``mapping``: routing key <-> NATS subject and header, both ways.
- ``forward``: ``Bridge``, the two directions (local bus -> NATS, NATS -> local bus).
- ``natsconn``: where the C framing (``sbus._core.natswire``) meets nats-py: its fast
  path on the releases it was tested on, the public API on any other.
- ``counters``: what each direction counts and drops; ``defaults``: the defaults.
- ``cli``: ``sbus bridge``'s options.
"""
from .mapping import HEADER, UnmappableError, decode_header, encode_header, key_to_subject, subject_to_key

__all__ = ["HEADER", "UnmappableError", "decode_header", "encode_header", "key_to_subject",
           "subject_to_key"]
