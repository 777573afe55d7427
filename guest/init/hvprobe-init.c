// SPDX-License-Identifier: MIT OR Apache-2.0
/*
 * hvprobe-init: /init of hvprobe's bundled guest.
 *
 * Guest -> VMM protocol (1-byte writes through /dev/port):
 *   port 0x0ef0  event: 1 = "/init reached", 2 = "workload started"
 *   port 0x0ef1  exit status 0..255: the VMM stops the VM with that status
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

static void port_write(unsigned int port, unsigned char val)
{
	port_open();
	if (port_fd >= 0)
		(void)!pwrite(port_fd, &val, 1, port);
}

/* Tell the VMM to stop with `status`; if nobody listens, reset the machine. */
static void __attribute__((noreturn)) vm_exit(unsigned char status)
{
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
	port_write(PORT_EXIT, 0);
	/* not reached under the VMM (or no /dev/port): try the kernel way */
	reboot(RB_AUTOBOOT);
	perror(name);
	return 1;
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

static char *const child_env[] = {
	"PATH=/sbin:/usr/sbin:/bin:/usr/bin",
	"HOME=/root",
	"TERM=vt100",
	"SHELL=/bin/sh",
	"USER=root",
	"ENV=/etc/profile", /* interactive sub-shells get the functions too */
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
	if (port_fd < 0)
		say("hvprobe-init: cannot open /dev/port; the VMM will not see events\n");

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
