// SPDX-License-Identifier: MIT OR Apache-2.0
/*
 * hvprobe-vecstate SECONDS: put a pattern in the upper half of YMM15 and spin in user
 * mode for SECONDS, checking it all the while; print "hvprobe-vecstate pid=PID
 * checks=N clobbered=M" and exit 1 if it ever changed. The guest kernel saves and
 * restores a task's vector registers across context switches, so another process
 * that runs on this CPU meanwhile (and uses AVX: glibc's string functions do, and
 * end with VZEROUPPER) must never show through. Prints "no-avx" and exits 0 when
 * user space cannot use AVX here (no OSXSAVE, or YMM state off in XCR0).
 */
#include <cpuid.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static int avx_usable(void)
{
	unsigned int a, b, c, d;
	uint32_t lo, hi;

	if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)) || !(c & (1u << 28)))
		return 0;
	__asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
	return (lo & 6) == 6;
}

static void set_pattern(uint64_t pattern)
{
	__asm__ volatile("vmovq %0, %%xmm15\n\t"
			 "vpunpcklqdq %%xmm15, %%xmm15, %%xmm15\n\t"
			 "vinsertf128 $1, %%xmm15, %%ymm15, %%ymm15"
			 : : "r"(pattern) : "xmm15");
}

int main(int argc, char **argv)
{
	long long limit_ns = (argc > 1 ? atoll(argv[1]) : 3) * 1000000000LL;
	uint64_t pattern = 0x5a5a000000000000ull ^ ((uint64_t)getpid() << 16) ^ 0x1234;
	struct timespec start, now;
	unsigned long checks = 0, clobbered = 0;

	if (!avx_usable()) {
		printf("hvprobe-vecstate pid=%d no-avx\n", (int)getpid());
		return 0;
	}
	/*
	 * ymm15 = the pattern in all four lanes. Built without -mavx, the C code never
	 * writes ymm15 (a VEX-encoded write to xmm15 would clear the upper half) and uses
	 * no floating point; only the asm here touches it.
	 */
	set_pattern(pattern);
	clock_gettime(CLOCK_MONOTONIC, &start);
	do {
		uint64_t upper[2];

		for (int i = 0; i < 100000; i++)
			__asm__ volatile("" ::: "memory");
		__asm__ volatile("vextractf128 $1, %%ymm15, %0" : "=m"(upper));
		checks++;
		if (upper[0] != pattern || upper[1] != pattern) {
			clobbered++;
			set_pattern(pattern); /* to count each clobbering once */
		}
		clock_gettime(CLOCK_MONOTONIC, &now);
	} while ((now.tv_sec - start.tv_sec) * 1000000000LL + (now.tv_nsec - start.tv_nsec) < limit_ns);
	printf("hvprobe-vecstate pid=%d checks=%lu clobbered=%lu\n", (int)getpid(), checks, clobbered);
	return clobbered != 0;
}
