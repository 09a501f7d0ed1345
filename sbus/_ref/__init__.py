"""Plain-Python twins of the compiled protocol and pattern index, written straight
from the spec. The tests hold :mod:`sbus._core` to them (hypothesis compares the
two on random keys and patterns); nothing on the message path imports them.

- ``protocol``: keys, patterns, matching and the ``!/cred/`` forms.
- ``index``: the pattern index as a list scan.
"""
