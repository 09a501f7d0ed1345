"""How ``sbus sub`` prints a message: plain, JSON, raw, or a ``--format`` template.

A template is a Python format string over the fields in ``FIELDS``, checked
once when the command line is parsed; each field is computed only if the
template uses it. ``\\n`` and ``\\t`` in a template mean newline and tab, and
every rendered message ends with a newline, as with ``mosquitto_sub -F``.
"""
from __future__ import annotations

import base64
import datetime
import json
import string
import time
from decimal import Decimal
from typing import Callable, Dict, Optional, Union

from ..client.protocol import ControlMessage, Message

Packet = Union[Message, ControlMessage]
Renderer = Callable[[Packet], bytes]

FIELDS: Dict[str, str] = {
    "key": "the routing key (UTF-8; undecodable bytes as \\xNN)",
    "payload": "the payload (UTF-8; undecodable bytes as \\xNN)",
    "size": "the payload's size in bytes",
    "time": "when it arrived: local ISO 8601 with milliseconds",
    "unix": "when it arrived: seconds since the epoch (replay, last: exact to the ns)",
    "hex": "the payload in hexadecimal",
    "base64": "the payload in base64",
    "json": "the --json object of the message, on one line",
    "type": "msg, or cmsg for a control message",
}
# sbus replay and sbus last also know where a message sits in the store.
STORE_FIELDS: Dict[str, str] = {
    **FIELDS,
    "seq": "the record's sequence number in the store (resume with --after SEQ)",
}
VERBOSE = "{key} {payload}"     # -v, as mosquitto_sub -v


def _json_field(out: Dict[str, str], name: str, raw: bytes) -> None:
    """``name`` as text if ``raw`` is UTF-8, else ``name_base64``: JSON cannot carry bytes."""
    try:
        out[name] = raw.decode("utf-8")
    except UnicodeDecodeError:
        out[name + "_base64"] = base64.b64encode(raw).decode("ascii")


def json_object(message: Packet) -> str:
    out = {"type": "msg" if type(message) is Message else "cmsg"}
    _json_field(out, "key", message.key)
    _json_field(out, "payload", message.payload)
    return json.dumps(out, ensure_ascii=False)


def format_json(message: Packet) -> bytes:
    """One JSON line: ``{"type": "msg"|"cmsg", "key": ..., "payload": ...}``."""
    return json_object(message).encode("utf-8") + b"\n"


def format_plain(message: Packet) -> bytes:
    """``KEY<TAB>PAYLOAD`` as raw bytes; a control message is prefixed with ``CMSG ``."""
    prefix = b"" if type(message) is Message else b"CMSG "
    return b"%s%s\t%s\n" % (prefix, message.key, message.payload)


def format_raw(message: Packet) -> bytes:
    """The payload's bytes and nothing else (control messages are not shown)."""
    return message.payload if type(message) is Message else b""


class _Fields(dict):
    """The template's fields of one message, each computed when first asked for."""

    def __init__(self, message: Packet, arrived: Union[float, Decimal],
                 seq: Optional[Callable[[], int]] = None):
        super().__init__()
        self.message = message
        self.arrived = arrived
        self.seq = seq

    def __missing__(self, name: str):
        m, t = self.message, self.arrived
        if name == "key":
            value = m.key.decode("utf-8", "backslashreplace")
        elif name == "payload":
            value = m.payload.decode("utf-8", "backslashreplace")
        elif name == "size":
            value = len(m.payload)
        elif name == "time":
            value = datetime.datetime.fromtimestamp(float(t)).isoformat(timespec="milliseconds")
        elif name == "unix":
            value = t
        elif name == "hex":
            value = m.payload.hex()
        elif name == "base64":
            value = base64.b64encode(m.payload).decode("ascii")
        elif name == "json":
            value = json_object(m)
        elif name == "type":
            value = "msg" if type(m) is Message else "cmsg"
        elif name == "seq" and self.seq is not None:
            value = self.seq()
        else:
            raise KeyError(name)
        self[name] = value
        return value


def check_template(template: str, fields: Dict[str, str] = FIELDS) -> str:
    """The template with its escapes applied; ValueError names a field not in ``fields``."""
    template = template.replace("\\n", "\n").replace("\\t", "\t")
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        base = name.split(".")[0].split("[")[0]
        if base not in fields:
            raise ValueError(f"unknown field {{{name}}}; fields: "
                             + " ".join(f"{{{f}}}" for f in fields))
    template.format_map(_Fields(Message(b"k", b"p"), time.time(), lambda: 1))   # other errors
    return template


def format_template(template: str, clock: Callable[[], Union[float, Decimal]] = time.time,
                    seq: Optional[Callable[[], int]] = None) -> Renderer:
    """A renderer for a template already passed through ``check_template``;
    ``clock()`` gives the message's {time} and {unix} (default: now), ``seq()``
    its {seq} (replay and last)."""
    def render(message: Packet) -> bytes:
        fields = _Fields(message, clock(), seq)
        return template.format_map(fields).encode("utf-8", "surrogateescape") + b"\n"
    return render
