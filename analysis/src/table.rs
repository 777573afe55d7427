//! Every event's filter and hist triggers, built once before the probes are armed and
//! consulted for each hit as it reaches the host.
//!
//! Per hit, as the kernel's `__event_trigger_test_discard`: the event's triggers see the
//! hit first (each with its own `if` filter), then the event's filter decides whether the
//! hit goes on (to the printer and `hvprobe trace` streams) or is counted as filtered out.
//! A filter or trigger belongs to an event's name for the whole run.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use hvprobe_introspection::symbols::SymbolTable;
use hvprobe_probes::detour::event::filter::RecordFilter;
use hvprobe_probes::output::HitRecord;
use hvprobe_probes::spec::FetchArg;

use crate::fields::EventFields;
use crate::filter::Filter;
use crate::hist::Histogram;
use crate::request::{Origin, Request, RequestBody, RequestError, RequestErrorKind};
use crate::stacktrace::StacktraceTrigger;

/// An event the requests may name: its name and its fetch-args.
#[derive(Clone, Copy, Debug)]
pub struct EventSchema<'a> {
    pub group: &'a str,
    pub event: &'a str,
    pub args: &'a [FetchArg],
}

/// One event's filter and triggers.
#[derive(Debug)]
pub struct EventAnalysis {
    group: String,
    event: String,
    filter: Option<Filter>,
    filtered: AtomicU64,
    hists: Vec<Mutex<Histogram>>,
    stacktraces: Vec<StacktraceTrigger>,
}

impl EventAnalysis {
    /// Runs the triggers on `hit`, then the filter: whether the hit goes on. The hit
    /// keeps the kernel stack the engine unwound for it only when a `stacktrace` trigger
    /// fires.
    pub fn observe(&self, hit: &mut HitRecord) -> bool {
        for hist in &self.hists {
            hist.lock().unwrap_or_else(|e| e.into_inner()).record(hit);
        }
        // Every trigger sees the hit (each uses up its own count).
        let fired = self.stacktraces.iter().fold(false, |any, t| t.fires(hit) | any);
        if !fired {
            hit.stack = None;
        }
        match &self.filter {
            Some(filter) if !filter.matches(hit) => {
                self.filtered.fetch_add(1, Ordering::Relaxed);
                false
            }
            _ => true,
        }
    }

    /// `GRP/EVENT`.
    pub fn name(&self) -> String {
        format!("{}/{}", self.group, self.event)
    }

    /// Hits the filter discarded; `None` without a filter.
    pub fn filtered(&self) -> Option<u64> {
        self.filter.as_ref().map(|_| self.filtered.load(Ordering::Relaxed))
    }

    /// The event's `hist` file: each trigger's histogram, separated by a blank line, as
    /// the kernel's `hist_show`.
    pub fn hist_file(&self, symbols: Option<&SymbolTable>) -> String {
        self.snapshots()
            .iter()
            .map(|h| h.render(symbols))
            .collect::<Vec<_>>()
            .join("\n\n")
    }

    /// A copy of each histogram: sorting and printing one then holds up no hit.
    fn snapshots(&self) -> Vec<Histogram> {
        self.hists
            .iter()
            .map(|h| h.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .collect()
    }
}

/// FNV-1a: event names are short and chosen by the user, not an attacker, and every hit
/// looks its event up (SipHash took about a third of a filtered hit's host time).
#[derive(Default)]
struct NameHasher(u64);

impl Hasher for NameHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 { 0xcbf2_9ce4_8422_2325 } else { self.0 };
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = h;
    }
}

type ByName<V> = HashMap<String, V, BuildHasherDefault<NameHasher>>;

/// Every event's filter and triggers, by event name.
#[derive(Debug, Default)]
pub struct AnalysisTable {
    by_group: ByName<ByName<EventAnalysis>>,
    /// The events with a filter or a trigger, in the order they were given.
    order: Vec<(String, String)>,
}

impl AnalysisTable {
    /// Binds every request to the events it names (each must name one, and its fields
    /// must exist there), or returns every problem.
    pub fn build(requests: &[Request], events: &[EventSchema]) -> Result<AnalysisTable, Vec<RequestError>> {
        let mut table = AnalysisTable::default();
        let mut filter_origin: HashMap<(String, String), Origin> = HashMap::new();
        let mut problems = Vec::new();
        for request in requests {
            let matching: Vec<&EventSchema> = events
                .iter()
                .filter(|e| request.event.matches(e.group, e.event))
                .collect();
            if matching.is_empty() {
                problems.push(request.error_at_event(RequestErrorKind::NoSuchEvent(request.event.to_string())));
                continue;
            }
            for schema in matching {
                let fields = EventFields::new(schema.args);
                let key = (schema.group.to_owned(), schema.event.to_owned());
                let bound = match &request.body {
                    RequestBody::Filter(expr) => expr
                        .bind(&fields)
                        .map(Bound::Filter)
                        .map_err(|e| request.error_in_body(e.offset, RequestErrorKind::Filter(e.kind))),
                    RequestBody::Hist(spec) => spec
                        .bind(&fields)
                        .map(Bound::Hist)
                        .map_err(|e| request.error_in_body(e.offset, RequestErrorKind::Trigger(e.kind))),
                    RequestBody::Stacktrace(spec) => spec
                        .bind(&fields)
                        .map(Bound::Stacktrace)
                        .map_err(|e| request.error_in_body(e.offset, RequestErrorKind::Trigger(e.kind))),
                };
                let bound = match bound {
                    Ok(b) => b,
                    Err(e) => {
                        // One error per request, not one per event it names.
                        problems.push(e);
                        break;
                    }
                };
                let analysis = table.entry(schema);
                match bound {
                    Bound::Filter(filter) => {
                        if let Some(first) = filter_origin.get(&key) {
                            problems.push(request.error_at_event(RequestErrorKind::TwoFilters {
                                event: format!("{}/{}", key.0, key.1),
                                first: first.to_string(),
                            }));
                            continue;
                        }
                        filter_origin.insert(key, request.origin.clone());
                        analysis.filter = Some(filter);
                    }
                    Bound::Hist(trigger) => analysis.hists.push(Mutex::new(Histogram::new(trigger))),
                    Bound::Stacktrace(trigger) => analysis.stacktraces.push(trigger),
                }
            }
        }
        if problems.is_empty() {
            Ok(table)
        } else {
            Err(problems)
        }
    }

    fn entry(&mut self, schema: &EventSchema) -> &mut EventAnalysis {
        let events = self.by_group.entry(schema.group.to_owned()).or_default();
        if !events.contains_key(schema.event) {
            self.order.push((schema.group.to_owned(), schema.event.to_owned()));
        }
        events.entry(schema.event.to_owned()).or_insert_with(|| EventAnalysis {
            group: schema.group.to_owned(),
            event: schema.event.to_owned(),
            filter: None,
            filtered: AtomicU64::new(0),
            hists: Vec::new(),
            stacktraces: Vec::new(),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The filter and triggers of `GRP/EVENT`, if it has any.
    pub fn get(&self, group: &str, event: &str) -> Option<&EventAnalysis> {
        self.by_group.get(group)?.get(event)
    }

    /// Runs `hit`'s event's triggers and filter: whether the hit goes on.
    pub fn observe(&self, hit: &mut HitRecord) -> bool {
        match self.by_group.get(&hit.group).and_then(|g| g.get(&hit.event)) {
            Some(a) => a.observe(hit),
            None => true,
        }
    }

    /// The filter of `GRP/EVENT` as the event detour of its probe (with `args`) can run it
    /// in the guest ([`Filter::record_filter`]); `None` without a filter, and when the event
    /// has a trigger: a trigger sees every hit, also those the filter discards, so they
    /// must all reach the host.
    pub fn record_filter(&self, group: &str, event: &str, args: &[FetchArg]) -> Option<RecordFilter> {
        let a = self.get(group, event)?;
        if !a.hists.is_empty() || !a.stacktraces.is_empty() {
            return None;
        }
        Some(a.filter.as_ref()?.record_filter(args))
    }

    /// Whether `GRP/EVENT` has a `stacktrace` trigger or a hist keyed by `stacktrace`: its
    /// probe must unwind the kernel stack at every hit.
    pub fn wants_stacks(&self, group: &str, event: &str) -> bool {
        self.get(group, event).is_some_and(|a| {
            !a.stacktraces.is_empty()
                || a.hists
                    .iter()
                    .any(|h| h.lock().unwrap_or_else(|e| e.into_inner()).trigger().needs_stack())
        })
    }

    /// The events with a filter or a trigger, in the order they were given.
    pub fn events(&self) -> impl Iterator<Item = &EventAnalysis> {
        self.order.iter().filter_map(|(g, e)| self.get(g, e))
    }

    /// Hits discarded by all filters.
    pub fn total_filtered(&self) -> u64 {
        self.events().filter_map(EventAnalysis::filtered).sum()
    }

    /// Every event's `hist` file, each after a `==> events/GRP/EVENT/hist <==` line (as
    /// `head` prints several files); empty without hist triggers.
    pub fn hist_files(&self, symbols: Option<&SymbolTable>) -> String {
        self.events()
            .filter(|a| !a.hists.is_empty())
            .map(|a| format!("==> events/{}/hist <==\n{}", a.name(), a.hist_file(symbols)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every histogram as one JSON line: `{"hist":{"event":"GRP/EVENT","trigger":...,
    /// "entries":[...],"totals":{...}}}`.
    pub fn hist_json_lines(&self, symbols: Option<&SymbolTable>) -> Vec<String> {
        let mut lines = Vec::new();
        for a in self.events() {
            for h in a.snapshots() {
                let mut json = h.to_json(symbols);
                if let Some(object) = json.as_object_mut() {
                    object.insert("event".into(), a.name().into());
                }
                lines.push(serde_json::json!({ "hist": json }).to_string());
            }
        }
        lines
    }
}

enum Bound {
    Filter(Filter),
    Hist(crate::hist::HistTrigger),
    Stacktrace(StacktraceTrigger),
}

#[cfg(test)]
mod tests;
