"""Who may publish and subscribe to what on a shared bus: the access policy
(docs/policy.md).

- ``model``: the TOML policy file, read and validated (``load``, ``parse``);
  errors carry file, line and reason (``PolicyError``).
- ``keysets``: patterns as sets of keys, compared (the subscribe check).
- ``compiled``: one client's compiled policy (``Policy.compile_for``), with
  the flat table the C core reads.

Not yet enforced by sbusd: this package is the model, the checks and the
compiled form the broker core will consult.
"""
from .compiled import Access, Decision
from .model import DISCONNECT, DROP, PUBLISH, SUBSCRIBE, Policy, PolicyError, Rule, load, parse

__all__ = ["Access", "Decision", "DISCONNECT", "DROP", "PUBLISH", "SUBSCRIBE", "Policy",
           "PolicyError", "Rule", "load", "parse"]
