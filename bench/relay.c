/*
 * relay: the raw-relay baseline.  The least a broker on SOCK_SEQPACKET can
 * do: epoll, recvmmsg of up to BATCH packets per client per turn, and
 * sendmmsg of each batch to every client holding a pattern whose first
 * segment equals the key's first segment.  No wildcards, no flood control:
 * sends block, so one client that stops reading stalls everyone.  It is a
 * ceiling to measure sbusd against, not a broker.
 *
 *   relay -a PATH
 *
 * Readiness follows sbusd: stdout is closed once the socket listens.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

enum {
	BATCH = 32,
	MAX_PACKET = 1 << 16,
	BUCKETS = 1 << 16,
	EVENTS = 256,
};

/* Clients subscribed to one first segment, each with its pattern count. */
struct segment {
	struct segment *next;
	int n, cap;
	int *fds;
	int *counts;
	size_t len;
	char name[];
};

struct client {
	int fd;
	int npats, cap;
	char **pats;
	int npending;
	uint8_t pending[BATCH];	/* indices into the current batch, in order */
	int dead;
};

static struct segment *buckets[BUCKETS];
static struct client **clients;	/* indexed by fd */
static int max_fds;
static const char *path;

static char bufs[BATCH][MAX_PACKET + 1];
static struct iovec iov[BATCH];
static struct mmsghdr in[BATCH];
static struct mmsghdr out[BATCH];
static int *touched, ntouched;	/* targets with packets pending; max_fds long */

static void
die(const char *msg)
{
	fprintf(stderr, "relay: %s: %s\n", msg, strerror(errno));
	exit(1);
}

static void
on_term(int sig)
{
	(void)sig;
	unlink(path);
	_exit(0);
}

static uint32_t
hash(const char *s, size_t n)
{
	uint32_t h = 2166136261u;
	for (size_t i = 0; i < n; i++)
		h = (h ^ (uint8_t)s[i]) * 16777619u;
	return h;
}

static size_t
first_segment(const char *s, size_t n)
{
	const char *slash = memchr(s, '/', n);
	return slash ? (size_t)(slash - s) : n;
}

static struct segment *
lookup(const char *name, size_t len, int create)
{
	struct segment **b = &buckets[hash(name, len) & (BUCKETS - 1)];
	for (struct segment *s = *b; s; s = s->next)
		if (s->len == len && !memcmp(s->name, name, len))
			return s;
	if (!create)
		return NULL;
	struct segment *s = calloc(1, sizeof(*s) + len);
	if (!s)
		die("calloc");
	memcpy(s->name, name, len);
	s->len = len;
	s->next = *b;
	*b = s;
	return s;
}

static void
index_add(const char *pat, size_t n, int fd)
{
	struct segment *s = lookup(pat, first_segment(pat, n), 1);
	for (int i = 0; i < s->n; i++)
		if (s->fds[i] == fd) {
			s->counts[i]++;
			return;
		}
	if (s->n == s->cap) {
		s->cap = s->cap ? 2 * s->cap : 4;
		s->fds = realloc(s->fds, s->cap * sizeof(int));
		s->counts = realloc(s->counts, s->cap * sizeof(int));
		if (!s->fds || !s->counts)
			die("realloc");
	}
	s->fds[s->n] = fd;
	s->counts[s->n++] = 1;
}

static void
index_remove(const char *pat, size_t n, int fd)
{
	struct segment *s = lookup(pat, first_segment(pat, n), 0);
	if (!s)
		return;
	for (int i = 0; i < s->n; i++)
		if (s->fds[i] == fd) {
			if (--s->counts[i] == 0) {
				s->fds[i] = s->fds[--s->n];
				s->counts[i] = s->counts[s->n];
			}
			return;
		}
}

static void
subscribe(struct client *c, const char *pat, size_t n)
{
	if (c->npats == c->cap) {
		c->cap = c->cap ? 2 * c->cap : 4;
		c->pats = realloc(c->pats, c->cap * sizeof(char *));
		if (!c->pats)
			die("realloc");
	}
	char *p = strndup(pat, n);
	if (!p)
		die("strndup");
	c->pats[c->npats++] = p;
	index_add(pat, n, c->fd);
}

static void
unsubscribe(struct client *c, const char *pat, size_t n)
{
	for (int i = 0; i < c->npats; i++)
		if (strlen(c->pats[i]) == n && !memcmp(c->pats[i], pat, n)) {
			index_remove(pat, n, c->fd);
			free(c->pats[i]);
			c->pats[i] = c->pats[--c->npats];
			return;
		}
}

static void
drop(struct client *c)
{
	for (int i = 0; i < c->npats; i++) {
		index_remove(c->pats[i], strlen(c->pats[i]), c->fd);
		free(c->pats[i]);
	}
	free(c->pats);
	clients[c->fd] = NULL;
	close(c->fd);
	free(c);
}

static void
accept_all(int lfd, int ep)
{
	for (;;) {
		int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED)
				return;
			if (errno == EMFILE || errno == ENFILE)
				return;
			die("accept4");
		}
		if (fd >= max_fds) {
			close(fd);
			continue;
		}
		struct client *c = calloc(1, sizeof(*c));
		if (!c)
			die("calloc");
		c->fd = fd;
		clients[fd] = c;
		struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
		if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev))
			die("epoll_ctl");
	}
}

/* Blocking sendmmsg of this batch's packets for one target, in order. */
static void
flush(struct client *t)
{
	for (int i = 0; i < t->npending; i++) {
		out[i].msg_hdr.msg_iov = &iov[t->pending[i]];
		out[i].msg_hdr.msg_iovlen = 1;
	}
	int done = 0;
	while (done < t->npending) {
		int r = sendmmsg(t->fd, out + done, t->npending - done, 0);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			t->dead = 1;
			break;
		}
		done += r;
	}
	t->npending = 0;
}

static void
serve(struct client *c)
{
	for (int i = 0; i < BATCH; i++)
		iov[i].iov_len = MAX_PACKET + 1;
	int n = recvmmsg(c->fd, in, BATCH, MSG_DONTWAIT, NULL);
	if (n < 0) {
		if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
			return;
		c->dead = 1;
		n = 0;
	}
	ntouched = 0;
	for (int i = 0; i < n; i++) {
		const char *p = bufs[i];
		size_t len = in[i].msg_len;
		iov[i].iov_len = len;
		if (len == 0) {
			c->dead = 1;
			break;
		}
		if (len > MAX_PACKET)
			continue;
		if (len > 4 && !memcmp(p, "MSG ", 4)) {
			const char *key = p + 4;
			const char *nul = memchr(key, '\0', len - 4);
			if (!nul)
				continue;
			struct segment *s = lookup(key, first_segment(key, nul - key), 0);
			for (int j = 0; s && j < s->n; j++) {
				struct client *t = clients[s->fds[j]];
				if (t->npending == 0)
					touched[ntouched++] = t->fd;
				t->pending[t->npending++] = (uint8_t)i;
			}
		} else if (len >= 4 && !memcmp(p, "SUB ", 4)) {
			const char *nul = memchr(p + 4, '\0', len - 4);
			subscribe(c, p + 4, nul ? (size_t)(nul - p - 4) : len - 4);
		} else if (len >= 6 && !memcmp(p, "UNSUB ", 6)) {
			const char *nul = memchr(p + 6, '\0', len - 6);
			unsubscribe(c, p + 6, nul ? (size_t)(nul - p - 6) : len - 6);
		}
		/* CMSG and anything else: ignored. */
	}
	for (int i = 0; i < ntouched; i++)
		flush(clients[touched[i]]);
	for (int i = 0; i < ntouched; i++)
		if (clients[touched[i]]->dead && clients[touched[i]] != c)
			drop(clients[touched[i]]);
	if (c->dead)
		drop(c);
}

int
main(int argc, char **argv)
{
	int opt;
	while ((opt = getopt(argc, argv, "a:f")) != -1) {
		if (opt == 'a')
			path = optarg;
		else if (opt != 'f') {
			fprintf(stderr, "usage: relay -a PATH\n");
			return 2;
		}
	}
	if (!path) {
		fprintf(stderr, "usage: relay -a PATH\n");
		return 2;
	}
	signal(SIGPIPE, SIG_IGN);
	signal(SIGTERM, on_term);
	signal(SIGINT, on_term);

	struct rlimit rl;
	getrlimit(RLIMIT_NOFILE, &rl);
	rl.rlim_cur = rl.rlim_max;
	setrlimit(RLIMIT_NOFILE, &rl);
	max_fds = (int)rl.rlim_cur;
	clients = calloc(max_fds, sizeof(*clients));
	touched = calloc(max_fds, sizeof(*touched));
	if (!clients || !touched)
		die("calloc");

	for (int i = 0; i < BATCH; i++) {
		iov[i].iov_base = bufs[i];
		in[i].msg_hdr.msg_iov = &iov[i];
		in[i].msg_hdr.msg_iovlen = 1;
	}

	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof(sa.sun_path)) {
		fprintf(stderr, "relay: address too long\n");
		return 2;
	}
	strcpy(sa.sun_path, path);
	int lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (lfd < 0)
		die("socket");
	unlink(path);
	if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)))
		die("bind");
	if (listen(lfd, 4096))
		die("listen");
	int ep = epoll_create1(EPOLL_CLOEXEC);
	struct epoll_event ev = {.events = EPOLLIN, .data.fd = lfd};
	if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev))
		die("epoll");

	int null = open("/dev/null", O_WRONLY);
	if (null < 0 || dup2(null, STDOUT_FILENO) < 0)
		die("/dev/null");
	close(null);

	struct epoll_event evs[EVENTS];
	for (;;) {
		int n = epoll_wait(ep, evs, EVENTS, -1);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			die("epoll_wait");
		}
		for (int i = 0; i < n; i++) {
			int fd = evs[i].data.fd;
			if (fd == lfd)
				accept_all(lfd, ep);
			else if (clients[fd])
				serve(clients[fd]);
		}
	}
}
