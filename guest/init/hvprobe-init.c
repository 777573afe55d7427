// SPDX-License-Identifier: MIT OR Apache-2.0
/*
 * hvprobe-init: /init of hvprobe's bundled guest.
 *
 * Guest -> VMM protocol (1-byte writes through /dev/port, or `out` after
 * ioperm() on kernels without /dev/port):
 *   port 0x0ef0  event: 1 = "/init reached", 2 = "workload started",
 *                3 = "ready for a workload" (wait mode, see below)
 *   port 0x0ef1  exit status 0..255: the VMM stops the VM with that status
 *
 * Wait mode (kernel command line contains `hvprobe.wait`, no workload in
 * the initrd): after the mounts, put /dev/ttyS0 in raw mode, write event 3
 * and read the workload from the console as `<decimal length>\n<bytes>`;
 * it is written to /hvprobe/workload and run like a workload from the
 * initrd.  The VMM snapshots the guest at event 3 (hvprobe snapshot).
 *
 * Every system call costs ~2.5 ms and a fork+exec ~1.4 s when the guest
 * kernel is emulated (kvm_pvm), so this does as little as possible: no
 * extra processes, one vfork+exec for the workload or the shell.
 *
 * The same binary is installed as /sbin/poweroff, /sbin/halt and
 * /sbin/reboot (dispatch on argv[0]): poweroff/halt sync and write 0 to
 * port 0x0ef1; reboot calls reboot(RB_AUTOBOOT) (with reboot=k an i8042
 * reset, which the VMM treats as the end of the VM).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/io.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#define PORT_EVENT 0x0ef0
#define PORT_EXIT 0x0ef1
#define EV_INIT_REACHED 1
#define EV_WORKLOAD_STARTED 2
#define EV_READY_FOR_WORKLOAD 3
#define WAIT_OPTION "hvprobe.wait"
/* longest workload accepted over the console */
#define WORKLOAD_MAX (1 << 20)

#define WORKLOAD "/hvprobe/workload"
#define SHELL "/bin/sh"
#define CONSOLE_TTY "/dev/ttyS0"

static int port_fd = -1;

static void say(const char *msg)
{
	/* one write() per message */
	(void)!write(2, msg, strlen(msg));
}

static void port_open(void)
{
	if (port_fd < 0)
		port_fd = open("/dev/port", O_RDWR | O_CLOEXEC);
}

/*
 * Kernels without /dev/port (Debian's, CONFIG_DEVPORT off) still let root
 * have the two ports with ioperm() (CONFIG_X86_IOPL_IOPERM): an `out` then.
 */
static int port_ioperm(void)
{
	static int granted = -1;

	if (granted < 0)
		granted = ioperm(PORT_EVENT, 2, 1) == 0;
	return granted;
}

static void port_write(unsigned int port, unsigned char val)
{
	port_open();
	if (port_fd >= 0)
		(void)!pwrite(port_fd, &val, 1, port);
	else if (port_ioperm())
		__asm__ volatile("outb %0, %w1" : : "a"(val), "Nd"(port));
}

static void on_alarm(int sig)
{
	(void)sig;
}

/*
 * What the workload wrote to the console may still sit in its tty buffer, sent by
 * the UART's interrupts: the VMM stops the VM at once on the exit port, so wait
 * until it is out (at hardware speed, under heavy probing, a run's last lines
 * were lost).  Bounded: an alarm interrupts tcdrain (no SA_RESTART).
 */
static void drain_console(void)
{
	struct sigaction sa;

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_alarm;
	sigaction(SIGALRM, &sa, NULL);
	alarm(2);
	tcdrain(STDOUT_FILENO);
	alarm(0);
}

/* Tell the VMM to stop with `status`; if nobody listens, reset the machine. */
static void __attribute__((noreturn)) vm_exit(unsigned char status)
{
	drain_console();
	port_write(PORT_EXIT, status);
	/* Not reached under hvprobe's VMM.  Fall back to a reset. */
	say("hvprobe-init: port 0xef1 did not stop the VM; resetting\n");
	reboot(RB_AUTOBOOT);
	for (;;)
		pause();
}

/* ---- /sbin/poweroff, /sbin/halt, /sbin/reboot ------------------------- */

static int power_main(const char *name)
{
	sync();
	if (!strcmp(name, "reboot")) {
		reboot(RB_AUTOBOOT);
		perror("reboot");
		return 1;
	}
	drain_console();
	port_write(PORT_EXIT, 0);
	/* not reached under the VMM (or no /dev/port): try the kernel way */
	reboot(RB_AUTOBOOT);
	perror(name);
	return 1;
}

/* ---- wait mode --------------------------------------------------------- */

/* Whether the kernel command line holds `word` (as a whole word). */
static int cmdline_has(const char *word)
{
	static char cmdline[4096];
	static int read_once;
	size_t len = strlen(word);
	char *p;

	if (!read_once) {
		int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
		ssize_t n = fd < 0 ? -1 : read(fd, cmdline, sizeof(cmdline) - 1);

		if (fd >= 0)
			close(fd);
		cmdline[n > 0 ? n : 0] = 0;
		read_once = 1;
	}
	for (p = cmdline; (p = strstr(p, word)); p += len) {
		if ((p == cmdline || p[-1] == ' ') &&
		    (p[len] == 0 || p[len] == ' ' || p[len] == '\n'))
			return 1;
	}
	return 0;
}

/*
 * Signals "ready for a workload" and receives it on the console:
 * `<decimal length>\n` then exactly that many bytes.  The tty is raw (no
 * echo, no line editing, every byte as is) only while reading.  Returns 0
 * once the workload is in WORKLOAD.
 */
static int receive_workload(void)
{
	static char buf[WORKLOAD_MAX + 32];
	struct termios saved, raw;
	size_t have = 0, want = 0, header = 0;
	int tty, fd, ok;

	tty = open(CONSOLE_TTY, O_RDWR | O_NOCTTY | O_CLOEXEC);
	if (tty < 0) {
		say("hvprobe-init: wait mode: cannot open " CONSOLE_TTY "\n");
		return -1;
	}
	ok = tcgetattr(tty, &saved) == 0;
	if (ok) {
		raw = saved;
		cfmakeraw(&raw);
		raw.c_cc[VMIN] = 1;
		raw.c_cc[VTIME] = 0;
		tcsetattr(tty, TCSANOW, &raw);
	}
	port_write(PORT_EVENT, EV_READY_FOR_WORKLOAD);
	for (;;) {
		ssize_t n = read(tty, buf + have, sizeof(buf) - 1 - have);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		have += n;
		if (!header) {
			char *nl = memchr(buf, '\n', have);
			size_t i;

			if (!nl) {
				if (have > 16)
					break; /* not a length */
				continue;
			}
			header = nl - buf + 1;
			for (i = 0; i + 1 < header; i++) {
				if (buf[i] < '0' || buf[i] > '9')
					break;
				want = want * 10 + (buf[i] - '0');
			}
			if (i + 1 != header || header == 1 || want > WORKLOAD_MAX)
				break;
		}
		if (header && have >= header + want)
			break;
	}
	if (ok)
		tcsetattr(tty, TCSANOW, &saved);
	close(tty);
	if (!header || have < header + want) {
		say("hvprobe-init: wait mode: malformed workload message on the console\n");
		return -1;
	}
	mkdir("/hvprobe", 0755);
	fd = open(WORKLOAD, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0755);
	if (fd < 0 || write(fd, buf + header, want) != (ssize_t)want) {
		say("hvprobe-init: wait mode: cannot write " WORKLOAD "\n");
		return -1;
	}
	close(fd);
	return 0;
}

/* ---- pid 1 ----------------------------------------------------------------- */

/* busybox poweroff/halt/reboot without -f signal pid 1 */
static void on_signal(int sig)
{
	if (sig == SIGUSR1 || sig == SIGUSR2) { /* halt, poweroff */
		sync();
		port_write(PORT_EXIT, 0);
	}
	if (sig == SIGTERM) { /* reboot */
		sync();
		reboot(RB_AUTOBOOT);
	}
}

/*
 * A kernel booted with `noxsave` (hvprobe's kvm_pvm fix-ups: KVM's emulator
 * cannot run XSAVE at CPL0) saves and restores only the x87/SSE registers of
 * a task, but user mode runs natively there and still sees AVX (CPUID and
 * XCR0 are the host's): the upper halves of YMM/ZMM and the opmask
 * registers would pass from one process to the next. glibc's string
 * functions use them (busybox is static glibc), so keep glibc on its SSE2
 * code.  A program that uses AVX by itself is not covered (README).
 */
#define NO_AVX_TUNABLES "GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX,-AVX2,-AVX512F,-AVX512CD," \
	"-AVX512BW,-AVX512DQ,-AVX512ER,-AVX512PF,-AVX512VL,-AVX_Fast_Unaligned_Load," \
	"-FMA,-FMA4,-XSAVEC"

static char *child_env[] = {
	"PATH=/sbin:/usr/sbin:/bin:/usr/bin",
	"HOME=/root",
	"TERM=vt100",
	"SHELL=/bin/sh",
	"USER=root",
	"ENV=/etc/profile", /* interactive sub-shells get the functions too */
	NULL, /* NO_AVX_TUNABLES when the kernel runs with noxsave */
	NULL,
};

int main(int argc, char **argv)
{
	const char *name = argc > 0 && argv[0] ? argv[0] : "init";
	const char *slash = strrchr(name, '/');
	struct sigaction sa;
	struct stat st;
	int interactive;
	pid_t child;
	int status;

	if (slash)
		name = slash + 1;
	if (!strcmp(name, "poweroff") || !strcmp(name, "halt") || !strcmp(name, "reboot"))
		return power_main(name);
	if (getpid() != 1) {
		say("hvprobe-init: must run as pid 1 (or be called poweroff/halt/reboot)\n");
		return 1;
	}

	/*
	 * Event 1 first of all: the VMM measures boot time with it.  The
	 * initramfs ships /dev/port (and /dev/console), so no mount is needed
	 * before; if it is missing, mount devtmpfs and retry.
	 */
	port_open();
	if (port_fd < 0) {
		mount("devtmpfs", "/dev", "devtmpfs", 0, NULL);
		port_open();
	}
	port_write(PORT_EVENT, EV_INIT_REACHED);
	if (port_fd < 0 && !port_ioperm())
		say("hvprobe-init: no /dev/port and no ioperm(); the VMM will not see events\n");

	mount("devtmpfs", "/dev", "devtmpfs", 0, NULL); /* EBUSY if done above */
	mount("proc", "/proc", "proc", 0, NULL);
	mount("sysfs", "/sys", "sysfs", 0, NULL);
	mount("debugfs", "/sys/kernel/debug", "debugfs", 0, NULL);
	mount("tracefs", "/sys/kernel/tracing", "tracefs", 0, NULL);

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal;
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGUSR2, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);

	interactive = stat(WORKLOAD, &st) != 0;
	if (interactive && cmdline_has(WAIT_OPTION)) {
		if (receive_workload() != 0)
			vm_exit(125);
		interactive = 0;
	}
	if (cmdline_has("noxsave"))
		child_env[6] = NO_AVX_TUNABLES;
	say(interactive ? "hvprobe-init: interactive shell\n"
			: "hvprobe-init: running workload\n");

	child = vfork();
	if (child == 0) {
		/* only async-signal-safe system calls between vfork and exec */
		/*
		 * Login shells ("-sh") read /etc/profile, which routes the
		 * power commands to /sbin/* (busybox sh prefers its applets).
		 */
		static char *const wl_argv[] = { "-sh", WORKLOAD, NULL };
		static char *const sh_argv[] = { "-sh", NULL };
		int fd;

		/* (execve resets our signal handlers to SIG_DFL) */
		if (interactive) {
			setsid();
			/* session leader + controlling tty: job control, Ctrl-C */
			fd = open(CONSOLE_TTY, O_RDWR);
			if (fd >= 0) {
				ioctl(fd, TIOCSCTTY, 1);
				dup2(fd, 0);
				dup2(fd, 1);
				dup2(fd, 2);
				if (fd > 2)
					close(fd);
			}
			execve(SHELL, sh_argv, child_env);
		} else {
			fd = open("/dev/null", O_RDONLY);
			if (fd >= 0 && fd != 0) {
				dup2(fd, 0);
				close(fd);
			}
			execve(SHELL, wl_argv, child_env);
		}
		_exit(127);
	}
	if (child < 0) {
		say("hvprobe-init: vfork failed\n");
		vm_exit(125);
	}
	if (!interactive)
		port_write(PORT_EVENT, EV_WORKLOAD_STARTED);

	/* pid 1: reap everything, stop when our child is gone */
	for (;;) {
		pid_t pid = waitpid(-1, &status, 0);

		if (pid == child)
			break;
		if (pid < 0 && errno == ECHILD) {
			status = 125 << 8;
			break;
		}
	}
	if (WIFEXITED(status))
		vm_exit(WEXITSTATUS(status));
	if (WIFSIGNALED(status))
		vm_exit(128 + WTERMSIG(status));
	vm_exit(125);
}
