"""Who may publish and subscribe to what on a shared bus: the access policy
(docs/policy.md).

- ``model``: the TOML policy file, read and validated (``load``, ``parse``);
  errors carry file, line and reason (``PolicyError``).
- ``keysets``: patterns as sets of keys, compared (the subscribe check).
- ``compiled``: one client's compiled policy (``Policy.compile_for``), with
  the flat table the C core reads.
- ``askers``: the policy in a service (``sbus store``, ``sbus queue``):
  whether the clients a reply key names may read a pattern.

``sbusd --policy FILE`` enforces it: the broker core copies each identity's
compiled publish table into C (``sbus._core.acl``) and asks ``may_subscribe``
at SUB time; ``sbus.sbusd.reload`` loads and reloads the file.
"""
from .compiled import Access, Decision
from .model import DISCONNECT, DROP, PUBLISH, SUBSCRIBE, Policy, PolicyError, Rule, load, parse

__all__ = ["Access", "Decision", "DISCONNECT", "DROP", "PUBLISH", "SUBSCRIBE", "Policy",
           "PolicyError", "Rule", "load", "parse"]
