// SPDX-License-Identifier: MIT OR Apache-2.0
// hvprobe-cflags: -static -O2 -ffixed-xmm15
/*
 * hvprobe-vecstate SECONDS: put a pattern in a vector register and spin in user mode for
 * SECONDS, checking it all the while; print "hvprobe-vecstate pid=PID regs=R
 * cpuid-avx=A checks=N clobbered=M" and exit 1 if it ever changed. The guest kernel
 * saves and restores a task's vector registers across context switches, so another
 * process that runs on this CPU meanwhile (glibc's string functions use YMM registers
 * and end with VZEROUPPER) must never show through.
 *
 * R is the widest register the CPU lets this process use, whatever CPUID says:
 * "ymm" (the upper half of YMM15) when an AVX instruction executes here, else "xmm"
 * (XMM15). CPUID's word is beside it (A: 1 when CPUID says AVX is usable, OSXSAVE and
 * YMM state in XCR0): a kernel that does not switch YMM state (kvm_pvm's noxsave guest)
 * must not tell user mode AVX is usable, but whether user mode can run AVX anyway is up
 * to the host (on kvm_pvm it can, whatever its CPUID says), and that is the register a
 * process could lose. Built with -ffixed-xmm15: the compiler leaves XMM15 to the asm.
 */
#include <cpuid.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int cpuid_says_avx(void)
{
	unsigned int a, b, c, d;
	uint32_t lo, hi;

	if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)) || !(c & (1u << 28)))
		return 0;
	__asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
	return (lo & 6) == 6;
}

static sigjmp_buf no_avx;

static void on_sigill(int sig)
{
	(void)sig;
	siglongjmp(no_avx, 1);
}

/* Whether an AVX instruction executes here (#UD, so SIGILL, where it does not). */
static int avx_executes(void)
{
	struct sigaction sa, old;
	volatile int executes = 0;

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_sigill;
	sigaction(SIGILL, &sa, &old);
	if (sigsetjmp(no_avx, 1) == 0) {
		__asm__ volatile("vxorps %%ymm14, %%ymm14, %%ymm14" : : : "xmm14");
		executes = 1;
	}
	sigaction(SIGILL, &old, NULL);
	return executes;
}

static void set_ymm_pattern(uint64_t pattern)
{
	__asm__ volatile("vmovq %0, %%xmm15\n\t"
			 "vpunpcklqdq %%xmm15, %%xmm15, %%xmm15\n\t"
			 "vinsertf128 $1, %%xmm15, %%ymm15, %%ymm15"
			 : : "r"(pattern) : "xmm15");
}

static void read_ymm_upper(uint64_t out[2])
{
	__asm__ volatile("vextractf128 $1, %%ymm15, %0" : "=m"(*(uint64_t(*)[2])out));
}

/* Legacy SSE encodings only: a VEX-encoded write would clear YMM15's upper half. */
static void set_xmm_pattern(uint64_t pattern)
{
	__asm__ volatile("movq %0, %%xmm15\n\t"
			 "punpcklqdq %%xmm15, %%xmm15"
			 : : "r"(pattern) : "xmm15");
}

static void read_xmm(uint64_t out[2])
{
	__asm__ volatile("movdqu %%xmm15, %0" : "=m"(*(uint64_t(*)[2])out));
}

int main(int argc, char **argv)
{
	long long limit_ns = (argc > 1 ? atoll(argv[1]) : 3) * 1000000000LL;
	uint64_t pattern = 0x5a5a000000000000ull ^ ((uint64_t)getpid() << 16) ^ 0x1234;
	struct timespec start, now;
	unsigned long checks = 0, clobbered = 0;
	int ymm = avx_executes();
	void (*set)(uint64_t) = ymm ? set_ymm_pattern : set_xmm_pattern;
	void (*get)(uint64_t[2]) = ymm ? read_ymm_upper : read_xmm;

	/*
	 * Built without -mavx and with xmm15 fixed, the C code never writes ymm15 (a
	 * VEX-encoded write to xmm15 would clear the upper half): only the asm here touches
	 * xmm15/ymm15. Library code (clock_gettime, printf) is musl's, which keeps off it.
	 */
	set(pattern);
	clock_gettime(CLOCK_MONOTONIC, &start);
	do {
		uint64_t seen[2];

		for (int i = 0; i < 100000; i++)
			__asm__ volatile("" ::: "memory");
		get(seen);
		checks++;
		if (seen[0] != pattern || seen[1] != pattern) {
			clobbered++;
			set(pattern); /* to count each clobbering once */
		}
		clock_gettime(CLOCK_MONOTONIC, &now);
	} while ((now.tv_sec - start.tv_sec) * 1000000000LL + (now.tv_nsec - start.tv_nsec) < limit_ns);
	printf("hvprobe-vecstate pid=%d regs=%s cpuid-avx=%d checks=%lu clobbered=%lu\n", (int)getpid(),
	       ymm ? "ymm" : "xmm", cpuid_says_avx(), checks, clobbered);
	return clobbered != 0;
}
