# The sbus wire protocol: packet parsing, routing-key matching and the rules
# for the reserved '!' byte. Every function here is pure C over byte ranges:
# no allocation, no Python objects, safe to call without the GIL.
from libc.stdint cimport int64_t


cdef enum Verb:
    VERB_INVALID = 0
    VERB_SUB = 1
    VERB_UNSUB = 2
    VERB_MSG = 3
    VERB_CMSG = 4


cdef struct ParsedPacket:
    int verb
    const char *key        # routing key or pattern, not NUL-terminated
    size_t key_len
    const char *payload    # after the first NUL; NULL when the packet has none
    size_t payload_len


# Outcome of checking a key or pattern against the '!' rules.
cdef enum KeyCheck:
    KEY_OK = 0
    KEY_BANG_MISUSE = 1     # '!' used as a reserved token outside a !/cred/ form
    KEY_CRED_MALFORMED = 2  # a !/cred/ form with a bad field or truncated


cdef enum:
    CRED_EMPTY = -1         # an empty credential field
    CRED_PREFIX_LEN = 7     # len("!/cred/")
    CRED_CANONICAL_MAX = 40  # "!/cred/" + three 10-digit fields and their '/'s


# Why a SUB/UNSUB pattern cannot be stored (normalise_pattern).
cpdef enum PatternRefusal:
    PATTERN_OK = 0
    PATTERN_CRED_MALFORMED = 1          # the !/cred/ prefix has a bad field or is truncated
    PATTERN_CRED_MISMATCH = 2           # the !/cred/ prefix names someone else
    PATTERN_NESTED_CRED_MALFORMED = 3   # a nested !/cred/ form after the prefix is malformed
    PATTERN_BANG_MISUSE = 4             # the reserved '!' outside a !/cred/ form
    PATTERN_TOO_LONG = 5                # the stored form does not fit the buffer


cdef struct CredForm:
    int64_t gid
    int64_t uid
    int64_t pid
    size_t prefix_len       # bytes of "!/cred/G/U/P/" consumed


cdef int parse_packet(const char *buf, size_t n, ParsedPacket *out) noexcept nogil
cdef bint pattern_matches(const char *pat, size_t plen,
                          const char *key, size_t klen) noexcept nogil
cdef size_t first_segment_len(const char *s, size_t n) noexcept nogil
cdef bint is_cred_key(const char *s, size_t n) noexcept nogil
cdef int parse_cred_form(const char *s, size_t n, bint allow_star,
                         CredForm *out) noexcept nogil
cdef size_t cred_canonical_prefix(const CredForm *form, char *out) noexcept nogil
cdef int check_rest(const char *s, size_t n, bint is_pattern) noexcept nogil
cdef PatternRefusal normalise_pattern(const char *pat, size_t n, int64_t gid, int64_t uid,
                                      int64_t pid, char *out, size_t cap,
                                      size_t *out_len) noexcept nogil
