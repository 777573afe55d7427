//! Hit timestamps. Invariant: **every hit is stamped with the one clock chosen for the
//! tracer** — the guest's trace clock ([`TraceClock::Local`] by default, or `Global`) once
//! it is attached, else host time since the tracer started — a trapped hit at the moment
//! the host handles it ([`Tracer::timestamp_ns`], the single source of a trapped hit's
//! stamp), a hit an event detour recorded at the guest TSC its record carries. A guest
//! clock that cannot give a stamp gives host time, the reason logged once.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::Tracer;
use crate::clock::{ClockError, GuestClock, TraceClock};

/// The clocks [`Tracer::set_trace_clock`] chooses from, by index (the default first).
pub(super) const TRACE_CLOCKS: [TraceClock; 3] = [TraceClock::Local, TraceClock::Global, TraceClock::Host];

/// Which clock gave a stamp: two stamps measure a time between them only when it is the
/// same (the trace clock can be switched, and a guest clock that fails gives host time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StampClock {
    Guest { global: bool },
    Host,
}

/// A hit's time and the clock that gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub ns: u64,
    pub clock: StampClock,
}

impl Stamp {
    /// Nanoseconds from `earlier` to this stamp; `None` when another clock gave `earlier`,
    /// or the clock ran backwards between them (a per-CPU clock read on two CPUs).
    pub(crate) fn since(&self, earlier: &Stamp) -> Option<u64> {
        (self.clock == earlier.clock).then_some(())?;
        self.ns.checked_sub(earlier.ns)
    }
}

impl Tracer {
    /// The time stamped on a hit taken now, in nanoseconds: one clock for every trapped
    /// hit (a kprobe, a return, a return's entry). The guest's trace clock when it is
    /// attached and chosen ([`Tracer::set_trace_clock`]), else host time since the tracer
    /// started.
    #[cfg(test)]
    pub(crate) fn timestamp_ns(&self) -> u64 {
        self.stamp().ns
    }

    /// [`Tracer::timestamp_ns`] with the clock that gave it.
    pub(crate) fn stamp(&self) -> Stamp {
        match self.stamping_guest_clock() {
            Some((clock, global)) => {
                match clock
                    .now_ns()
                    .and_then(|local| if global { clock.global_ns(local) } else { Ok(local) })
                {
                    Ok(ns) => Stamp {
                        ns,
                        clock: StampClock::Guest { global },
                    },
                    Err(e) => Stamp {
                        ns: self.host_stamp_instead(&e),
                        clock: StampClock::Host,
                    },
                }
            }
            None => Stamp {
                ns: self.host_timestamp_ns(),
                clock: StampClock::Host,
            },
        }
    }

    /// The time stamped on a hit an event detour recorded on `cpu` at guest TSC `tsc`: the
    /// guest's trace clock at that TSC (the hit's own time) when that clock stamps hits,
    /// else `host_now`, the host time of the drain that took it.
    pub(crate) fn record_timestamp_ns(&self, cpu: usize, tsc: u64, host_now: u64) -> u64 {
        match self.stamping_guest_clock() {
            Some((clock, global)) => clock
                .ns_at_guest_tsc(cpu, tsc)
                .and_then(|local| if global { clock.global_ns(local) } else { Ok(local) })
                .unwrap_or_else(|e| self.host_stamp_instead(&e)),
            None => host_now,
        }
    }

    /// Nanoseconds on the guest's clock from guest TSC `from` to `to` on `cpu` (an
    /// exit-free return's `$duration`); `None` without a guest clock, or when `to` is
    /// before `from`.
    pub(crate) fn tsc_span_ns(&self, cpu: usize, from: u64, to: u64) -> Option<u64> {
        let clock = self.guest_clock.get()?;
        let (a, b) = (
            clock.ns_at_guest_tsc(cpu, from).ok()?,
            clock.ns_at_guest_tsc(cpu, to).ok()?,
        );
        b.checked_sub(a)
    }

    /// Host time since the tracer started, in nanoseconds.
    pub(crate) fn host_timestamp_ns(&self) -> u64 {
        self.started.elapsed().as_nanos() as u64
    }

    /// The guest clock that stamps hits, and whether it is its `global` one.
    fn stamping_guest_clock(&self) -> Option<(&GuestClock, bool)> {
        let clock = self.guest_clock.get()?;
        match TRACE_CLOCKS.get(usize::from(self.trace_clock.load(Ordering::Relaxed))) {
            Some(TraceClock::Local) => Some((clock, false)),
            Some(TraceClock::Global) => Some((clock, true)),
            _ => None,
        }
    }

    /// A stamp the guest's clock could not give (it never had a good read of a kvm-clock
    /// page): host time, the reason logged once.
    fn host_stamp_instead(&self, e: &ClockError) -> u64 {
        if !self.warned_clock.swap(true, Ordering::Relaxed) {
            tracing::warn!("guest clock: {e}: stamping hits with host time instead (logged once)");
        }
        self.host_timestamp_ns()
    }

    /// Gives the tracer the guest's trace clock (see [`crate::clock`]); hits are stamped
    /// with it from now on unless [`TraceClock::Host`] is chosen. Refused, and host time
    /// kept, when it cannot stamp a hit now.
    pub fn attach_guest_clock(&self, clock: Arc<GuestClock>) -> Result<(), ClockError> {
        clock.now_ns()?;
        tracing::info!("guest trace clock: {}", clock.describe());
        let _ = self.guest_clock.set(clock);
        Ok(())
    }

    /// The guest's trace clock, when one is attached.
    pub fn guest_clock(&self) -> Option<&Arc<GuestClock>> {
        self.guest_clock.get()
    }

    /// Chooses the clock hits are stamped with (ftrace's `trace_clock`). A guest clock
    /// needs [`Tracer::attach_guest_clock`] first, and `global` where the guest keeps
    /// `__sched_clock_offset`: refused (the choice unchanged) without them. (A `global`
    /// stamp while the guest's sched_clock is not marked stable is host time, logged.)
    pub fn set_trace_clock(&self, clock: TraceClock) -> Result<(), ClockError> {
        let guest = self.guest_clock.get();
        match (clock, guest) {
            (TraceClock::Host, _) => {}
            (_, None) => return Err(ClockError::NotAttached),
            (TraceClock::Global, Some(g)) if !g.has_global() => {
                return Err(ClockError::NoGlobalClock(
                    "the guest's __sched_clock_offset is not known",
                ));
            }
            (TraceClock::Global, Some(_)) => {}
            (TraceClock::Local, Some(_)) => {}
        }
        let index = TRACE_CLOCKS.iter().position(|c| *c == clock).unwrap_or(0);
        self.trace_clock.store(index as u8, Ordering::Relaxed);
        Ok(())
    }

    /// The clock hits are stamped with now.
    pub fn trace_clock(&self) -> TraceClock {
        match self.stamping_guest_clock() {
            Some((_, false)) => TraceClock::Local,
            Some((_, true)) => TraceClock::Global,
            None => TraceClock::Host,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_between_two_stamps_needs_one_clock_running_forward() {
        let guest = |ns| Stamp {
            ns,
            clock: StampClock::Guest { global: false },
        };
        assert_eq!(guest(1_500).since(&guest(1_000)), Some(500));
        // A per-CPU clock read on two CPUs may run backwards: no time, not 0.
        assert_eq!(guest(900).since(&guest(1_000)), None);
        // The trace clock switched, or the guest's clock failed and host time stamped one.
        let host = Stamp {
            ns: 1_500,
            clock: StampClock::Host,
        };
        assert_eq!(host.since(&guest(1_000)), None);
        let global = Stamp {
            ns: 1_500,
            clock: StampClock::Guest { global: true },
        };
        assert_eq!(global.since(&guest(1_000)), None);
    }
}
