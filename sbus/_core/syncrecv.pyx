# The blocking client's receive_many (sbus.client.sync.Client) as a C
# function bound as its method: the usual call (Inbox.take_batch: nothing queued,
# a batch of plain messages) runs without a Python frame, which was a third
# of what a call finding one message cost; anything else is the client's
# own _receive_many.
from .batch cimport Inbox


def receive_many(self, max=64, *, timeout=None, flags=0):
    """Up to ``max`` messages: the queued ones, else what one recvmmsg(2)
    takes (waiting for the first). A bad packet ends the list; its error
    is raised by the next call. ``flags`` as for recv(2), but no MSG_PEEK."""
    cdef Inbox box = self._in
    try:
        batch = box.take_batch(max, timeout, flags)
    except OSError as exc:
        batch = self._failed(exc)
    if batch:
        return batch
    return self._receive_many(max, timeout, flags)
