// SPDX-License-Identifier: MIT OR Apache-2.0
// hvprobe-cflags: -static -Os
/*
 * hvprobe-spin SECONDS: print "hvprobe-spin pid=PID" and spin in user mode for
 * SECONDS, making no system calls meanwhile (the clock comes from the vDSO).
 * While it spins it is the current task of its CPU: host-side introspection
 * can check the comm and pid it reads from guest memory against the printed ones.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? atof(argv[1]) : 5.0;
	struct timespec start, now;
	volatile unsigned long spins = 0;

	printf("hvprobe-spin pid=%d\n", (int)getpid());
	fflush(stdout);
	clock_gettime(CLOCK_MONOTONIC, &start);
	do {
		for (int i = 0; i < 1000000; i++)
			spins++;
		clock_gettime(CLOCK_MONOTONIC, &now);
	} while ((now.tv_sec - start.tv_sec) + (now.tv_nsec - start.tv_nsec) / 1e9 < seconds);
	printf("hvprobe-spin done\n");
	return 0;
}
