// SPDX-License-Identifier: MIT OR Apache-2.0
// hvprobe-cflags: -static -nostdlib -Os -fno-stack-protector -fno-builtin -fno-asynchronous-unwind-tables
/*
 * hvprobe-io MODE DEV N: disk I/O for `hvprobe bench io`, with O_DIRECT so that the
 * guest's page cache is not what is measured.
 *   read DEV N      read the first N MiB of DEV in 1 MiB requests
 *   write DEV N     write N MiB of a pattern at the start of DEV in 1 MiB requests,
 *                   then fdatasync
 *   randread DEV N  read N 4 KiB blocks at pseudo-random 4 KiB offsets of DEV
 * Prints one line: `hvprobe-io MODE BYTES bytes REQUESTS requests MICROSECONDS us`
 * (CLOCK_MONOTONIC), or `hvprobe-io error STEP -ERRNO` and exits 1.
 *
 * Freestanding (no libc), like hvprobe-loop: every initramfs byte is unpacked by an
 * emulated kernel at boot on kvm_pvm.
 */
#define SYS_write 1
#define SYS_open 2
#define SYS_close 3
#define SYS_lseek 8
#define SYS_pread64 17
#define SYS_pwrite64 18
#define SYS_fdatasync 75
#define SYS_clock_gettime 228
#define SYS_exit_group 231
#define O_RDONLY 0
#define O_RDWR 2
#define O_DIRECT 040000
#define SEEK_END 2
#define CLOCK_MONOTONIC 1
#define MIB (1UL << 20)
#define BLOCK 4096UL

static long sys4(long nr, long a, long b, long c, long d)
{
	long ret;
	register long r10 __asm__("r10") = d;

	__asm__ volatile("syscall"
			 : "=a"(ret)
			 : "a"(nr), "D"(a), "S"(b), "d"(c), "r"(r10)
			 : "rcx", "r11", "memory");
	return ret;
}

static unsigned char buffer[MIB] __attribute__((aligned(4096)));

static unsigned long parse(const char *s)
{
	unsigned long v = 0;

	while (*s >= '0' && *s <= '9')
		v = v * 10 + (unsigned long)(*s++ - '0');
	return v;
}

static int equal(const char *a, const char *b)
{
	while (*a && *a == *b)
		a++, b++;
	return *a == *b;
}

static char *put(char *p, const char *s)
{
	while (*s)
		*p++ = *s++;
	return p;
}

static char *put_number(char *p, unsigned long v)
{
	char digits[24];
	int n = 0;

	do
		digits[n++] = (char)('0' + v % 10);
	while ((v /= 10) != 0);
	while (n)
		*p++ = digits[--n];
	return p;
}

static unsigned long now_us(void)
{
	struct {
		long sec, nsec;
	} ts;

	sys4(SYS_clock_gettime, CLOCK_MONOTONIC, (long)&ts, 0, 0);
	return (unsigned long)ts.sec * 1000000UL + (unsigned long)ts.nsec / 1000UL;
}

static void __attribute__((noreturn)) finish(const char *mode, const char *what, unsigned long a,
					     unsigned long b, unsigned long c)
{
	char line[160], *p = line;

	p = put(p, "hvprobe-io ");
	p = put(p, mode);
	if (equal(mode, "error")) {
		p = put(p, " ");
		p = put(p, what);
		p = put(p, " -");
		p = put_number(p, a);
	} else {
		p = put(p, " ");
		p = put_number(p, a);
		p = put(p, " bytes ");
		p = put_number(p, b);
		p = put(p, " requests ");
		p = put_number(p, c);
		p = put(p, " us");
	}
	*p++ = '\n';
	sys4(SYS_write, 1, (long)line, p - line, 0);
	sys4(SYS_exit_group, equal(mode, "error") ? 1 : 0, 0, 0, 0);
	__builtin_unreachable();
}

static void check(long ret, const char *step)
{
	if (ret < 0)
		finish("error", step, (unsigned long)-ret, 0, 0);
}

static int run(int argc, char **argv)
{
	unsigned long n, i, start, bytes = 0, requests = 0, size, blocks, x;
	const char *mode;
	long fd;

	if (argc != 4) {
		static const char usage[] = "usage: hvprobe-io read|write|randread DEV N\n";
		sys4(SYS_write, 2, (long)usage, sizeof(usage) - 1, 0);
		return 2;
	}
	mode = argv[1];
	n = parse(argv[3]);
	fd = sys4(SYS_open, (long)argv[2], (equal(mode, "write") ? O_RDWR : O_RDONLY) | O_DIRECT, 0, 0);
	check(fd, "open");
	for (i = 0; i < MIB; i++)
		buffer[i] = (unsigned char)(i * 31 + 7);
	start = now_us();
	if (equal(mode, "read") || equal(mode, "write")) {
		int write = equal(mode, "write");

		for (i = 0; i < n; i++) {
			long ret = write ? sys4(SYS_pwrite64, fd, (long)buffer, MIB, (long)(i * MIB))
					 : sys4(SYS_pread64, fd, (long)buffer, MIB, (long)(i * MIB));
			check(ret, write ? "pwrite" : "pread");
			bytes += (unsigned long)ret;
			requests++;
		}
		if (write)
			check(sys4(SYS_fdatasync, fd, 0, 0, 0), "fdatasync");
	} else if (equal(mode, "randread")) {
		long end = sys4(SYS_lseek, fd, 0, SEEK_END, 0);

		check(end, "lseek");
		size = (unsigned long)end;
		blocks = size / BLOCK;
		if (blocks == 0)
			finish("error", "size", 22, 0, 0);
		start = now_us();
		x = 88172645463325252UL;
		for (i = 0; i < n; i++) {
			/* xorshift64: reproducible offsets, no libc */
			x ^= x << 13;
			x ^= x >> 7;
			x ^= x << 17;
			check(sys4(SYS_pread64, fd, (long)buffer, BLOCK, (long)((x % blocks) * BLOCK)), "pread");
			bytes += BLOCK;
			requests++;
		}
	} else {
		finish("error", "mode", 22, 0, 0);
	}
	finish(mode, "", bytes, requests, now_us() - start);
}

void __attribute__((noreturn, used)) start_c(long *sp)
{
	int argc = (int)sp[0];
	char **argv = (char **)(sp + 1);

	sys4(SYS_exit_group, run(argc, argv), 0, 0, 0);
	__builtin_unreachable();
}

__asm__(".globl _start\n"
	"_start:\n"
	"	mov %rsp, %rdi\n"
	"	and $-16, %rsp\n"
	"	call start_c\n");
