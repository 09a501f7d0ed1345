"""The broker's ``CMSG stats`` reply in the Prometheus text exposition format.

``sbus stats --format prometheus`` prints it; node_exporter's textfile
collector reads it as is (``sbus stats --format prometheus > x.prom.$$ &&
mv x.prom.$$ /var/lib/node_exporter/sbus.prom``). Metric names are
``sbus_…``; counters are typed ``counter`` and end in ``_total``, as the
Prometheus naming conventions ask; per-client series carry the labels
``client``, ``pid`` and ``uid``, per-user series ``uid`` (budget use, and
the access policy's denials, which outlive the uid's connections). Every field the
broker reports (``logschema``) has its name and type here; one the stats
reply gains later is still exported, as a gauge named after it.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

from .. import logschema as schema

COUNTER, GAUGE = "counter", "gauge"

# stats field -> (metric name without the sbus_/sbus_client_ prefix, type, help)
_TRAFFIC = {
    "msgs_in": ("messages_received_total", COUNTER, "MSG packets received from publishers"),
    "bytes_in": ("received_bytes_total", COUNTER, "bytes of the MSG packets received"),
    "msgs_out": ("messages_delivered_total", COUNTER, "MSG deliveries, one per recipient"),
    "bytes_out": ("delivered_bytes_total", COUNTER, "bytes of the MSG deliveries"),
    "replies_out": ("replies_total", COUNTER, "control replies written (whoami, stats)"),
    "queued_msgs": ("queued_messages", GAUGE, "deliveries waiting in send queues"),
    "queued_bytes": ("queued_bytes", GAUGE, "bytes waiting in send queues"),
    "subscriptions": ("subscriptions", GAUGE, "patterns registered"),
    "denied": ("policy_denied_total", COUNTER,
               "publishes the access policy denied (delivered to no one)"),
}
_DROPS = ("dropped_messages_total", COUNTER,
          "deliveries discarded, by kind: soft or hard flood mode, or recipient disconnected")
TOTALS = {
    "clients": ("clients", GAUGE, "clients connected"),
    "connects": ("connects_total", COUNTER, "connections admitted since the broker started"),
    "disconnects": ("disconnects_total", COUNTER, "admitted connections closed"),
    **_TRAFFIC,
    "queued_bytes_peak": ("queued_bytes_peak", GAUGE, "highest queued bytes seen"),
    "sub_bytes": ("subscription_bytes", GAUGE,
                  "subscription bytes charged to budgets (patterns and their index)"),
    "budget_conns_refused": ("budget_connections_refused_total", COUNTER,
                             "connections refused for a uid's connection budget"),
    "budget_subs_refused": ("budget_subscriptions_refused_total", COUNTER,
                            "SUBs refused for a subscription-bytes budget"),
    "policy_subs_refused": ("policy_subscriptions_refused_total", COUNTER,
                            "SUBs the access policy refused"),
}
CLIENT = dict(_TRAFFIC)
# The stats reply's policy_uids (logschema.POLICY_UID_FIELDS), labelled uid.
POLICY_UID = {
    "denied": ("policy_denied_total", COUNTER,
               "publishes of this uid the access policy denied, since the broker started"),
    "subs_refused": ("policy_subscriptions_refused_total", COUNTER,
                     "SUBs of this uid the access policy refused, since the broker started"),
}
# Fields that are labels or identity, not values.
_NOT_VALUES = {"client", "pid", "uid", "gid", "soft", "hard", "order", "echo"}

Labels = Tuple[Tuple[str, Any], ...]


class Families:
    """Metric families in the order first seen, each with its samples."""

    def __init__(self):
        self.meta: Dict[str, Tuple[str, str]] = {}
        self.samples: Dict[str, List[Tuple[Labels, Any]]] = {}

    def add(self, name: str, kind: str, help: str, value: Any, labels: Labels = ()) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return      # null (no budget) or text: not a sample
        self.meta.setdefault(name, (kind, help))
        self.samples.setdefault(name, []).append((labels, value))

    def text(self) -> str:
        out = []
        for name, (kind, help) in self.meta.items():
            out.append(f"# HELP {name} {_escape_help(help)}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in self.samples[name]:
                out.append(f"{name}{_labels(labels)} {_number(value)}")
        return "\n".join(out) + "\n"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels) + "}"


def _number(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def _values(families: Families, prefix: str, table: dict, record: Dict[str, Any],
            labels: Labels, what: str) -> None:
    """Every value field of ``record``: known ones from ``table``, drops by
    kind, and any other number as a gauge named after its field."""
    for field, value in record.items():
        if field in _NOT_VALUES:
            continue
        if field in schema.DROP_KINDS:
            name, kind, help = _DROPS
            families.add(prefix + name, kind, help, value,
                         labels + (("kind", field[len("drops_"):]),))
        elif field in table:
            name, kind, help = table[field]
            families.add(prefix + name, kind, help, value, labels)
        else:
            families.add(prefix + field, GAUGE, f"{what} {field} (see docs/logging.md)",
                         value, labels)


def to_prometheus(stats: Dict[str, Any], clients: bool = True) -> str:
    """The exposition text of one ``CMSG stats`` reply; ``clients=False``
    leaves out the per-client series (a busy bus has many)."""
    f = Families()
    f.add("sbus_uptime_seconds", GAUGE, "seconds since the broker started",
          stats.get("uptime_s"))
    if "backend" in stats:
        f.add("sbus_broker_info", GAUGE, "the broker's event-loop backend (value is always 1)",
              1, (("backend", stats["backend"]),))
    _values(f, "sbus_", TOTALS, stats.get("totals", {}), (), "broker-wide")
    f.add("sbus_clients_omitted", GAUGE,
          "clients left out of the stats reply, which would not fit in one packet",
          stats.get("clients_omitted"))
    for user in _users(stats):
        labels = (("uid", user.get("uid")),)
        _values(f, "sbus_user_", {}, user, labels, "per-uid budget use:")
    for user in stats.get("policy_uids", ()):
        _values(f, "sbus_user_", POLICY_UID, user, (("uid", user.get("uid")),),
                "per-uid access policy:")
    if clients:
        for c in stats.get("clients", ()):
            labels = (("client", c.get("client")), ("pid", c.get("pid")), ("uid", c.get("uid")))
            _values(f, "sbus_client_", CLIENT, c, labels, "per-client")
            modes = tuple((m, str(c[m]).lower()) for m in ("soft", "hard", "order", "echo")
                          if m in c)
            if modes:
                f.add("sbus_client_info", GAUGE,
                      "a client's flood modes and queue order (value is always 1)",
                      1, labels + modes)
    return f.text()


def _users(stats: Dict[str, Any]) -> Iterable[Dict[str, Any]]:
    """Per-uid budget use, when the broker reports it (``users``)."""
    users: Optional[Any] = stats.get("users")
    if isinstance(users, dict):     # keyed by uid
        return [{"uid": uid, **u} for uid, u in users.items()]
    return users or ()
