//! The queues of a virtio-fs device whose backend is gone: hvprobe answers every request
//! in them with a FUSE error, EIO, so that the guest's file operations on the share fail
//! instead of waiting for ever (virtio-fs has no timeout), and its workload goes on.
//!
//! Where the backend stopped: virtiofsd without a thread pool (hvprobe starts it so, see
//! `virtiofsd_args`) takes each queue's requests one at a time and answers them in the
//! order it took them, so a queue's used index is also where its unanswered requests
//! start: every request from there to the available index is answered, those the backend
//! had taken but not answered included (an operation the daemon may or may not have done
//! before it died: an I/O error is what the guest should see for it).

use std::sync::atomic::Ordering;

use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap};

/// FUSE's error for every request (`-EIO` in the reply header).
const EIO: i32 = 5;
/// `struct fuse_in_header` starts with its length, opcode and unique id (16 bytes).
const IN_HEADER_PREFIX: usize = 16;
/// `struct fuse_out_header`: length, error, unique id.
const OUT_HEADER_LEN: usize = 16;

/// A backend's queues, taken over.
pub(super) struct Orphaned {
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
}

impl Orphaned {
    /// Takes `queues` (as the driver set them up) over from where the backend left them.
    pub(super) fn take_over(mem: GuestMemoryMmap, mut queues: Vec<Queue>) -> Orphaned {
        for queue in &mut queues {
            // A used ring outside RAM: serve() finds the queue broken.
            if let Ok(used) = queue.used_idx(&mem, Ordering::Acquire) {
                queue.set_next_avail(used.0);
                queue.set_next_used(used.0);
            }
        }
        Orphaned { mem, queues }
    }

    pub(super) fn queue_count(&self) -> usize {
        self.queues.len()
    }

    /// Answers every request available in queue `index` (until `stopping`); says whether
    /// the driver is to be interrupted.
    pub(super) fn serve(
        &mut self,
        index: usize,
        stopping: &std::sync::atomic::AtomicBool,
    ) -> Result<bool, virtio_queue::Error> {
        let Some(queue) = self.queues.get_mut(index) else {
            return Ok(false);
        };
        let mem = &self.mem;
        let used_any = super::super::serve_available(mem, queue, stopping, |chain| answer_eio(mem, chain))?;
        Ok(used_any && queue.needs_notification(mem)?)
    }
}

/// Answers one request with a reply header saying EIO; returns the bytes written. A
/// request with no device-writable buffer (FORGET, BATCH_FORGET, INTERRUPT on the
/// high-priority queue) gets no reply, as from a backend; one too short for a FUSE header,
/// or with a device-readable buffer after a writable one (2.7.4.2), is returned with
/// nothing written.
pub fn answer_eio<M: GuestMemory>(mem: &M, chain: DescriptorChain<&M>) -> u32 {
    // The chain ends at a loop, a bad index or the end of its table (virtio-queue's
    // iterator stops there): at most 65,535 descriptors, through an indirect table.
    let descriptors: Vec<Descriptor> = chain.collect();
    let readable = descriptors.iter().take_while(|d| !d.is_write_only()).count();
    let (request, reply) = descriptors.split_at(readable);
    let mut header = [0u8; IN_HEADER_PREFIX];
    if reply.is_empty() || reply.iter().any(|d| !d.is_write_only()) || !gather(mem, request, &mut header) {
        return 0;
    }
    let mut out = [0u8; OUT_HEADER_LEN];
    out[..4].copy_from_slice(&(OUT_HEADER_LEN as u32).to_le_bytes());
    out[4..8].copy_from_slice(&(-EIO).to_le_bytes());
    out[8..].copy_from_slice(&header[8..16]);
    if scatter(mem, reply, &out) {
        OUT_HEADER_LEN as u32
    } else {
        0
    }
}

/// Fills `buf` from the start of `descriptors`' buffers; false when they are shorter or
/// not in RAM.
fn gather<M: GuestMemory>(mem: &M, descriptors: &[Descriptor], buf: &mut [u8]) -> bool {
    let mut filled = 0;
    for d in descriptors {
        if filled == buf.len() {
            break;
        }
        let take = (buf.len() - filled).min(d.len() as usize);
        if mem.read_slice(&mut buf[filled..filled + take], d.addr()).is_err() {
            return false;
        }
        filled += take;
    }
    filled == buf.len()
}

/// Writes `data` at the start of `descriptors`' buffers; false when they are shorter or
/// not in RAM.
fn scatter<M: GuestMemory>(mem: &M, descriptors: &[Descriptor], data: &[u8]) -> bool {
    let room: u64 = descriptors.iter().map(|d| u64::from(d.len())).sum();
    if room < data.len() as u64 {
        return false;
    }
    let mut written = 0;
    for d in descriptors {
        if written == data.len() {
            break;
        }
        let take = (data.len() - written).min(d.len() as usize);
        if mem
            .write_slice(&data[written..written + take], GuestAddress(d.addr().0))
            .is_err()
        {
            return false;
        }
        written += take;
    }
    true
}
