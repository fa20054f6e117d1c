//! Bounded fuzzing of the TCP store's wire format: `Request::decode`,
//! `Response::decode` and `read_frame` on arbitrary bytes and on mutated
//! valid messages never panic, allocate no more than a small multiple of the
//! bytes they were given (never what a length field announces), accept only
//! canonical encodings, and honour the frame bound.
//!
//! `ACCEL_FUZZ_SECONDS=600 cargo test -p accel-rendezvous --test fuzz_wire
//! -- --test-threads=1 --nocapture` runs each property for that long.

use std::io::{self, Cursor, Read};
use std::time::Duration;

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

// The wire module is private to the crate: compile it into this test.
#[allow(dead_code)]
#[path = "../src/tcp/wire.rs"]
mod wire;

use accel_test_support::{fuzz::budget, fuzz::mutate};

use mutate::{apply, Mutation};
use wire::{read_frame, FrameError, Request, Response, WireErrorKind, MAGIC, MAX_FRAME};

/// Counts what the current thread allocates while [`measure`] runs.
mod alloc_count {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static ON: Cell<bool> = const { Cell::new(false) };
        static TOTAL: Cell<usize> = const { Cell::new(0) };
        static LARGEST: Cell<usize> = const { Cell::new(0) };
    }

    fn note(size: usize) {
        // `try_with`: the thread may be tearing its locals down.
        if ON.try_with(Cell::get).unwrap_or(false) {
            let _ = TOTAL.try_with(|t| t.set(t.get().saturating_add(size)));
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    }

    /// The system allocator, noting each request's size first.
    pub struct Counting;

    // SAFETY: every method forwards its arguments unchanged to `System`,
    // which upholds `GlobalAlloc`'s contract; `note` neither allocates nor
    // panics (const-initialised `Cell` thread locals).
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            // SAFETY: the caller's `layout` contract is passed on as is.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            // SAFETY: as `alloc`.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: `ptr` was allocated by `System` with `layout`.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            note(new_size);
            // SAFETY: `ptr` was allocated by `System` with `layout`.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    /// Run `f`, returning its result, the bytes it requested in all, and
    /// its largest single request (reallocations count their new size).
    pub fn measure<T>(f: impl FnOnce() -> T) -> (T, usize, usize) {
        TOTAL.with(|t| t.set(0));
        LARGEST.with(|l| l.set(0));
        ON.with(|o| o.set(true));
        let out = f();
        ON.with(|o| o.set(false));
        (out, TOTAL.with(Cell::get), LARGEST.with(Cell::get))
    }
}

#[global_allocator]
static ALLOC: alloc_count::Counting = alloc_count::Counting;

/// What decoding `len` bytes may allocate in all: the decoded fields (at
/// most the payload itself, plus `String` headers for a key list: 24 bytes
/// per 4-byte length) and one error message.
fn decode_budget(len: usize) -> usize {
    8 * len + 4096
}

fn check_decode(payload: &[u8]) -> Result<(), TestCaseError> {
    check_decoder("Request", payload, Request::decode, check_canonical_request)?;
    check_decoder(
        "Response",
        payload,
        Response::decode,
        check_canonical_response,
    )
}

/// `decode` (`what::decode`) of `payload` stays within the allocation
/// budget, and what it accepts passes `canonical`.
fn check_decoder<T, E>(
    what: &str,
    payload: &[u8],
    decode: impl FnOnce(&[u8]) -> Result<T, E>,
    canonical: impl FnOnce(&T, &[u8]) -> Result<(), TestCaseError>,
) -> Result<(), TestCaseError> {
    let (msg, total, _) = alloc_count::measure(|| decode(payload));
    prop_assert!(
        total <= decode_budget(payload.len()),
        "{what}::decode of {} bytes allocated {total} bytes",
        payload.len()
    );
    if let Ok(m) = &msg {
        canonical(m, payload)?;
    }
    Ok(())
}

/// A message's encoding as a whole frame (header included).
fn reencode(encoded: Result<Vec<u8>, usize>) -> Result<Vec<u8>, TestCaseError> {
    encoded.map_err(|n| TestCaseError::fail(format!("re-encode: {n} bytes")))
}

/// A decoded request encodes back to the very bytes it came from (the
/// decoder accepts one spelling per message), except a foreign hello, which
/// is decoded without reading past its magic or version.
fn check_canonical_request(r: &Request, payload: &[u8]) -> Result<(), TestCaseError> {
    if let Request::Hello { magic, version, .. } = r {
        if *magic != MAGIC || *version != 1 {
            return Ok(());
        }
    }
    let f = reencode(r.encode())?;
    prop_assert_eq!(&f[4..], payload, "{:?} is not canonical", r);
    Ok(())
}

fn check_canonical_response(r: &Response, payload: &[u8]) -> Result<(), TestCaseError> {
    let f = reencode(r.encode())?;
    if let Response::Error { .. } = r {
        // Unknown error-kind codes read as `Protocol`: compare all but that byte.
        prop_assert_eq!(f.len() - 4, payload.len());
        prop_assert_eq!(&f[6..], &payload[2..]);
        return Ok(());
    }
    prop_assert_eq!(&f[4..], payload, "{:?} is not canonical", r);
    Ok(())
}

// ------------------------------------------------------------ strategies

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z/0-9]{0,12}",
        any::<String>().prop_map(|s| s.chars().take(16).collect()),
    ]
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..64)
}

fn timeout() -> impl Strategy<Value = Duration> {
    prop_oneof![
        (0u64..100_000).prop_map(Duration::from_millis),
        Just(Duration::from_millis(u64::MAX)),
    ]
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        proptest::option::of("[ -~]{0,40}").prop_map(|t| Request::hello(t.as_deref())),
        (key(), bytes()).prop_map(|(key, value)| Request::Set { key, value }),
        (key(), timeout()).prop_map(|(key, timeout)| Request::Get { key, timeout }),
        key().prop_map(|key| Request::TryGet { key }),
        (key(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        (key(), proptest::option::of(bytes()), bytes()).prop_map(|(key, expected, desired)| {
            Request::CompareSet {
                key,
                expected,
                desired,
            }
        }),
        (vec(key(), 0..8), timeout()).prop_map(|(keys, timeout)| Request::Wait { keys, timeout }),
        key().prop_map(|key| Request::Delete { key }),
    ]
}

fn response() -> impl Strategy<Value = Response> {
    let kind = prop_oneof![
        Just(WireErrorKind::Corrupt),
        Just(WireErrorKind::InvalidArgument),
        Just(WireErrorKind::Protocol),
    ];
    prop_oneof![
        Just(Response::Ok),
        bytes().prop_map(Response::Value),
        proptest::option::of(bytes()).prop_map(Response::Maybe),
        any::<i64>().prop_map(Response::Int),
        any::<bool>().prop_map(Response::Bool),
        Just(Response::Swapped),
        vec(key(), 0..8).prop_map(|missing| Response::Timeout { missing }),
        (kind, key()).prop_map(|(kind, message)| Response::Error { kind, message }),
        key().prop_map(|message| Response::Refused { message }),
        any::<u16>().prop_map(|server_version| Response::VersionMismatch { server_version }),
        Just(Response::Busy {
            message: "full".into()
        }),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let big = prop_oneof![
        Just(u32::MAX),
        Just(MAX_FRAME),
        Just(MAX_FRAME + 1),
        Just(1u32 << 31),
        0u32..64,
        any::<u32>(),
    ];
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::SetByte(i, b)),
        (any::<usize>(), big).prop_map(|(i, v)| Mutation::SetU32(i, v)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), vec(any::<u8>(), 1..16)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), 1usize..8).prop_map(|(i, n)| Mutation::Remove(i, n)),
    ]
}

/// A payload: arbitrary bytes, arbitrary bytes after a real opcode, or an
/// encoded message with a few mutations.
fn payload() -> impl Strategy<Value = Vec<u8>> {
    let encoded = prop_oneof![
        request().prop_map(|r| r.encode().unwrap()[4..].to_vec()),
        response().prop_map(|r| r.encode().unwrap()[4..].to_vec()),
    ];
    let opcodes: Vec<u8> = (0x01..=0x08)
        .chain(0x80..=0x85)
        .chain(0x90..=0x94)
        .collect();
    prop_oneof![
        vec(any::<u8>(), 0..256),
        (proptest::sample::select(opcodes), vec(any::<u8>(), 0..128)).prop_map(|(op, mut rest)| {
            rest.insert(0, op);
            rest
        }),
        (encoded, vec(mutation(), 0..4)).prop_map(|(p, m)| apply(p, &m)),
    ]
}

// ------------------------------------------------------------ properties

#[test]
fn decoding_any_payload_never_panics_and_stays_within_its_bytes() {
    budget::fuzz("wire/decode", 4000, payload(), |p| check_decode(&p));
}

#[test]
fn every_valid_message_roundtrips() {
    let msg = prop_oneof![
        request().prop_map(|r| (Some(r), None)),
        response().prop_map(|r| (None, Some(r))),
    ];
    budget::fuzz("wire/roundtrip", 2000, msg, |(req, resp)| {
        if let Some(r) = req {
            let f = r.encode().unwrap();
            let p = read_frame(&mut Cursor::new(&f), MAX_FRAME).unwrap();
            prop_assert_eq!(Request::decode(&p).unwrap(), r);
        }
        if let Some(r) = resp {
            let f = r.encode().unwrap();
            let p = read_frame(&mut Cursor::new(&f), MAX_FRAME).unwrap();
            prop_assert_eq!(Response::decode(&p).unwrap(), r);
        }
        Ok(())
    });
}

/// Hands out `data` in the given chunk sizes, with an `Interrupted` error
/// between chunks now and then, and optionally a reset at the end.
struct Chunked {
    data: Vec<u8>,
    pos: usize,
    chunks: Vec<usize>,
    next: usize,
    interrupt: bool,
    reset_at_end: bool,
}

impl Read for Chunked {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.interrupt && self.next % 3 == 1 {
            self.next += 1;
            return Err(io::ErrorKind::Interrupted.into());
        }
        if self.pos == self.data.len() {
            return if self.reset_at_end {
                Err(io::ErrorKind::ConnectionReset.into())
            } else {
                Ok(0)
            };
        }
        let chunk = self
            .chunks
            .get(self.next % self.chunks.len().max(1))
            .copied();
        self.next += 1;
        let n = chunk
            .unwrap_or(usize::MAX)
            .clamp(1, buf.len())
            .min(self.data.len() - self.pos);
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

#[test]
fn reading_any_frame_never_panics_and_honours_the_bound() {
    let header = prop_oneof![
        0u32..600,
        Just(wire::MAX_HELLO_FRAME),
        Just(wire::MAX_HELLO_FRAME + 1),
        Just(MAX_FRAME),
        Just(MAX_FRAME + 1),
        Just(u32::MAX),
        any::<u32>(),
    ];
    let max = prop_oneof![Just(wire::MAX_HELLO_FRAME), Just(MAX_FRAME), 0u32..300];
    let input = (
        header,
        proptest::option::of(0usize..4),
        vec(any::<u8>(), 0..600),
        vec(1usize..300, 0..6),
        any::<bool>(),
        any::<bool>(),
        max,
    );
    budget::fuzz(
        "wire/read_frame",
        3000,
        input,
        |(len, cut, body, chunks, interrupt, reset_at_end, max)| {
            let mut data = len.to_le_bytes().to_vec();
            // Sometimes cut the header itself short.
            if let Some(c) = cut {
                data.truncate(c);
            }
            let had_header = data.len() == 4;
            if had_header {
                data.extend_from_slice(&body);
            }
            let sent = data.len();
            let mut r = Chunked {
                data,
                pos: 0,
                chunks,
                next: 0,
                interrupt,
                reset_at_end,
            };
            let (got, total, _) = alloc_count::measure(|| read_frame(&mut r, max));
            // Never more than what arrived (twice, for `Vec` doubling) plus
            // the first 64 KiB reservation: not the announced length.
            let bound = 2 * sent + 64 * 1024 + 4096;
            prop_assert!(
                total <= bound,
                "read_frame allocated {total} bytes for {sent} bytes announcing {len}"
            );
            match got {
                Ok(p) => {
                    prop_assert!(had_header && len <= max);
                    prop_assert_eq!(p.len(), len as usize);
                    prop_assert_eq!(&p[..], &body[..len as usize]);
                }
                Err(FrameError::TooLarge { len: l, max: m }) => {
                    prop_assert!(had_header && len > max);
                    prop_assert_eq!((l, m), (len, max));
                }
                Err(FrameError::Closed) => prop_assert_eq!(sent, 0),
                Err(FrameError::Io(_)) => {
                    prop_assert!(!had_header || (len as usize > body.len() && len <= max));
                }
            }
            Ok(())
        },
    );
}

/// The live server's hello path (the event loop's reader, the token check)
/// on arbitrary and mutated first bytes, sent in arbitrary pieces: it never
/// dies, and a real client still gets in afterwards.
#[test]
fn the_server_survives_any_bytes_before_its_hello() {
    use accel_rendezvous::{ServerLimits, TcpStore, TcpStoreServer};
    use std::io::Write;
    use std::net::{Shutdown, TcpListener, TcpStream};

    const TOKEN: &str = "fuzz-token";
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let limits = ServerLimits {
        handshake_timeout: Duration::from_millis(200),
        ..ServerLimits::default()
    };
    let server = TcpStoreServer::from_listener_with(listener, Some(TOKEN.into()), limits).unwrap();
    let addr = server.local_addr();
    let hello = |token: Option<&str>| Request::hello(token).encode().unwrap();
    let first_bytes = prop_oneof![
        4 => vec(any::<u8>(), 0..64),
        4 => (vec(mutation(), 1..4), any::<bool>()).prop_map(move |(m, good)| {
            let f = hello(if good { Some(TOKEN) } else { Some("nope") });
            apply(f, &m)
        }),
        1 => Just(hello(Some(TOKEN))),
    ];
    let input = (first_bytes, vec(1usize..16, 1..4), any::<bool>());
    budget::fuzz(
        "wire/server-hello",
        150,
        input,
        |(bytes, pieces, half_close)| {
            let mut s = TcpStream::connect(addr).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut rest = &bytes[..];
            let mut i = 0;
            while !rest.is_empty() {
                let n = pieces[i % pieces.len()].min(rest.len());
                if s.write_all(&rest[..n]).is_err() {
                    break;
                }
                rest = &rest[n..];
                i += 1;
            }
            if half_close {
                let _ = s.shutdown(Shutdown::Write);
            }
            // The server either takes the client (its reply is `Ok` and the
            // connection stays open) or closes the connection within its
            // handshake deadline, after one short reply at most.
            s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let ok = Response::Ok.encode().unwrap();
            let mut reply = Vec::new();
            let mut buf = [0u8; 256];
            loop {
                match s.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => reply.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == io::ErrorKind::ConnectionReset => break,
                    Err(e) => {
                        return Err(TestCaseError::fail(format!(
                            "neither answered nor closed within 3 s ({e}); got {reply:?}"
                        )))
                    }
                }
                if reply == ok {
                    break;
                }
                prop_assert!(reply.len() < 1024, "a {}-byte reply", reply.len());
            }
            if reply == ok {
                // Taken: only a complete hello with the right token is.
                prop_assert!(bytes.starts_with(&hello(Some(TOKEN))), "took {:?}", bytes);
            }
            Ok(())
        },
    );
    let c = TcpStore::connect(addr, Some(TOKEN), Duration::from_secs(10)).unwrap();
    accel_api::Store::set(&c, "still", b"serving").unwrap();
}
