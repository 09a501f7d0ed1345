# cython: language_level=3
"""Parsing and matching for the sbus protocol (see docs and the spec).

The ``def`` functions at the bottom expose the C functions to Python for tests,
benchmarks and fuzzing; the broker itself only uses the ``cdef`` ones.
"""
from libc.string cimport memchr, memcmp, memcpy
from libc.stdint cimport int64_t
from cpython.mem cimport PyMem_Malloc, PyMem_Free


cdef int parse_packet(const char *buf, size_t n, ParsedPacket *out) noexcept nogil:
    """Classify a packet; returns its verb (VERB_INVALID for anything else)."""
    cdef const char *nul
    cdef size_t skip
    out.verb = VERB_INVALID
    out.payload = NULL
    out.payload_len = 0
    if n >= 4 and memcmp(buf, b"MSG ", 4) == 0:
        out.verb = VERB_MSG
        skip = 4
    elif n >= 4 and memcmp(buf, b"SUB ", 4) == 0:
        out.verb = VERB_SUB
        skip = 4
    elif n >= 6 and memcmp(buf, b"UNSUB ", 6) == 0:
        out.verb = VERB_UNSUB
        skip = 6
    elif n >= 5 and memcmp(buf, b"CMSG ", 5) == 0:
        out.verb = VERB_CMSG
        skip = 5
    else:
        return VERB_INVALID
    out.key = buf + skip
    nul = <const char *>memchr(buf + skip, 0, n - skip)
    if nul == NULL:
        if out.verb == VERB_MSG:    # a MSG must separate key and payload
            out.verb = VERB_INVALID
            return VERB_INVALID
        out.key_len = n - skip
    else:
        out.key_len = <size_t>(nul - out.key)
        out.payload = nul + 1
        out.payload_len = n - skip - out.key_len - 1
    return out.verb


cdef bint pattern_matches(const char *pat, size_t plen,
                          const char *key, size_t klen) noexcept nogil:
    """The spec's matching: '*' greedily takes a run of non-'/' bytes (possibly
    empty, never backtracking); a final '/' matches a '/' and anything after
    it; the empty pattern matches every key."""
    cdef size_t i = 0, j = 0
    if plen == 0:
        return True
    while i < plen:
        if pat[i] == b'*':
            while j < klen and key[j] != b'/':
                j += 1
        elif pat[i] == b'/' and i + 1 == plen:
            return j < klen and key[j] == b'/'
        else:
            if j >= klen or key[j] != pat[i]:
                return False
            j += 1
        i += 1
    return j == klen


cdef size_t first_segment_len(const char *s, size_t n) noexcept nogil:
    cdef const char *slash = <const char *>memchr(s, b'/', n)
    return n if slash == NULL else <size_t>(slash - s)


cdef bint is_cred_key(const char *s, size_t n) noexcept nogil:
    return n >= CRED_PREFIX_LEN and memcmp(s, b"!/cred/", CRED_PREFIX_LEN) == 0


cdef int parse_cred_form(const char *s, size_t n, bint allow_star,
                         CredForm *out) noexcept nogil:
    """Parse ``!/cred/G/U/P/``: each field empty (CRED_EMPTY) or decimal digits
    up to 2**32-1 (leading zeros allowed), each followed by '/'. With
    allow_star, a field of exactly '*' is taken as CRED_EMPTY (only for nested
    forms in patterns). Returns 0, or -1 for a malformed or truncated form."""
    cdef size_t i = CRED_PREFIX_LEN
    cdef int64_t value
    cdef int field
    cdef int64_t fields[3]
    if not is_cred_key(s, n):
        return -1
    for field in range(3):
        if allow_star and i + 1 < n and s[i] == b'*' and s[i + 1] == b'/':
            fields[field] = CRED_EMPTY
            i += 2
            continue
        value = CRED_EMPTY
        while i < n and s[i] != b'/':
            if s[i] < b'0' or s[i] > b'9':
                return -1
            if value == CRED_EMPTY:
                value = 0
            value = value * 10 + (s[i] - 48)   # 48 == '0'
            if value > <int64_t>4294967295LL:
                return -1
            i += 1
        if i >= n:          # truncated: no '/' after the field
            return -1
        fields[field] = value
        i += 1
    out.gid = fields[0]
    out.uid = fields[1]
    out.pid = fields[2]
    out.prefix_len = i
    return 0


cdef size_t cred_canonical_prefix(const CredForm *form, char *out) noexcept nogil:
    """Write ``!/cred/G/U/P/`` without leading zeros (empty fields stay
    empty) to out, which holds at least CRED_CANONICAL_MAX bytes; returns
    its length."""
    cdef size_t n = CRED_PREFIX_LEN
    cdef int field, k
    cdef int64_t v
    cdef char digits[10]
    memcpy(out, b"!/cred/", CRED_PREFIX_LEN)
    for field in range(3):
        v = form.gid if field == 0 else form.uid if field == 1 else form.pid
        if v != CRED_EMPTY:
            k = 0
            while True:
                digits[k] = <char>(48 + v % 10)     # 48 == '0'
                k += 1
                v //= 10
                if v == 0:
                    break
            while k > 0:
                k -= 1
                out[n] = digits[k]
                n += 1
        out[n] = b'/'
        n += 1
    return n


cdef int check_rest(const char *s, size_t n, bint is_pattern) noexcept nogil:
    """Check the '!' rules on a key or pattern (or the rest after a !/cred/
    prefix). A '!' whose neighbours are only '/' or the ends is reserved: it
    may only begin a well-formed nested !/cred/ form at the start of ``s``."""
    cdef CredForm form
    cdef size_t i
    cdef bint left_reserved, right_reserved
    while is_cred_key(s, n):
        if parse_cred_form(s, n, is_pattern, &form) < 0:
            return KEY_CRED_MALFORMED
        s += form.prefix_len
        n -= form.prefix_len
    for i in range(n):
        if s[i] != b'!':
            continue
        left_reserved = i == 0 or s[i - 1] == b'/'
        right_reserved = i + 1 == n or s[i + 1] == b'/'
        if left_reserved and right_reserved:
            return KEY_BANG_MISUSE
    return KEY_OK


cdef PatternRefusal normalise_pattern(const char *pat, size_t n, int64_t gid, int64_t uid,
                                      int64_t pid, char *out, size_t cap,
                                      size_t *out_len) noexcept nogil:
    """Check a SUB/UNSUB pattern of the client gid/uid/pid and write its
    stored form to out (cap bytes), its length to out_len. A !/cred/ prefix
    may name only the client itself; its empty fields become the client's
    own credentials, and every number is written without leading zeros, so
    the stored form is the one publish matches (cred_canonical_prefix)."""
    cdef CredForm form
    cdef int check
    cdef const char *rest = pat
    cdef size_t rest_len = n
    cdef size_t plen = 0
    cdef char prefix[CRED_CANONICAL_MAX]
    if is_cred_key(pat, n):
        if parse_cred_form(pat, n, False, &form) < 0:
            return PATTERN_CRED_MALFORMED
        if ((form.gid != CRED_EMPTY and form.gid != gid) or
                (form.uid != CRED_EMPTY and form.uid != uid) or
                (form.pid != CRED_EMPTY and form.pid != pid)):
            return PATTERN_CRED_MISMATCH
        form.gid = gid
        form.uid = uid
        form.pid = pid
        plen = cred_canonical_prefix(&form, prefix)
        rest = pat + form.prefix_len
        rest_len = n - form.prefix_len
    check = check_rest(rest, rest_len, True)
    if check == KEY_BANG_MISUSE:
        return PATTERN_BANG_MISUSE
    if check != KEY_OK:
        return PATTERN_NESTED_CRED_MALFORMED
    if plen + rest_len > cap:
        return PATTERN_TOO_LONG
    memcpy(out, prefix, plen)
    memcpy(out + plen, rest, rest_len)
    out_len[0] = plen + rest_len
    return PATTERN_OK


# ---- Python-visible wrappers (tests, fuzzing, benchmarks) -------------------

_VERB_NAMES = {VERB_INVALID: None, VERB_SUB: "SUB", VERB_UNSUB: "UNSUB",
               VERB_MSG: "MSG", VERB_CMSG: "CMSG"}


def parse(bytes packet):
    """(verb or None, key, payload or None) for a packet, as the broker sees it."""
    cdef ParsedPacket p
    if parse_packet(packet, len(packet), &p) == VERB_INVALID:
        return (None, None, None)
    key = p.key[:p.key_len]
    payload = None if p.payload == NULL else p.payload[:p.payload_len]
    return (_VERB_NAMES[p.verb], key, payload)


def matches(bytes pattern, bytes key):
    """True if the routing-key pattern matches the routing key."""
    return pattern_matches(pattern, len(pattern), key, len(key))


def check_key(bytes key, bint is_pattern=False):
    """'ok', 'bang_misuse' or 'cred_malformed' for a key or pattern."""
    cdef CredForm form
    cdef const char *s = key
    cdef size_t n = len(key)
    cdef int r
    if is_cred_key(s, n):
        if parse_cred_form(s, n, False, &form) < 0:
            return "cred_malformed"
        s += form.prefix_len
        n -= form.prefix_len
    r = check_rest(s, n, is_pattern)
    return ("ok", "bang_misuse", "cred_malformed")[r]


def cred_form(bytes key):
    """(gid, uid, pid, prefix_len) of a !/cred/ key, None for empty fields;
    None if the key is not a well-formed !/cred/ form."""
    cdef CredForm form
    if parse_cred_form(key, len(key), False, &form) < 0:
        return None
    return tuple(None if v == CRED_EMPTY else v
                 for v in (form.gid, form.uid, form.pid)) + (form.prefix_len,)


def normalise(bytes pattern, int64_t gid, int64_t uid, int64_t pid, size_t cap=4096):
    """(PatternRefusal, stored form or None) of a pattern subscribed by the
    client gid/uid/pid, as the broker stores it (see normalise_pattern)."""
    cdef char *out = <char *>PyMem_Malloc(cap if cap else 1)
    cdef size_t n = 0
    cdef PatternRefusal r
    if out == NULL:
        raise MemoryError()
    try:
        r = normalise_pattern(pattern, len(pattern), gid, uid, pid, out, cap, &n)
        return PatternRefusal(r), (out[:n] if r == PATTERN_OK else None)
    finally:
        PyMem_Free(out)
