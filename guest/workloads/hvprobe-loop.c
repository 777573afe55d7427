// SPDX-License-Identifier: MIT OR Apache-2.0
// hvprobe-cflags: -static -nostdlib -Os -fno-stack-protector -fno-builtin -fno-asynchronous-unwind-tables
/*
 * hvprobe-loop [N]: call getppid() N times (default 1000) in one long-lived
 * process and print the count and how long the loop took (CLOCK_MONOTONIC,
 * microseconds).  Drives N system calls (and N hits of a probe on e.g.
 * __x64_sys_getppid) without fork/exec costs in the guest, and times them
 * without the exec's (variable) cost.
 *
 * Freestanding (no libc, built with -nostdlib): a few KB instead of ~800 KB
 * of static glibc, because every byte of the initramfs is unpacked by an
 * emulated kernel at boot on kvm_pvm.
 */
#define SYS_write 1
#define SYS_getppid 110
#define SYS_clock_gettime 228
#define CLOCK_MONOTONIC 1
#define SYS_exit_group 231

static long sys3(long nr, long a, long b, long c)
{
	long ret;

	__asm__ volatile("syscall"
			 : "=a"(ret)
			 : "a"(nr), "D"(a), "S"(b), "d"(c)
			 : "rcx", "r11", "memory");
	return ret;
}

static unsigned long parse(const char *s)
{
	unsigned long v = 0;

	while (*s >= '0' && *s <= '9')
		v = v * 10 + (unsigned long)(*s++ - '0');
	return v;
}

static unsigned long now_us(void)
{
	long ts[2];

	sys3(SYS_clock_gettime, CLOCK_MONOTONIC, (long)ts, 0);
	return (unsigned long)ts[0] * 1000000UL + (unsigned long)ts[1] / 1000UL;
}

/* Appends the decimal digits of v to buf at *len. */
static void put_number(char *buf, int *len, unsigned long v)
{
	char num[24];
	int k = 0;

	do {
		num[k++] = (char)('0' + v % 10);
		v /= 10;
	} while (v);
	while (k)
		buf[(*len)++] = num[--k];
}

__attribute__((used)) static void start_c(long *sp)
{
	long argc = sp[0];
	char **argv = (char **)(sp + 1);
	unsigned long n = argc > 1 ? parse(argv[1]) : 1000;
	unsigned long i, count = 0, started, took;
	static const char pre[] = "hvprobe-loop: ";
	static const char mid[] = " getppid calls in ";
	static const char post[] = " us\n";
	char buf[96];
	int len = 0;

	started = now_us();
	for (i = 0; i < n; i++)
		if (sys3(SYS_getppid, 0, 0, 0) >= 0)
			count++;
	took = now_us() - started;

	for (i = 0; pre[i]; i++)
		buf[len++] = pre[i];
	put_number(buf, &len, count);
	for (i = 0; mid[i]; i++)
		buf[len++] = mid[i];
	put_number(buf, &len, took);
	for (i = 0; post[i]; i++)
		buf[len++] = post[i];
	sys3(SYS_write, 1, (long)buf, len);
	sys3(SYS_exit_group, 0, 0, 0);
	for (;;)
		;
}

__asm__(".text\n"
	".global _start\n"
	"_start:\n"
	"	xor %ebp, %ebp\n"
	"	mov %rsp, %rdi\n"
	"	and $-16, %rsp\n"
	"	call start_c\n"
	"	hlt\n");
