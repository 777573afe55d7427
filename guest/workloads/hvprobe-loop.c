// SPDX-License-Identifier: MIT OR Apache-2.0
// hvprobe-cflags: -static -nostdlib -Os -fno-stack-protector -fno-builtin -fno-asynchronous-unwind-tables
/*
 * hvprobe-loop [N]: call getppid() N times (default 1000) in one long-lived
 * process and print the count.  Drives N system calls (and N hits of a
 * probe on e.g. __x64_sys_getppid) without fork/exec costs in the guest.
 *
 * Freestanding (no libc, built with -nostdlib): a few KB instead of ~800 KB
 * of static glibc, because every byte of the initramfs is unpacked by an
 * emulated kernel at boot on kvm_pvm.
 */
#define SYS_write 1
#define SYS_getppid 110
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

__attribute__((used)) static void start_c(long *sp)
{
	long argc = sp[0];
	char **argv = (char **)(sp + 1);
	unsigned long n = argc > 1 ? parse(argv[1]) : 1000;
	unsigned long i, count = 0;
	static const char pre[] = "hvprobe-loop: ";
	static const char post[] = " getppid calls\n";
	char buf[64], num[24];
	int len = 0, k = 0;

	for (i = 0; i < n; i++)
		if (sys3(SYS_getppid, 0, 0, 0) >= 0)
			count++;

	do {
		num[k++] = (char)('0' + count % 10);
		count /= 10;
	} while (count);
	for (i = 0; pre[i]; i++)
		buf[len++] = pre[i];
	while (k)
		buf[len++] = num[--k];
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
