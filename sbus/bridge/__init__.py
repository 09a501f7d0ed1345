"""``sbus bridge``: join sbus brokers on many hosts through NATS (docs/bridge.md)."""
from .mapping import (HEADER, UnmappableError, decode_header, encode_header, key_to_subject,
                      subject_to_key)

__all__ = ["HEADER", "UnmappableError", "decode_header", "encode_header", "key_to_subject",
           "subject_to_key"]
