# Batched client I/O: packets packed into one C buffer and sent with one
# sendmmsg, packets taken with one recvmmsg and parsed into Message objects.
# Shared by sbus.client.sync (blocking) and sbus.client.aio; nothing here blocks the
# event loop unless the socket itself is blocking.
from .includes.sys cimport iovec, mmsghdr


cdef class Outbox:
    cdef char *buf              # packed packets, back to back
    cdef size_t cap             # bytes in buf
    cdef size_t used            # bytes packed so far
    cdef iovec *iov             # one per packed packet, pointing into buf
    cdef mmsghdr *hdrs
    cdef int slots              # entries in iov/hdrs
    cdef readonly int count     # packets packed
    cdef readonly int head      # packets already sent (the rest are still owed)
    cdef readonly size_t max_message
    cdef object held            # a (key, payload) that did not fit, packed first next time
    cdef readonly bint exhausted  # pack_many ran its iterator to the end
    # The last key published (a str or bytes) and its checked bytes: a batch
    # of one key is encoded and checked once, not per message.
    cdef object last_key
    cdef bytes last_key_bytes

    cpdef bint add_publish(self, object key, object payload) except -1
    cpdef bint add_packet(self, bytes packet) except -1
    cdef int pack_message(self, const char *key, size_t klen,
                          const char *payload, size_t plen) noexcept
    cdef int _append(self, const char *head, size_t hlen, const char *key, size_t klen,
                     const char *tail, size_t tlen) noexcept


cdef class Sink:
    # A C consumer of received messages (Inbox.receive): put() gets each
    # plain message's bytes in place, with no Python object made for it.
    cdef int put(self, const char *key, size_t klen,
                 const char *payload, size_t plen) except -1


cdef class Inbox:
    cdef char *area             # slots of max_message + 1 bytes, mapped lazily
    cdef size_t area_size
    cdef size_t slot_size
    cdef iovec *iov
    cdef mmsghdr *hdrs
    cdef readonly int slots
    cdef readonly size_t max_message
    cdef object message_type
    cdef object control_type
    cdef bytes last_key         # reused when the next message has the same key
    cdef readonly int irregular  # control messages and errors in the last batch
    cdef readonly int taken     # messages the last batch gave to its Sink
    cdef readonly int chunked   # chunks (sbus.client.chunks) in the last batch
    cdef public bint chunks     # count chunks as irregular (off: they are plain messages)
    cdef bint drained           # the last recvmmsg took fewer than it asked for
    cdef bytes routed_prefix    # keys routed apart (a client's reply inbox); b"": none
    cdef readonly int routed    # messages on routed_prefix in the last batch
    # take_batch(): the client's socket (-1: none), queue (a deque) and Outbox;
    # the batch it left to the client (held()), and its last deadline.
    cdef public int fd
    cdef public object queue
    cdef public Outbox outbox
    cdef object kept
    cdef readonly double deadline

    cdef object make(self, object cls, const char *key, size_t klen,
                     const char *payload, size_t plen)
    cdef void release(self, int i) noexcept
    cdef int wait(self, int fd, int limit, int flags, double timeout) except? -2
    cdef int read(self, int fd, int limit, int flags, double timeout) except? -2
    cpdef object take_batch(self, int limit, object timeout, int flags)
    cdef list parse(self, int n, Sink sink)


cdef class Messages:
    cdef object queue
    cdef object popleft         # queue.popleft, bound once
    cdef object refill          # reads one batch into the queue; False at the end


cdef class AsyncMessages:
    cdef object queue
    cdef object popleft         # queue.popleft, bound once
    cdef object message_type
    cdef object slow            # the coroutine function for everything but a queued message
    cdef object value           # the message the pending awaitable returns

    cdef object ready(self)
