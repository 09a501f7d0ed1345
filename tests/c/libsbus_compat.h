/* A small, header-only client library with the shape of the original C
 * libsbus API, written for sbus's interoperability tests.
 *
 * Each call builds one protocol packet in the caller's buffer and sends it
 * with a single send(2), or receives one packet with a single recv(2), so
 * that every send(2)/recv(2) flag (MSG_DONTWAIT, ...) passes straight
 * through, as it did with the original library:
 *
 *   libsbus_subscribe(fd, pattern, flags, buf)     sends "SUB pattern"
 *   libsbus_unsubscribe(fd, pattern, flags, buf)   sends "UNSUB pattern"
 *   libsbus_publish(fd, key, msg, n, flags, buf)   sends "MSG key\0msg"
 *   libsbus_receive(fd, flags, buf, &packet)       receives one packet
 *
 * `buf` must hold LIBSBUS_BUFFER_SIZE bytes. On failure the functions
 * return -1 with errno set, like the system calls they wrap.
 */
#ifndef LIBSBUS_COMPAT_H
#define LIBSBUS_COMPAT_H

#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

/* The largest packet sbusd accepts by default (--max-message). */
#define LIBSBUS_BUFFER_SIZE 409600

enum libsbus_packet_type {
	LIBSBUS_UNRECOGNISED,     /* not a packet a client should receive */
	LIBSBUS_MESSAGE,          /* "MSG key\0payload" */
	LIBSBUS_CONTROL_MESSAGE   /* "CMSG key[\0payload]" */
};

struct libsbus_unrecognised {
	enum libsbus_packet_type type;
	const char *packet;       /* points into the receive buffer */
	size_t n;
};

struct libsbus_message {
	enum libsbus_packet_type type;
	const char *key;          /* NUL-terminated, points into the buffer */
	const char *msg;          /* the payload, points into the buffer */
	size_t n;                 /* payload length in bytes */
};

union libsbus_packet {
	enum libsbus_packet_type type;
	struct libsbus_unrecognised unrecognised;
	struct libsbus_message message;   /* for both MSG and CMSG */
};

/* Send "<verb> <text>" (without a trailing NUL) as one packet. */
static inline int
libsbus_send_verb_(int fd, const char *verb, const char *text, int flags, char *buf)
{
	size_t vlen = strlen(verb), tlen = strlen(text);
	ssize_t r;
	if (vlen + 1 + tlen > LIBSBUS_BUFFER_SIZE) {
		errno = EMSGSIZE;
		return -1;
	}
	memcpy(buf, verb, vlen);
	buf[vlen] = ' ';
	memcpy(&buf[vlen + 1], text, tlen);
	r = send(fd, buf, vlen + 1 + tlen, flags);
	return r < 0 ? -1 : 0;
}

static inline int
libsbus_subscribe(int fd, const char *pattern, int flags, char *buf)
{
	return libsbus_send_verb_(fd, "SUB", pattern, flags, buf);
}

static inline int
libsbus_unsubscribe(int fd, const char *pattern, int flags, char *buf)
{
	return libsbus_send_verb_(fd, "UNSUB", pattern, flags, buf);
}

static inline int
libsbus_publish(int fd, const char *key, const char *msg, size_t n, int flags, char *buf)
{
	size_t klen = strlen(key);
	size_t len = sizeof("MSG ") - 1 + klen + 1 + n;
	ssize_t r;
	if (len > LIBSBUS_BUFFER_SIZE || len < n) {
		errno = EMSGSIZE;
		return -1;
	}
	memcpy(buf, "MSG ", 4);
	memcpy(&buf[4], key, klen);
	buf[4 + klen] = '\0';
	memcpy(&buf[4 + klen + 1], msg, n);
	r = send(fd, buf, len, flags);
	return r < 0 ? -1 : 0;
}

/* Receive one packet into buf and describe it in *packetp. The key and the
 * payload are NUL-terminated in buf (one byte is kept spare for that). */
static inline ssize_t
libsbus_receive(int fd, int flags, char *buf, union libsbus_packet *packetp)
{
	ssize_t r = recv(fd, buf, LIBSBUS_BUFFER_SIZE - 1, flags);
	size_t n, skip = 0, klen;
	if (r < 0)
		return -1;
	if (r == 0) {
		errno = ECONNRESET;   /* the broker closed the connection */
		return -1;
	}
	n = (size_t)r;
	buf[n] = '\0';
	packetp->type = LIBSBUS_UNRECOGNISED;
	packetp->unrecognised.packet = buf;
	packetp->unrecognised.n = n;
	if (n >= 4 && !memcmp(buf, "MSG ", 4))
		skip = 4;
	else if (n >= 5 && !memcmp(buf, "CMSG ", 5))
		skip = 5;
	if (!skip)
		return r;
	klen = strnlen(&buf[skip], n - skip);
	if (skip + klen == n) {
		if (skip == 4)
			return r;     /* a MSG must have the NUL separator */
		packetp->message.msg = &buf[n];   /* CMSG without payload */
		packetp->message.n = 0;
	} else {
		packetp->message.msg = &buf[skip + klen + 1];
		packetp->message.n = n - (skip + klen + 1);
	}
	packetp->message.type = skip == 4 ? LIBSBUS_MESSAGE : LIBSBUS_CONTROL_MESSAGE;
	packetp->message.key = &buf[skip];
	return r;
}

#endif
