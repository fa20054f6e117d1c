//! A tracing subscriber that hands each event it takes to a function, as one
//! line `LEVEL field=value ...`.

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Takes the events `wanted` accepts, from every thread, and hands each to
/// `line` as one line of text.
#[derive(Debug)]
pub struct LineSubscriber {
    /// Which events to take.
    pub wanted: fn(&Metadata<'_>) -> bool,
    /// What to do with each one's line.
    pub line: fn(String),
}

struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        let _ = write!(self.0, " {}={:?}", field.name(), value);
    }
}

impl Subscriber for LineSubscriber {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        (self.wanted)(m)
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, e: &Event<'_>) {
        let mut line = Line(e.metadata().level().to_string());
        e.record(&mut line);
        (self.line)(line.0);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// The number a line gives field `name` (` name=42`), if it has one.
pub fn u64_field(line: &str, name: &str) -> Option<u64> {
    let (_, rest) = line.split_once(&format!(" {name}="))?;
    let digits = rest.split(|c: char| !c.is_ascii_digit()).next()?;
    digits.parse().ok()
}
