use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use accel_api::{
    Buf, BufMut, Communicator, CommunicatorExt, ConnectContext, ErrorKind, ProbeContext, ReduceOp,
    Store, StoreExt,
};
use accel_plugin::load_plugin;
use accel_rendezvous::MemoryStore;

use crate::common::{err, with_plugins};

fn connect(
    plugin: &Path,
    store: &Arc<MemoryStore>,
    run_id: &str,
) -> accel_api::Result<Box<dyn Communicator>> {
    load_plugin(plugin).unwrap().connect(
        ConnectContext::local(0, 1, Duration::from_secs(5), store.clone()).with_run_id(run_id),
    )
}

#[test]
fn the_plugin_rendezvous_through_every_host_store_method() {
    with_plugins(|p| {
        let store = Arc::new(MemoryStore::new());
        let comm = connect(&p.fixture, &store, "store-roundtrip").unwrap();
        let report = store
            .get_string("fixture/report", Duration::from_secs(1))
            .unwrap();
        assert_eq!(
            report,
            format!(
                "get=alpha try_get=None try_get_a=Some(\"alpha\") add=5,3 \
                 cas=swapped,current:one,swapped,absent delete=true,false describe={}",
                store.describe()
            )
        );
        // What the plugin wrote is in the host's store.
        assert_eq!(store.try_get("fixture/n").unwrap(), Some(b"3".to_vec()));
        assert_eq!(store.try_get("fixture/c").unwrap(), Some(b"two".to_vec()));
        assert_eq!(store.try_get("fixture/a").unwrap(), None);
        drop(comm);
        assert_eq!(
            Arc::strong_count(&store),
            1,
            "the plugin released the store"
        );
    });
}

#[test]
fn a_host_store_error_crosses_twice_with_its_kind() {
    with_plugins(|p| {
        let store = Arc::new(MemoryStore::new());
        let e = err(connect(&p.fixture, &store, "store-timeout"));
        assert_eq!(
            e.kind(),
            &ErrorKind::Timeout {
                after: Duration::from_millis(100)
            },
            "{e}"
        );
        assert!(e.to_string().contains("fixture/never-set"), "{e}");
        assert_eq!(e.op(), Some("store get"), "{e}");
        assert_eq!(e.backend(), Some("fixture"), "{e}");
        assert!(e.fix().is_some(), "{e}");
        assert_eq!(Arc::strong_count(&store), 1, "released on failure too");
    });
}

#[test]
fn the_plugin_keeps_the_store_for_the_communicator_lifetime() {
    with_plugins(|p| {
        let store = Arc::new(MemoryStore::new());
        let comm = connect(&p.fixture, &store, "keep").unwrap();
        assert_eq!(Arc::strong_count(&store), 2);
        comm.barrier().unwrap();
        comm.barrier().unwrap();
        assert_eq!(
            store.try_get("fixture/barriers").unwrap(),
            Some(b"2".to_vec())
        );
        drop(comm);
        assert_eq!(Arc::strong_count(&store), 1);
    });
}

/// The host wraps every plugin communicator in the generic group: bad
/// arguments are refused on this side, and the plugin never sees them.
#[test]
fn bad_arguments_are_refused_before_the_plugin_is_called() {
    with_plugins(|p| {
        let store = Arc::new(MemoryStore::new());
        let comm = connect(&p.fixture, &store, "keep").unwrap();
        let calls = || {
            store
                .try_get("fixture/calls")
                .unwrap()
                .map(|v| String::from_utf8(v).unwrap())
        };
        let e = comm.broadcast_slice(&mut [1.0f32], 3).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("root 3"), "{e}");
        let mut out = [0i32; 5];
        let e = comm
            .all_gather(Buf::from(&[1i32, 2][..]), BufMut::from(&mut out[..]))
            .unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        let e = comm.send_slice(&[1u8], 1, 0).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        let e = comm.reduce_scatter_vec(&[1.0f32, 2.0], ReduceOp::Sum);
        assert!(e.is_ok(), "a valid call still works: {e:?}");
        assert_eq!(
            calls(),
            Some("1".to_string()),
            "only the valid call crossed"
        );
        let e = comm
            .scatter(None, BufMut::from(&mut out[..]), 0)
            .unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert_eq!(calls(), Some("1".to_string()));
    });
}

#[test]
fn a_panicking_connect_is_a_plugin_error() {
    with_plugins(|p| {
        let store = Arc::new(MemoryStore::new());
        let e = err(connect(&p.fixture, &store, "connect-panic"));
        match e.kind() {
            ErrorKind::Plugin { path, symbol } => {
                assert_eq!(path, &p.fixture);
                assert_eq!(symbol.as_deref(), Some("connect"));
            }
            other => panic!("expected a plugin error, got {other:?}: {e}"),
        }
        let text = e.to_string();
        assert!(
            text.contains("plugin panicked in connect: fixture connect panics on request"),
            "{text}"
        );
        assert!(text.contains(&*p.fixture.to_string_lossy()), "{text}");
        assert_eq!(Arc::strong_count(&store), 1, "released while unwinding");
    });
}

#[test]
fn a_panicking_probe_is_reported_unavailable_with_the_path() {
    with_plugins(|p| {
        let b = load_plugin(&p.fixture).unwrap();
        assert_eq!(b.name(), "fixture");
        for _ in 0..3 {
            let probe = b.probe(&ProbeContext::single_process());
            assert!(!probe.is_available());
            let reason = probe.reason().unwrap();
            assert!(
                reason.starts_with("plugin panicked in probe: fixture probe always panics"),
                "{reason}"
            );
            assert!(reason.contains(&*p.fixture.to_string_lossy()), "{reason}");
        }
        // The process, and the plugin, go on.
        let store = Arc::new(MemoryStore::new());
        connect(&p.fixture, &store, "keep")
            .unwrap()
            .barrier()
            .unwrap();
    });
}
