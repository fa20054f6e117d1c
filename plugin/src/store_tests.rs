//! The host's store as a plugin sees it, through the ABI both ways (the
//! host's vtable, the plugin's `ForeignStore`), passes every store
//! scenario (`accel_rendezvous::testkit`), in one process (no dlopen).

use std::sync::Arc;

use accel_rendezvous::testkit::Fixture;
use accel_rendezvous::{store_scenarios, FileStore, MemoryStore};

use crate::load::across_the_abi as across;

mod memory {
    use super::*;
    store_scenarios!(Fixture::new(across(Arc::new(MemoryStore::new())), ()));
}

mod file {
    use super::*;
    store_scenarios!({
        let dir = tempfile::tempdir().unwrap();
        let store = across(Arc::new(FileStore::new(dir.path()).unwrap()));
        Fixture::new(store, dir)
    });
}
