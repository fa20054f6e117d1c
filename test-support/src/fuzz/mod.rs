//! The bounded fuzz harnesses' driver ([`budget`]) and the byte-level edits
//! of their inputs ([`mutate`]); docs/fuzzing.md.

pub mod budget;
pub mod mutate;
