//! Where a run's hit events go: its printer and every `hvprobe trace` stream, through the
//! events' filters and triggers first. No consumer ever blocks a vCPU.

use super::*;

/// Where hit events go: the run's printer, and every live `hvprobe trace` stream. No
/// consumer ever blocks a vCPU: a full queue drops the event for that consumer alone (the
/// printer's drops are the probe's nmissed; a stream's are counted for that stream).
pub(super) struct EventFanout {
    pub(super) printer: Mutex<Option<SyncSender<HitEvent>>>,
    pub(super) streams: Mutex<Vec<EventStream>>,
    /// The events' filters and triggers, set before any probe is armed (when there are
    /// any): every hit goes through them first.
    pub(super) analysis: OnceLock<Arc<AnalysisTable>>,
}

/// One `hvprobe trace` client's queue.
pub(super) struct EventStream {
    pub(super) tx: SyncSender<HitEvent>,
    pub(super) dropped: Arc<AtomicU64>,
}

/// A subscription to hit events: the events as they come, and how many were dropped
/// because the queue was full.
pub struct Subscription {
    pub events: Receiver<HitEvent>,
    pub dropped: Arc<AtomicU64>,
    /// The run's `--sym-offset`, for stack frames in text.
    pub sym_offset: bool,
}

impl EventSink for EventFanout {
    fn try_send(&self, mut event: HitEvent) -> bool {
        if let Some(analysis) = self.analysis.get() {
            if !analysis.observe(&mut event.record) {
                // Filtered out: counted by the filter, not missed.
                return true;
            }
        }
        {
            let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
            streams.retain(|s| match s.tx.try_send(event.clone()) {
                Ok(()) => true,
                Err(TrySendError::Full(_)) => {
                    s.dropped.fetch_add(1, Ordering::Relaxed);
                    true
                }
                Err(TrySendError::Disconnected(_)) => false,
            });
        }
        let printer = self.printer.lock().unwrap_or_else(|e| e.into_inner());
        match printer.as_ref() {
            Some(tx) => tx.try_send(event).is_ok(),
            // Nobody prints (`--format none`): the event is delivered to whoever streams.
            None => true,
        }
    }
}

impl EventFanout {
    /// Ends every stream and the printer's queue: their consumers see the end once they
    /// have taken what is queued.
    pub(super) fn close(&self) {
        self.streams.lock().unwrap_or_else(|e| e.into_inner()).clear();
        *self.printer.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}
