/* Runs a command where io_uring is refused, as container seccomp profiles
 * refuse it:
 *
 *   no_io_uring ERRNO COMMAND [ARG...]
 *
 * installs a seccomp filter under which io_uring_setup, io_uring_enter and
 * io_uring_register fail with ERRNO (a number: 38 ENOSYS as on a kernel
 * without io_uring, 1 EPERM as with kernel.io_uring_disabled), then execs
 * COMMAND.  Everything else is allowed.  Exits 111 if the filter cannot be
 * installed, 127 if COMMAND cannot be run.
 */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#define __NR_io_uring_enter 426
#define __NR_io_uring_register 427
#endif

int
main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: no_io_uring ERRNO COMMAND [ARG...]\n");
		return 2;
	}
	unsigned err = (unsigned)atoi(argv[1]) & SECCOMP_RET_DATA;
	struct sock_filter filter[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 3, 0),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_enter, 2, 0),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_register, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | err),
	};
	struct sock_fprog prog = {sizeof(filter) / sizeof(filter[0]), filter};
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) ||
	    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
		perror("no_io_uring: seccomp");
		return 111;
	}
	execvp(argv[2], argv + 2);
	perror("no_io_uring: exec");
	return 127;
}
