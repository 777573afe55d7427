/* The L1's one idle KVM VM, held from its boot to its power-off (guest/l1/init).
 *
 * KVM turns the scheduler's preempt-notifier static key on when the first VM is created
 * and off when the last is destroyed, so every L2 the lane runs one after the other made
 * the L1 kernel patch finish_task_switch() twice (text_poke_bp: an int3, IPIs, the new
 * bytes). Under QEMU's TCG both L1 CPUs once ran that int3 after the patch had ended and
 * the L1 died ("Oops: int3" in finish_task_switch, docs/known-issues.md). With one VM
 * alive the key stays on and the L1 never patches that code while the lane runs.
 */
#include <fcntl.h>
#include <linux/kvm.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <unistd.h>

int main(void)
{
    int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
    if (kvm < 0) {
        perror("hvprobe-l1: hold-vm: /dev/kvm");
        return 1;
    }
    if (ioctl(kvm, KVM_CREATE_VM, 0) < 0) {
        perror("hvprobe-l1: hold-vm: KVM_CREATE_VM");
        return 1;
    }
    /* The VM is held: tell the waiting init, then sleep until the L1 powers off. */
    if (write(STDOUT_FILENO, "held\n", 5) != 5)
        return 1;
    close(STDOUT_FILENO);
    for (;;)
        pause();
}
