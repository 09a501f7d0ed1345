"""The vocabulary of hostile input: tokens that matter to the parser, the
matcher and the '!' and !/cred/ rules. Shared by the property tests of the
compiled core and the hostile worker of the live fuzz."""
from __future__ import annotations

import random

from .conn import WHOAMI

# Keys and patterns the steady pair uses; hostile packets never carry them,
# so anything the steady subscriber receives must be the steady publisher's.
STEADY = b"steady"

BAD_CRED = [
    b"!/cred/", b"!/cred/1", b"!/cred/1/2", b"!/cred/1/2/3", b"!/cred/x/y/z/",
    b"!/cred/*/*/*/", b"!/cred/*/2/3/k", b"!/cred/+1/2/3/k", b"!/cred/ 1/2/3/k",
    b"!/cred/99999999999/0/0/k", b"!/cred/4294967296/0/0/", b"!/cred/whoami",
    b"!/cred/-1/0/0/k", b"!/cred/0x1/0/0/k", b"!/cred/1/2/3/!/cred/", b"!/cred/1/2/3/!/cred/1/2",
    b"!/cred/1/2/3/!", b"!/cred/1/2/3/!/x", b"!/cred////!/cred/*/*/", b"!/cred//////",
    b"!/cred/\xff/0/0/", b"!/cred/1\x002/3/4/",
]
CONTROLS = [
    b"CMSG blocking/soft/queue", b"CMSG blocking/soft/discard", b"CMSG blocking/soft/error",
    b"CMSG blocking/soft/block", b"CMSG blocking/hard/discard", b"CMSG blocking/hard/block",
    b"CMSG blocking/hard/error", b"CMSG order/queue", b"CMSG order/stack",
    b"CMSG order/random", b"CMSG echo/off", b"CMSG echo/on", b"CMSG stats", WHOAMI,
    b"CMSG blocking/soft/", b"CMSG blocking/", b"CMSG order/", b"CMSG ", b"CMSG \0",
    b"CMSG blocking/soft/queue\0tail\0more", b"CMSG !/cred/whoami\0x",
    b"CMSG !/cred/1/2/3/k\0x", b"CMSG stats/\0", b"CMSG echo", b"CMSG \xff\xfe",
]
VERBS = [b"SUB ", b"UNSUB ", b"MSG ", b"CMSG ", b"SUB", b"UNSUB", b"MSG", b"CMSG", b"sub ",
         b"msg ", b"PUB ", b"SUBSCRIBE ", b" SUB ", b"SUB\0", b"MSG\0", b"\0", b"S", b"UNSU",
         b"SUB  ", b"MSG\t", b"XMSG ", b"\xffSUB "]
ATOMS = [b"a", b"b", b"/", b"*", b"!", b"!/cred/", b"0", b"1", b"//", b"**", b"\xff", b" ",
         b"4294967295", b"4294967296", b"a*", b"*/", b"x!", b"!x", b"\n"]


def rand_key(rng: random.Random, maxlen=12) -> bytes:
    return b"".join(rng.choice(ATOMS) for _ in range(rng.randrange(maxlen + 1)))


def bang_everywhere(rng: random.Random) -> bytes:
    base = rng.choice([b"a/b/c", b"x", b"", b"/", b"aa/bb/", b"!/cred////k", b"*/*/"])
    pos = rng.randrange(len(base) + 1)
    return base[:pos] + b"!" + base[pos:]

