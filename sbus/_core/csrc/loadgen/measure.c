/* Clocks, CPU time, the futex the publishers sleep on, the flow-control
 * progress of the subscribers, and the JSON figures every mode prints. */
#include "loadgen.h"

double
now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

long
futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *timeout)
{
	return syscall(SYS_futex, (uint32_t *)addr, op, val, timeout, NULL, 0);
}

uint64_t
mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* CPU time of every thread of the server, in seconds, or -1.  schedstat is in
 * nanoseconds, far finer than the clock ticks of /proc/PID/stat. */
double
server_cpu(void)
{
	char path[64], line[256];
	double total = 0;
	int found = 0;
	if (!server_pid)
		return -1;
	snprintf(path, sizeof(path), "/proc/%ld/task", server_pid);
	DIR *d = opendir(path);
	if (!d)
		return -1;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (e->d_name[0] == '.')
			continue;
		char p[384];
		snprintf(p, sizeof(p), "%s/%s/schedstat", path, e->d_name);
		FILE *f = fopen(p, "r");
		if (!f)
			continue;
		unsigned long long ns;
		if (fgets(line, sizeof(line), f) && sscanf(line, "%llu", &ns) == 1) {
			total += ns * 1e-9;
			found = 1;
		}
		fclose(f);
	}
	closedir(d);
	return found ? total : -1;
}

double
own_cpu(void)
{
	struct rusage self, kids;
	getrusage(RUSAGE_SELF, &self);
	getrusage(RUSAGE_CHILDREN, &kids);
	return self.ru_utime.tv_sec + self.ru_utime.tv_usec * 1e-6 + self.ru_stime.tv_sec +
	       self.ru_stime.tv_usec * 1e-6 + kids.ru_utime.tv_sec + kids.ru_utime.tv_usec * 1e-6 +
	       kids.ru_stime.tv_sec + kids.ru_stime.tv_usec * 1e-6;
}

uint64_t
min_progress(void)
{
	uint64_t lo = UINT64_MAX;
	for (int i = 0; i < n_subs; i++) {
		uint64_t v = atomic_load_explicit(&sh->sub[i].next, memory_order_acquire);
		if (v < lo)
			lo = v;
	}
	return lo;
}

void
print_common(const char *mode, double seconds, double cpu)
{
	printf("{\"mode\":\"%s\",\"payload\":%zu,\"seconds\":%.6f,\"server_cpu\":%.6f,"
	       "\"loadgen_cpu\":%.6f",
	       mode, payload_size, seconds, cpu, own_cpu());
}

static int
cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* Ends the JSON line print_common began: round-trip count and percentiles. */
void
print_percentiles(double *rtt, size_t n)
{
	qsort(rtt, n, sizeof(double), cmp_double);
	double sum = 0;
	for (size_t i = 0; i < n; i++)
		sum += rtt[i];
#define PCT(p) (n ? rtt[(size_t)((p) / 100.0 * (n - 1) + 0.5)] : 0)
	printf(",\"round_trips\":%zu,\"mean_us\":%.2f,\"p50_us\":%.2f,\"p90_us\":%.2f,"
	       "\"p99_us\":%.2f,\"p999_us\":%.2f,\"max_us\":%.2f}\n",
	       n, n ? sum / n : 0, PCT(50), PCT(90), PCT(99), PCT(99.9), n ? rtt[n - 1] : 0);
#undef PCT
	fflush(stdout);
}
