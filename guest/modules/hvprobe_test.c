// SPDX-License-Identifier: GPL-2.0
/*
 * hvprobe_test: a small module for hvprobe's module-probe tests, built with the
 * bundled guest and shipped in its initramfs as /usr/lib/hvprobe/hvprobe_test.ko.
 *
 * Each read() of /proc/hvprobe_test calls hvprobe_test_work() once with the
 * length asked for (the file is one digit and a newline: a shell's
 * `read -r l < /proc/hvprobe_test` reads a byte at a time, two calls).
 * hvprobe_test_init() calls hvprobe_test_work() HVPROBE_TEST_INIT_CALLS times, so a
 * probe armed before the module's init ran sees those calls. hvprobe_test_noprobe()
 * is on the module's own kprobe blacklist (NOKPROBE_SYMBOL).
 */
#include <linux/kprobes.h>
#include <linux/module.h>
#include <linux/proc_fs.h>
#include <linux/uaccess.h>

#define HVPROBE_TEST_INIT_CALLS 3

static unsigned long hvprobe_test_total;

/* Not inlined, so that it is a function of its own with a symbol and ORC data. */
static noinline unsigned long hvprobe_test_work(unsigned long n)
{
	hvprobe_test_total += n;
	return hvprobe_test_total * 2 + 1;
}

static noinline unsigned long hvprobe_test_noprobe(unsigned long n)
{
	return READ_ONCE(hvprobe_test_total) ^ n;
}
NOKPROBE_SYMBOL(hvprobe_test_noprobe);

static ssize_t hvprobe_test_read(struct file *file, char __user *buf, size_t len, loff_t *pos)
{
	unsigned long v = hvprobe_test_work(len) + hvprobe_test_noprobe(len);

	char c = *pos == 0 ? '0' + (char)(v % 10) : '\n';

	if (*pos > 1 || len == 0)
		return 0;
	if (put_user(c, buf))
		return -EFAULT;
	*pos += 1;
	return 1;
}

static const struct proc_ops hvprobe_test_ops = {
	.proc_read = hvprobe_test_read,
	.proc_lseek = default_llseek,
};

static int __init hvprobe_test_init(void)
{
	int i;

	for (i = 1; i <= HVPROBE_TEST_INIT_CALLS; i++)
		hvprobe_test_work(100 + i);
	if (!proc_create("hvprobe_test", 0444, NULL, &hvprobe_test_ops))
		return -ENOMEM;
	return 0;
}

static void __exit hvprobe_test_exit(void)
{
	remove_proc_entry("hvprobe_test", NULL);
}

module_init(hvprobe_test_init);
module_exit(hvprobe_test_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("hvprobe's module-probe test module");
