//! `vcpu::exit_regs` on a real vCPU: reads and writes go through kvm_run's sync area
//! without an ioctl, and a flush hands a write to KVM. Needs /dev/kvm (no guest runs).

use hvprobe_vmm::exit_regs::{disable, enable, flush, read, supported, write};
use kvm_ioctls::Kvm;

#[test]
fn reads_and_writes_go_through_the_sync_area_and_a_flush_reaches_the_ioctls() {
    let kvm = Kvm::new().unwrap_or_else(|e| panic!("this test needs /dev/kvm: {e}"));
    assert!(supported(&kvm), "KVM here has no sync area for general registers");
    let vm = kvm.create_vm().expect("KVM_CREATE_VM");
    let mut vcpu = vm.create_vcpu(0).expect("KVM_CREATE_VCPU");
    let mut regs = vcpu.get_regs().unwrap();
    regs.rax = 0x1111;
    vcpu.set_regs(&regs).unwrap();
    // Off: the ioctls.
    assert_eq!(read(&mut vcpu).unwrap().rax, 0x1111);
    enable(&mut vcpu, false).unwrap();
    assert_eq!(
        read(&mut vcpu).unwrap().rax,
        0x1111,
        "the area is seeded when it is turned on"
    );
    regs.rax = 0x2222;
    write(&mut vcpu, &regs).unwrap();
    assert_eq!(read(&mut vcpu).unwrap().rax, 0x2222);
    assert_eq!(vcpu.get_regs().unwrap().rax, 0x1111, "a write makes no ioctl");
    flush(&mut vcpu).unwrap();
    assert_eq!(vcpu.get_regs().unwrap().rax, 0x2222, "a flush hands the write to KVM");
    regs.rax = 0x3333;
    write(&mut vcpu, &regs).unwrap();
    disable(&mut vcpu).unwrap();
    assert_eq!(vcpu.get_regs().unwrap().rax, 0x3333, "turning the area off flushes it");
    assert_eq!(read(&mut vcpu).unwrap().rax, 0x3333);
}

#[test]
fn segment_registers_go_through_the_area_too_and_a_flush_hands_them_to_kvm() {
    use hvprobe_vmm::exit_regs::{read_sregs, sregs_supported, write_sregs};
    let kvm = Kvm::new().unwrap_or_else(|e| panic!("this test needs /dev/kvm: {e}"));
    assert!(sregs_supported(&kvm), "KVM here has no sync area for segment registers");
    let vm = kvm.create_vm().expect("KVM_CREATE_VM");
    let mut vcpu = vm.create_vcpu(0).expect("KVM_CREATE_VCPU");
    let mut sregs = vcpu.get_sregs().unwrap();
    sregs.idt.base = 0x1000;
    vcpu.set_sregs(&sregs).unwrap();
    enable(&mut vcpu, true).unwrap();
    assert_eq!(read_sregs(&mut vcpu).unwrap().idt.base, 0x1000, "seeded when turned on");
    sregs.idt.base = 0x2000;
    write_sregs(&mut vcpu, &sregs).unwrap();
    assert_eq!(read_sregs(&mut vcpu).unwrap().idt.base, 0x2000);
    assert_eq!(vcpu.get_sregs().unwrap().idt.base, 0x1000, "a write makes no ioctl");
    hvprobe_vmm::exit_regs::flush_regs(&mut vcpu).unwrap();
    assert_eq!(
        vcpu.get_sregs().unwrap().idt.base,
        0x1000,
        "flush_regs leaves them to the entry"
    );
    flush(&mut vcpu).unwrap();
    assert_eq!(
        vcpu.get_sregs().unwrap().idt.base,
        0x2000,
        "a flush hands the write to KVM"
    );
    sregs.idt.base = 0x3000;
    write_sregs(&mut vcpu, &sregs).unwrap();
    disable(&mut vcpu).unwrap();
    assert_eq!(
        vcpu.get_sregs().unwrap().idt.base,
        0x3000,
        "turning the area off flushes it"
    );
    assert_eq!(read_sregs(&mut vcpu).unwrap().idt.base, 0x3000);
}
