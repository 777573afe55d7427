//! The host CPU-feature hash a snapshot records must not depend on which host CPU computes
//! it (KVM fills some CPUID fields from the CPU the ioctl runs on).

use hvprobe_vmm::snapshot::host_cpuid_hash;
use kvm_ioctls::Kvm;

#[test]
fn host_cpuid_hash_is_the_same_on_every_host_cpu() {
    let kvm = Kvm::new().expect("this test needs /dev/kvm");
    // SAFETY: sysconf has no preconditions.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    let mut hashes = Vec::new();
    for cpu in 0..cpus.min(64) {
        // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity get
        // valid pointers to it.
        let pinned = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        };
        if pinned {
            for _ in 0..3 {
                hashes.push((cpu, host_cpuid_hash(&kvm).unwrap()));
            }
        }
    }
    assert!(!hashes.is_empty());
    assert!(
        hashes.iter().all(|h| h.1 == hashes[0].1),
        "hash differs between host CPUs: {hashes:x?}"
    );
}
