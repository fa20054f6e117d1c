//! accel-plugin integration tests: real `dlopen` of real cdylibs.
//!
//! * `vendor`: the example plugin (`vendor-single`) through the boundary,
//!   every collective and the errors;
//! * `store`: the fixture plugin calling the host's store from `connect`
//!   and keeping it;
//! * `failures`: every way loading can fail, each reported with the path
//!   and the reason, and a plugin directory with good and broken files.
//!
//! See `common.rs` for how the plugins are built and found.

mod common;
mod failures;
use accel_test_support::special_files;
mod store;
mod vendor;
