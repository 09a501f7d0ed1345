# Extern declarations of the Linux socket, epoll and select APIs the core uses.
# Only the fields and constants we touch are listed. Python.h defines
# _GNU_SOURCE, which recvmmsg, sendmmsg, accept4 and struct ucred need.
from libc.stdint cimport uint32_t, uint64_t


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len


cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t

    struct sockaddr:
        pass

    struct msghdr:
        void *msg_name
        socklen_t msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags

    struct mmsghdr:
        msghdr msg_hdr
        unsigned int msg_len

    struct ucred:
        int pid
        unsigned int uid
        unsigned int gid

    enum:
        SOL_SOCKET
        SO_PEERCRED
        SO_SNDBUF
        SO_SNDBUFFORCE
        SO_RCVBUF
        SO_RCVBUFFORCE
        SO_ACCEPTCONN
        MSG_DONTWAIT
        MSG_NOSIGNAL
        MSG_TRUNC
        MSG_PEEK
        SOCK_NONBLOCK
        SOCK_CLOEXEC

    int accept4(int fd, sockaddr *addr, socklen_t *addrlen, int flags)
    int getsockopt(int fd, int level, int name, void *val, socklen_t *len)
    int setsockopt(int fd, int level, int name, const void *val, socklen_t len)
    ssize_t send(int fd, const void *buf, size_t n, int flags)
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    int recvmmsg(int fd, mmsghdr *vec, unsigned int vlen, int flags, void *timeout)
    int sendmmsg(int fd, mmsghdr *vec, unsigned int vlen, int flags)


cdef extern from "<sys/epoll.h>" nogil:
    union epoll_data:
        void *ptr
        int fd
        uint32_t u32
        uint64_t u64

    struct epoll_event:
        uint32_t events
        epoll_data data

    enum:
        EPOLLIN
        EPOLLOUT
        EPOLLERR
        EPOLLHUP
        EPOLLRDHUP
        EPOLL_CLOEXEC
        EPOLL_CTL_ADD
        EPOLL_CTL_MOD
        EPOLL_CTL_DEL

    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event *event)
    int epoll_wait(int epfd, epoll_event *events, int maxevents, int timeout)


cdef extern from "<sys/select.h>" nogil:
    ctypedef struct fd_set:
        pass

    struct timeval:
        long tv_sec
        long tv_usec

    enum:
        FD_SETSIZE

    void FD_ZERO(fd_set *s)
    void FD_SET(int fd, fd_set *s)
    int FD_ISSET(int fd, fd_set *s)
    int select(int nfds, fd_set *r, fd_set *w, fd_set *e, timeval *timeout)


cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec

    enum:
        CLOCK_MONOTONIC

    int clock_gettime(int clk, timespec *ts)


cdef inline double monotonic() noexcept nogil:
    """time.monotonic()'s clock, in seconds."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef extern from "<malloc.h>" nogil:
    int malloc_trim(size_t pad)


cdef extern from "<sys/mman.h>" nogil:
    enum:
        PROT_READ
        PROT_WRITE
        MAP_PRIVATE
        MAP_ANONYMOUS
        MAP_NORESERVE
        MADV_DONTNEED
    void *MAP_FAILED
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int madvise(void *addr, size_t length, int advice)


cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents

    enum:
        POLLIN

    int poll(pollfd *fds, unsigned long nfds, int timeout)
