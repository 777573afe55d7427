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
 * Disk root (`hvprobe.root=DEV` on the command line, e.g. /dev/vda; the VMM
 * adds it for --root): this stays pid 1 in the initramfs; once the workload
 * is there (wait mode: received, i.e. after a snapshot's restore) it mounts
 * DEV at /newroot with the first block filesystem type of /proc/filesystems
 * that takes it (ext4 first; read-only if the device is, or with
 * `hvprobe.rootflags=ro`; other rootflags go to the filesystem as options),
 * mounts proc, sysfs, devtmpfs, tmpfs (/tmp, /run), tracefs and debugfs in
 * it, binds /hvprobe at /newroot/run/hvprobe, and the child chroots there and
 * runs the disk's /bin/sh (with /run/hvprobe/workload).  Before the VM ends,
 * every other process is killed and the disk is synced, remounted read-only
 * and unmounted, so the filesystem is clean when the VMM stops.  A root that
 * cannot be mounted or run ends the VM with status 125 and one line saying
 * what failed.
 *
 * Shared root (`hvprobe.rootfs=TAG`, the VMM's --rootfs DIR): the same, with
 * an overlay at /newroot of the virtio-fs share TAG (mounted read-only) under
 * a tmpfs, so the workload can write anywhere and the host's files stay as
 * they are.  Shared directories (`hvprobe.rwdir=TAG:/GUESTPATH`, repeatable,
 * the VMM's --rwdir): the virtio-fs share TAG mounted read-write at GUESTPATH
 * of the workload's root (its directories made if missing).
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
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/io.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <termios.h>
#include <unistd.h>

#define PORT_EVENT 0x0ef0
#define PORT_EXIT 0x0ef1
#define EV_INIT_REACHED 1
#define EV_WORKLOAD_STARTED 2
#define EV_READY_FOR_WORKLOAD 3
#define WAIT_OPTION "hvprobe.wait"
#define ROOT_OPTION "hvprobe.root="
#define ROOTFLAGS_OPTION "hvprobe.rootflags="
#define ROOTFS_OPTION "hvprobe.rootfs="
#define RWDIR_OPTION "hvprobe.rwdir="
/* the shared root's read-only layer and its writable tmpfs (upper and work dirs) */
#define SHARED_LOWER "/shared-root"
#define SHARED_RW "/shared-rw"
/* longest workload accepted over the console */
#define WORKLOAD_MAX (1 << 20)

#define WORKLOAD "/hvprobe/workload"
#define SHELL "/bin/sh"
#define CONSOLE_TTY "/dev/ttyS0"
/* where a disk root is mounted, and the workload as the disk root sees it */
#define NEWROOT "/newroot"
#define ROOT_WORKLOAD "/run/hvprobe/workload"

static int port_fd = -1;
/* hvprobe.root=DEV, empty without */
static char root_dev[256];
/* hvprobe.rootfs=TAG, empty without */
static char root_tag[64];
/* NEWROOT holds the disk: root_shutdown() before the VM ends */
static volatile sig_atomic_t root_mounted;

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

/* SIGALRM in `seconds` interrupts the blocking call then running (no SA_RESTART) */
static void alarm_in(unsigned int seconds)
{
	struct sigaction sa;

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_alarm;
	sigaction(SIGALRM, &sa, NULL);
	alarm(seconds);
}

/*
 * What the workload wrote to the console may still sit in its tty buffer, sent by
 * the UART's interrupts: the VMM stops the VM at once on the exit port, so wait
 * until it is out (at hardware speed, under heavy probing, a run's last lines
 * were lost).  Bounded: an alarm interrupts tcdrain (no SA_RESTART).
 */
static void drain_console(void)
{
	alarm_in(2);
	tcdrain(STDOUT_FILENO);
	alarm(0);
}

/*
 * The end of a disk root (async-signal-safe: on_signal calls it too): kill
 * every process but this one (they may hold files open for writing), reap
 * them (bounded), sync, remount the disk read-only (ext4 commits its journal
 * and marks itself clean) and detach the whole tree.
 */
static void root_shutdown(void)
{
	if (!root_mounted)
		return;
	root_mounted = 0;
	kill(-1, SIGKILL);
	alarm_in(2);
	while (waitpid(-1, NULL, 0) > 0)
		;
	alarm(0);
	sync();
	if (mount(NULL, NEWROOT, NULL, MS_REMOUNT | MS_RDONLY, NULL) != 0)
		say("hvprobe-init: root: cannot remount " NEWROOT " read-only; "
		    "the filesystem may need recovery\n");
	umount2(NEWROOT, MNT_DETACH);
}

/* Tell the VMM to stop with `status`; if nobody listens, reset the machine. */
static void __attribute__((noreturn)) vm_exit(unsigned char status)
{
	root_shutdown();
	sync();
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

/* ---- the kernel command line -------------------------------------------- */

static const char *cmdline_text(void)
{
	static char cmdline[4096];
	static int read_once;

	if (!read_once) {
		int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
		ssize_t n = fd < 0 ? -1 : read(fd, cmdline, sizeof(cmdline) - 1);

		if (fd >= 0)
			close(fd);
		cmdline[n > 0 ? n : 0] = 0;
		read_once = 1;
	}
	return cmdline;
}

static int word_end(char c)
{
	return c == 0 || c == ' ' || c == '\n';
}

/* Whether the kernel command line holds `word` (as a whole word). */
static int cmdline_has(const char *word)
{
	const char *cmdline = cmdline_text(), *p;
	size_t len = strlen(word);

	for (p = cmdline; (p = strstr(p, word)); p += len) {
		if ((p == cmdline || p[-1] == ' ') && word_end(p[len]))
			return 1;
	}
	return 0;
}

/*
 * The value of the last `prefix<value>` word (prefix ends in '=') in `out`;
 * returns 0 when there is none (or it does not fit: `out` is then empty).
 */
static int cmdline_value(const char *prefix, char *out, size_t size)
{
	const char *cmdline = cmdline_text(), *p, *v;
	size_t len = strlen(prefix), n;
	int found = 0;

	for (p = cmdline; (p = strstr(p, prefix)); p += len) {
		if (p != cmdline && p[-1] != ' ')
			continue;
		v = p + len;
		for (n = 0; !word_end(v[n]); n++)
			;
		found = n < size;
		if (found) {
			memcpy(out, v, n);
			out[n] = 0;
		} else if (size) {
			out[0] = 0;
		}
	}
	return found;
}

/* ---- wait mode --------------------------------------------------------- */

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

/* ---- modules (/lib/modules/hvprobe: the VMM's drivers for its devices) ---- */

#define MODULES_DIR "/lib/modules/hvprobe/"
#define MODULES_LIST MODULES_DIR "load"
#define MODULE_INIT_COMPRESSED_FILE 4
/* the DSDT's first virtio-mmio device, when the kernel reads ACPI */
#define ACPI_VIRTIO_MMIO "/sys/bus/acpi/devices/LNRO0005:00"

static char *append(char *buf, size_t size, ...);

/* set when modules were loaded: their devices may take a moment to appear */
static int modules_loaded;

/*
 * The `NAME.param=value` words of the kernel command line for module `name`
 * ('-' and '_' alike), as `param=value` words in `out`, as modprobe passes
 * them.  virtio_mmio's `device=` words are left out when ACPI describes the
 * devices: both would register each window, the second failing.
 */
static void module_params(const char *name, char *out, size_t size)
{
	const char *p = cmdline_text();
	size_t len = strlen(name);
	struct stat st;
	int acpi = !strcmp(name, "virtio_mmio") && stat(ACPI_VIRTIO_MMIO, &st) == 0;

	out[0] = 0;
	while (*p) {
		const char *w = p;
		char word[512];
		size_t n, i;

		for (n = 0; !word_end(w[n]); n++)
			;
		p = w + n;
		while (*p == ' ' || *p == '\n')
			p++;
		if (n <= len + 1 || w[len] != '.' || n - len - 1 >= sizeof(word))
			continue;
		for (i = 0; i < len && (w[i] == '-' ? '_' : w[i]) == name[i]; i++)
			;
		if (i < len || (acpi && !strncmp(w + len + 1, "device=", 7)))
			continue;
		memcpy(word, w + len + 1, n - len - 1);
		word[n - len - 1] = 0;
		append(out, size, out[0] ? " " : "", word, (char *)NULL);
	}
}

/*
 * Loads every module of MODULES_LIST in its order (dependencies first), with
 * its command-line parameters; one already loaded is fine, another failure is
 * said and the boot goes on (a mount that needed it then says what failed).
 */
static void load_modules(void)
{
	char list[8192], *line, *save;
	int fd = open(MODULES_LIST, O_RDONLY | O_CLOEXEC);
	size_t len = 0;
	ssize_t n;

	if (fd < 0)
		return;
	while (len < sizeof(list) - 1 && (n = read(fd, list + len, sizeof(list) - 1 - len)) > 0)
		len += (size_t)n;
	close(fd);
	list[len] = 0;
	if (len == sizeof(list) - 1)
		say("hvprobe-init: the module list is too long; its end is not loaded\n");
	for (line = strtok_r(list, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		/* "NN-FILE": the module's name is FILE up to its first '.' */
		const char *base = strchr(line, '-') ? strchr(line, '-') + 1 : line;
		char path[512] = "", name[128], params[1024], msg[1024] = "";
		int mfd, err = 0;
		size_t k;

		for (k = 0; base[k] && base[k] != '.' && k + 1 < sizeof(name); k++)
			name[k] = base[k] == '-' ? '_' : base[k];
		name[k] = 0;
		module_params(name, params, sizeof(params));
		mfd = open(append(path, sizeof(path), MODULES_DIR, line, (char *)NULL), O_RDONLY | O_CLOEXEC);
		if (mfd < 0)
			err = errno;
		else if (syscall(SYS_finit_module, mfd, params,
				 strstr(base, ".ko.") ? MODULE_INIT_COMPRESSED_FILE : 0) != 0)
			err = errno;
		if (mfd >= 0)
			close(mfd);
		if (err && err != EEXIST)
			say(append(msg, sizeof(msg), "hvprobe-init: cannot load module ", name, ": ",
				   strerror(err), "\n", (char *)NULL));
		modules_loaded = 1;
	}
}

/* Waits up to 5 s for `path` to exist when modules were loaded (their probes
 * may finish after finit_module returns); whether it exists. */
static int wait_for_device(const char *path)
{
	struct timespec tick = { 0, 20 * 1000 * 1000 };
	struct stat st;
	int i;

	for (i = 0; i < 250; i++) {
		if (stat(path, &st) == 0)
			return 1;
		if (!modules_loaded)
			return 0;
		nanosleep(&tick, NULL);
	}
	return 0;
}

/* ---- disk root (hvprobe.root=DEV) -------------------------------------- */

/*
 * Appends the strings up to a NULL to the string in `buf` (`size` bytes, cut
 * to fit); returns `buf`.  Not snprintf: that doubled the size of /init, and
 * every initramfs byte is unpacked by the emulated kernel.
 */
static char *append(char *buf, size_t size, ...)
{
	size_t n = strlen(buf);
	const char *s;
	va_list ap;

	va_start(ap, size);
	while ((s = va_arg(ap, const char *)))
		while (*s && n + 1 < size)
			buf[n++] = *s++;
	va_end(ap);
	buf[n] = 0;
	return buf;
}

/* One line "hvprobe-init: root: <what>: <errno text>". */
static void root_say(const char *what, int err)
{
	char line[1024] = "";

	say(append(line, sizeof(line), "hvprobe-init: root: ", what, ": ", strerror(err), "\n",
		   (char *)NULL));
}

/* root_say(), and the VM ends with status 125. */
static void __attribute__((noreturn)) root_fail(const char *what, int err)
{
	root_say(what, err);
	vm_exit(125);
}

/* Mounts `type` at NEWROOT/dir (made first if missing: only then is the disk written). */
static int mount_in_root(const char *type, const char *dir, const char *data)
{
	char path[256] = "", what[256] = "";
	struct stat st;
	int err = 0;

	append(path, sizeof(path), NEWROOT, dir, (char *)NULL);
	if (stat(path, &st) != 0 && (errno != ENOENT || mkdir(path, 0755) != 0))
		err = errno;
	else if (mount(type, path, type, 0, data) != 0)
		err = errno;
	if (err)
		root_say(append(what, sizeof(what), "cannot mount ", type, " at ", dir, (char *)NULL),
			 err);
	return err ? -1 : 0;
}

/*
 * The block filesystem types the kernel has (the lines of /proc/filesystems
 * without "nodev"), ext4 first: the kernel's own root mount tries them too.
 */
static int block_fs_types(char **types, int max)
{
	static char buf[4096];
	int fd = open("/proc/filesystems", O_RDONLY | O_CLOEXEC), n = 0;
	ssize_t len = fd < 0 ? -1 : read(fd, buf, sizeof(buf) - 1);
	char *line, *next;

	if (fd >= 0)
		close(fd);
	buf[len > 0 ? len : 0] = 0;
	types[n++] = "ext4";
	for (line = buf; *line && n < max; line = next) {
		next = strchr(line, '\n');
		if (next)
			*next++ = 0;
		else
			next = line + strlen(line);
		if (line[0] != '\t' || !strcmp(line + 1, "ext4"))
			continue; /* "nodev\tNAME", or ext4 (tried first) */
		types[n++] = line + 1;
	}
	return n;
}

static void mount_api_filesystems(int interactive);

/*
 * Mounts the disk root at NEWROOT with the kernel's API filesystems in it and
 * the workload's directory bound at NEWROOT/run/hvprobe.  Called once the
 * workload is here: in wait mode that is after the snapshot's restore, so the
 * snapshot holds no mounted filesystem and each restored run mounts the disk
 * as it is then (a previous run may have written to it).  Any failure that
 * leaves nothing to run ends the VM (status 125).
 */
static void mount_root(int interactive, int after_snapshot)
{
	char flags[256] = "", data[256] = "", what[512] = "", tried[256] = "";
	char *types[16], *opt, *save;
	unsigned long mflags = MS_NOATIME;
	int ntypes, i, err = EINVAL, mounted = 0, fd, ro = 0;
	struct stat st;

	/* hvprobe.rootflags=ro[,fs options]: "ro"/"rw" here, the rest to the filesystem */
	cmdline_value(ROOTFLAGS_OPTION, flags, sizeof(flags));
	for (opt = strtok_r(flags, ",", &save); opt; opt = strtok_r(NULL, ",", &save)) {
		if (!strcmp(opt, "ro")) {
			mflags |= MS_RDONLY;
		} else if (!strcmp(opt, "rw")) {
			mflags &= ~MS_RDONLY;
		} else {
			append(data, sizeof(data), data[0] ? "," : "", opt, (char *)NULL);
		}
	}

	wait_for_device(root_dev);
	fd = open(root_dev, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		root_fail(append(what, sizeof(what), "cannot open ", root_dev, (char *)NULL), errno);
	if (fstat(fd, &st) != 0 || !S_ISBLK(st.st_mode))
		root_fail(root_dev, ENOTBLK);
	/* a read-only disk (--disk FILE,ro) is mounted read-only at once, as a
	 * read-write try would fail with EACCES and log an error */
	if (ioctl(fd, BLKROGET, &ro) == 0 && ro)
		mflags |= MS_RDONLY;
	/*
	 * The boot's partition scan read the disk's first blocks into the page
	 * cache, and a snapshot kept them: drop them, the disk may have changed
	 * since (an ext4 superblock lives in that first page).
	 */
	if (after_snapshot)
		ioctl(fd, BLKFLSBUF, 0);
	close(fd);
	mkdir(NEWROOT, 0755);

	/* as the kernel's mount_block_root(): EINVAL = not this type, try the next */
	ntypes = block_fs_types(types, 16);
	for (i = 0; i < ntypes && !mounted; i++) {
		unsigned long f = mflags;

		append(tried, sizeof(tried), tried[0] ? " " : "", types[i], (char *)NULL);
		for (;;) {
			if (mount(root_dev, NEWROOT, types[i], f, data[0] ? data : NULL) == 0) {
				mounted = 1;
				break;
			}
			err = errno;
			/* a read-only device (EACCES) or a journal to replay on one (EROFS) */
			if ((err == EACCES || err == EROFS) && !(f & MS_RDONLY)) {
				f |= MS_RDONLY;
				continue;
			}
			break;
		}
		if (!mounted && err != EINVAL && err != ENODEV)
			root_fail(append(what, sizeof(what), "cannot mount ", root_dev, " as ",
					 types[i], (char *)NULL),
				  err);
	}
	if (!mounted)
		root_fail(append(what, sizeof(what), "no filesystem type mounts ", root_dev,
				 data[0] ? " with options " : "", data, " (tried ", tried, ")",
				 (char *)NULL),
			  err);
	root_mounted = 1;
	mount_api_filesystems(interactive);
}

/*
 * The kernel's API filesystems in NEWROOT and the workload's directory bound at
 * NEWROOT/run/hvprobe: what a workload expects of its root.
 */
static void mount_api_filesystems(int interactive)
{
	/* not fatal: a minimal read-only root may lack a mount point */
	mount_in_root("proc", "/proc", NULL);
	if (mount_in_root("sysfs", "/sys", NULL) == 0) {
		/* sysfs has these two mount points itself */
		mount_in_root("tracefs", "/sys/kernel/tracing", NULL);
		mount_in_root("debugfs", "/sys/kernel/debug", NULL);
	}
	mount_in_root("devtmpfs", "/dev", NULL);
	mount_in_root("tmpfs", "/tmp", NULL);
	if (mount_in_root("tmpfs", "/run", "mode=0755") == 0)
		mkdir(NEWROOT "/run/hvprobe", 0755); /* in the tmpfs */
	if (mount("/hvprobe", NEWROOT "/run/hvprobe", NULL, MS_BIND, NULL) != 0) {
		if (!interactive)
			root_fail("cannot bind the workload's /hvprobe at /run/hvprobe", errno);
		root_say("cannot bind /hvprobe at /run/hvprobe", errno);
	}
}

/*
 * A host directory shared read-only through virtio-fs (`hvprobe.rootfs=TAG`,
 * the VMM's --rootfs) as the workload's root: an overlay of it under a tmpfs,
 * so the workload may write anywhere and the host's files never change.
 */
static void mount_shared_root(const char *tag, int interactive)
{
	char what[512] = "";

	mkdir(SHARED_LOWER, 0755);
	if (mount(tag, SHARED_LOWER, "virtiofs", MS_RDONLY, NULL) != 0)
		root_fail(append(what, sizeof(what), "cannot mount the shared directory ", tag,
				 " (virtio-fs)", (char *)NULL),
			  errno);
	mkdir(SHARED_RW, 0755);
	if (mount("tmpfs", SHARED_RW, "tmpfs", 0, "mode=0755") != 0)
		root_fail("cannot mount the overlay's tmpfs", errno);
	mkdir(SHARED_RW "/upper", 0755);
	mkdir(SHARED_RW "/work", 0755);
	mkdir(NEWROOT, 0755);
	if (mount("overlay", NEWROOT, "overlay", 0,
		  "lowerdir=" SHARED_LOWER ",upperdir=" SHARED_RW "/upper,workdir=" SHARED_RW "/work") != 0)
		root_fail("cannot mount the overlay of the shared root", errno);
	root_mounted = 1;
	mount_api_filesystems(interactive);
}

/* Makes every missing directory of `path` (absolute); 0 or an errno. */
static int make_dirs(char *path)
{
	char *p;

	for (p = path + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = 0;
		if (mkdir(path, 0755) != 0 && errno != EEXIST) {
			*p = '/';
			return errno;
		}
		*p = '/';
	}
	if (mkdir(path, 0755) != 0 && errno != EEXIST)
		return errno;
	return 0;
}

/*
 * Every `hvprobe.rwdir=TAG:GUESTPATH` (the VMM's --rwdir): the host directory
 * shared read-write through virtio-fs, mounted at GUESTPATH in the workload's
 * root (NEWROOT when there is one), its directories made if missing.
 */
static void mount_rwdirs(void)
{
	const char *cmdline = cmdline_text(), *p, *v;
	size_t len = strlen(RWDIR_OPTION), n;

	for (p = cmdline; (p = strstr(p, RWDIR_OPTION)); p += len) {
		char word[256], path[512] = "", what[768] = "";
		char *colon;
		int err;

		if (p != cmdline && p[-1] != ' ')
			continue;
		v = p + len;
		for (n = 0; !word_end(v[n]); n++)
			;
		if (n >= sizeof(word))
			root_fail("an hvprobe.rwdir= option is too long", ENAMETOOLONG);
		memcpy(word, v, n);
		word[n] = 0;
		colon = strchr(word, ':');
		if (!colon || colon[1] != '/')
			root_fail(append(what, sizeof(what), "hvprobe.rwdir=", word,
					 " is not TAG:/GUESTPATH", (char *)NULL),
				  EINVAL);
		*colon = 0;
		append(path, sizeof(path), root_mounted ? NEWROOT : "", colon + 1, (char *)NULL);
		err = make_dirs(path);
		if (!err && mount(word, path, "virtiofs", 0, NULL) != 0)
			err = errno;
		if (err)
			root_fail(append(what, sizeof(what), "cannot mount the shared directory ", word,
					 " at ", colon + 1, (char *)NULL),
				  err);
	}
}

/* ---- pid 1 ----------------------------------------------------------------- */

/*
 * busybox poweroff/halt/reboot without -f signal pid 1 (vm_exit and
 * root_shutdown are async-signal-safe).  vm_exit does not return: with a
 * disk root the shell is gone by then, and a VMM that stops the VM a little
 * later (QEMU's isa-debug-exit) must see status 0, not the shell's end.
 */
static void on_signal(int sig)
{
	if (sig == SIGUSR1 || sig == SIGUSR2) /* halt, poweroff */
		vm_exit(0);
	if (sig == SIGTERM) { /* reboot */
		root_shutdown();
		sync();
		reboot(RB_AUTOBOOT);
	}
}

/*
 * A kernel booted with `noxsave` (hvprobe's kvm_pvm fix-ups: KVM's emulator
 * cannot run XSAVE at CPL0) saves and restores only the x87/SSE registers of
 * a task, but AVX instructions still execute in user mode there, and on
 * some hosts user mode's CPUID says AVX too: the upper halves of YMM/ZMM and
 * the opmask registers would pass from one process to the next. glibc's
 * string functions use them where CPUID says AVX (busybox is static glibc),
 * so keep glibc on its SSE2 code whatever CPUID says. A program that uses AVX
 * by itself is not covered (README).
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

/* what failed in the vfork child (it shares our memory until it execs) */
static const char *volatile child_failed;
static volatile int child_errno;

int main(int argc, char **argv)
{
	const char *name = argc > 0 && argv[0] ? argv[0] : "init";
	const char *slash = strrchr(name, '/');
	/*
	 * Login shells ("-sh") read /etc/profile, which routes the power
	 * commands to /sbin/{poweroff,halt,reboot} (busybox sh prefers its
	 * applets).  A disk root's /etc/profile is the disk's own.
	 */
	static char *const wl_argv[] = { "-sh", WORKLOAD, NULL };
	static char *const root_wl_argv[] = { "-sh", ROOT_WORKLOAD, NULL };
	static char *const sh_argv[] = { "-sh", NULL };
	char *const *argv_child;
	struct sigaction sa;
	struct stat st;
	int interactive, waited = 0;
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
	load_modules();

	interactive = stat(WORKLOAD, &st) != 0;
	if (interactive && cmdline_has(WAIT_OPTION)) {
		if (receive_workload() != 0)
			vm_exit(125);
		interactive = 0;
		waited = 1;
	}
	if (cmdline_value(ROOT_OPTION, root_dev, sizeof(root_dev)) && root_dev[0])
		mount_root(interactive, waited);
	else if (cmdline_value(ROOTFS_OPTION, root_tag, sizeof(root_tag)) && root_tag[0])
		mount_shared_root(root_tag, interactive);
	mount_rwdirs();
	if (cmdline_has("noxsave"))
		child_env[6] = NO_AVX_TUNABLES;
	say(interactive ? "hvprobe-init: interactive shell\n"
			: "hvprobe-init: running workload\n");
	argv_child = interactive ? sh_argv : root_mounted ? root_wl_argv : wl_argv;

	child = vfork();
	if (child == 0) {
		/* only async-signal-safe system calls between vfork and exec */
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
		} else {
			fd = open("/dev/null", O_RDONLY);
			if (fd >= 0 && fd != 0) {
				dup2(fd, 0);
				close(fd);
			}
		}
		/* the tty and /dev/null above are the initramfs's: the disk may lack /dev */
		if (root_mounted && chroot(NEWROOT) != 0) {
			child_failed = "chroot " NEWROOT;
		} else if (root_mounted && chdir("/") != 0) {
			child_failed = "chdir / in " NEWROOT;
		} else {
			execve(SHELL, argv_child, child_env);
			child_failed = "cannot run " SHELL;
		}
		child_errno = errno;
		_exit(127);
	}
	if (child < 0) {
		say("hvprobe-init: vfork failed\n");
		vm_exit(125);
	}
	if (child_failed) {
		char line[512] = "";

		waitpid(child, NULL, 0);
		say(append(line, sizeof(line), "hvprobe-init: ", child_failed,
			   root_mounted ? " on " : "", root_mounted ? root_dev : "", ": ",
			   strerror(child_errno), "\n", (char *)NULL));
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
