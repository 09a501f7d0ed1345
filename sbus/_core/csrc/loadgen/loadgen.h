/*
 * The load generator's contract between its files (see main.c for what it
 * does): the options every mode reads, the memory its processes share, the
 * helpers for talking to the broker (connect.c) and for timing and
 * reporting (measure.c), the publisher and subscriber loops flood and
 * manypubs share (publish.c, subscribe.c), and one entry point per mode
 * (flood.c, manypubs.c, roundtrip.c for latency and wake, hold.c).
 */
#ifndef SBUS_LOADGEN_H
#define SBUS_LOADGEN_H

#ifndef _GNU_SOURCE	/* Python.h defines it when this is built into the package */
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <sched.h>
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum {
	BATCH = 64,
	MAX_SUBS = 512,
	MAX_PUBS = 4096,
	MAX_PUB_PROCS = 64,
	PUB_HEADER = 20,	/* manypubs payload: seq (8), publisher (4), sent at ns (8) */
	LAT_SAMPLES = 1 << 22,
	SYNC_WAVE = 100,
	SEQ_BYTES = 8,
};

static const char BENCH_KEY[] = "bench/k";
static const char PING_KEY[] = "ping/lat";
static const char PONG_KEY[] = "pong/lat";

struct sub_slot {
	_Atomic uint64_t next;	/* next sequence number expected: flow-control progress */
	uint64_t received, lost, reordered, bad;
	uint64_t tail;		/* of lost: never arrived within a second of the end */
	double t_last;		/* CLOCK_MONOTONIC seconds of the last receipt */
	int eof, finished;
	double p50_us, p99_us, max_us;	/* manypubs: publish-to-delivery latency */
} __attribute__((aligned(64)));

struct shared {
	_Atomic uint64_t sent;
	_Atomic uint64_t total;
	_Atomic int done;	/* total is final */
	_Atomic int finish;	/* everyone may exit now */
	_Atomic int ready;
	_Atomic uint32_t pub_waiting __attribute__((aligned(64)));
	_Atomic uint32_t wake;
	_Atomic int go;		/* manypubs: every client is connected; publishers start */
	_Atomic int stalled;
	double t0;		/* manypubs: when go was given */
	struct sub_slot sub[MAX_SUBS];
	uint64_t pub_sent[MAX_PUBS];	/* manypubs: messages each publisher sent, final at done */
};

/* Built into an extension module, these names must not reach the symbol
 * table of the process: nothing outside the generator calls them. */
#pragma GCC visibility push(hidden)

/* Set once by loadgen_main from the command line (main.c). */
extern const char *address;
extern size_t payload_size;
extern int n_pubs, n_pub_procs;
extern double offered_rate;	/* manypubs -r: messages/s over all publishers; 0: saturation */
extern int n_subs, n_idle, n_pats, n_slow, n_clients, wild_idle;
extern double duration;
extern uint64_t max_count;	/* -m: 0 means no limit */
extern uint64_t window;
extern long server_pid;
extern int echo_cpu;
/* Mapped before any fork, so every process of a run sees the same one. */
extern struct shared *sh;

/* Prints to stderr (with errno's text when fmt ends in ':'), tells the other
 * processes to finish and exits 1. */
void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

/* connect.c */
void set_timeout(int fd, double seconds);
int connect_bus(void);
void send_packet(int fd, const void *buf, size_t len);
void send_cmd(int fd, const char *verb, const char *arg);
void sync_clients(const int *fds, int n, int tag_base);
void raise_fd_limit(long need);
size_t build_packet(char *buf, const char *key);
int *hold_idle_clients(int n, int pats);

/* measure.c */
double now(void);
uint64_t mono_ns(void);
long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *timeout);
double server_cpu(void);
double own_cpu(void);
uint64_t min_progress(void);
void print_common(const char *mode, double seconds, double cpu);
void print_percentiles(double *rtt, size_t n);

/* publish.c: how one publisher process paces its messages. */
struct pacing {
	double t0, deadline;	/* the run's start and end (now() seconds) */
	double rate;		/* messages/s this process offers; 0: the window paces */
	uint64_t quota;		/* messages this process sends at most */
	uint64_t need;		/* window pacing: room awaited before a chunk is sent */
	uint64_t most;		/* window pacing: messages in one chunk at most */
};

/* Sends chunks of messages through send(ctx, n) as p paces them, counting
 * them in sh->sent first, until the deadline, the quota or a stall (then
 * sh->stalled is set); the messages sent. waits: the times it slept on the
 * window. */
uint64_t publish(const struct pacing *p, void (*send)(void *ctx, uint64_t n), void *ctx,
		 uint64_t *waits);

/* subscribe.c: one subscriber process. The mode embeds a receiver first in
 * its own struct, and counts what arrives in take and tail. */
struct receiver {
	struct sub_slot *slot;
	uint64_t progress;	/* messages accounted for: what the window sees */
	int timed;		/* take is given the batch's time of receipt (mono_ns) */
	/* One packet as the publishers send it: its payload. */
	void (*take)(struct receiver *r, const char *payload, uint64_t t_ns);
	/* Everything was sent, and what is missing never came. */
	void (*tail)(struct receiver *r);
};

/* Receives on fd until everything sent arrived, the tail is given up on or
 * the run finishes (EOF: slot->eof). */
void receive(int fd, struct receiver *r);
/* The subscriber is finished: it holds no publisher back; exits. */
void leave(struct sub_slot *slot) __attribute__((noreturn));

/* How a run of flood or manypubs ended: what the subscribers counted,
 * together (latencies are the worst one's), and what it cost the broker. */
struct sub_totals {
	double seconds;		/* from t0 to the last receipt */
	double cpu;		/* the broker's CPU seconds until the subscribers left; -1: unknown */
	uint64_t received, lost, reordered, bad, tail;
	int eof, unfinished;
	double p50_us, p99_us, max_us;
};

/* Waits for the n processes in pids to exit. */
void reap(const pid_t *pids, int n);
/* Ends a run whose publishers sent `sent` messages from t0 on, with the
 * broker at cpu0 CPU seconds then: tells the n_subs subscribers in subs the
 * total, waits for them to leave, tells every other process to finish, and
 * sums the run into out. */
void finish_run(uint64_t sent, const pid_t *subs, double t0, double cpu0, struct sub_totals *out);

/* The modes: each returns the process's exit status. */
int flood(void);
int manypubs(void);
int latency(void);
int wake(void);
int hold(void);
int loadgen_main(int argc, char **argv);

#pragma GCC visibility pop

#endif
