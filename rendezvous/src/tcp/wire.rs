//! The TCP store's wire format: length-prefixed binary frames.
//!
//! A frame is a `u32` little-endian payload length followed by the payload.
//! A payload is one opcode byte followed by fields:
//!
//! * integers are little-endian (`u16`, `u32`, `u64`, `i64`);
//! * strings and byte strings are a `u32` length followed by the bytes
//!   (strings are UTF-8);
//! * an optional field is a `u8` flag (0 absent, 1 present) then the field;
//! * a list of strings is a `u32` count then the strings;
//! * timeouts are `u64` milliseconds, rounded up.
//!
//! Every length is checked against what is left of the frame before anything
//! is allocated, and frames longer than [`MAX_FRAME`] (or [`MAX_HELLO_FRAME`]
//! before authentication) are refused.

use std::io::{self, Read, Write};
use std::time::Duration;

/// Bytes that open every hello, so that a stray client (an HTTP probe, a
/// port scanner, a Gloo peer dialling the wrong port) is told apart.
pub(crate) const MAGIC: [u8; 8] = *b"ACCELRDV";
/// The protocol version this build speaks; the server refuses others.
pub(crate) const PROTOCOL_VERSION: u16 = 1;
/// The largest frame payload either side accepts: 1 GiB.
pub(crate) const MAX_FRAME: u32 = 1 << 30;
/// The largest first frame the server accepts from a not yet authenticated
/// client.
pub(crate) const MAX_HELLO_FRAME: u32 = 64 * 1024;

mod op {
    pub const HELLO: u8 = 0x01;
    pub const SET: u8 = 0x02;
    pub const GET: u8 = 0x03;
    pub const TRY_GET: u8 = 0x04;
    pub const ADD: u8 = 0x05;
    pub const COMPARE_SET: u8 = 0x06;
    pub const WAIT: u8 = 0x07;
    pub const DELETE: u8 = 0x08;

    pub const OK: u8 = 0x80;
    pub const VALUE: u8 = 0x81;
    pub const MAYBE: u8 = 0x82;
    pub const INT: u8 = 0x83;
    pub const BOOL: u8 = 0x84;
    pub const SWAPPED: u8 = 0x85;
    pub const TIMEOUT: u8 = 0x90;
    pub const ERROR: u8 = 0x91;
    pub const REFUSED: u8 = 0x92;
    pub const VERSION_MISMATCH: u8 = 0x93;
    pub const BUSY: u8 = 0x94;
}

/// A client's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    Hello {
        magic: [u8; 8],
        version: u16,
        token: Option<String>,
    },
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
        timeout: Duration,
    },
    TryGet {
        key: String,
    },
    Add {
        key: String,
        delta: i64,
    },
    CompareSet {
        key: String,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    },
    Wait {
        keys: Vec<String>,
        timeout: Duration,
    },
    Delete {
        key: String,
    },
}

/// The kind carried by [`Response::Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WireErrorKind {
    /// The key holds something else than the operation needs.
    Corrupt,
    /// The request was well formed but cannot be carried out.
    InvalidArgument,
    /// The request or frame itself was bad.
    Protocol,
}

impl WireErrorKind {
    fn code(self) -> u8 {
        match self {
            WireErrorKind::Corrupt => 1,
            WireErrorKind::InvalidArgument => 2,
            WireErrorKind::Protocol => 3,
        }
    }
    fn from_code(c: u8) -> WireErrorKind {
        match c {
            1 => WireErrorKind::Corrupt,
            2 => WireErrorKind::InvalidArgument,
            _ => WireErrorKind::Protocol,
        }
    }
}

/// The server's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Response {
    /// Hello accepted, set done, wait satisfied.
    Ok,
    /// `get`'s value.
    Value(Vec<u8>),
    /// `try_get`'s value, or `compare_set`'s current value when it did not swap.
    Maybe(Option<Vec<u8>>),
    /// `add`'s new value.
    Int(i64),
    /// `delete`: whether the key existed.
    Bool(bool),
    /// `compare_set` swapped.
    Swapped,
    /// `get` / `wait` timed out; these keys are still missing.
    Timeout { missing: Vec<String> },
    /// The request failed.
    Error {
        kind: WireErrorKind,
        message: String,
    },
    /// The hello was refused (token); the server closes the connection.
    Refused { message: String },
    /// The hello's protocol version is not the server's.
    VersionMismatch { server_version: u16 },
    /// The hello was good but the server is at its connection limit; the
    /// server closes the connection and the client may try again later.
    Busy { message: String },
}

/// A payload that does not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError(pub(crate) String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The peer closed the connection cleanly between two frames.
    Closed,
    /// The announced length exceeds the limit; nothing was allocated and the
    /// connection must be dropped (the stream is no longer in sync).
    TooLarge { len: u32, max: u32 },
    /// A socket error, a read timeout, or a connection closed mid-frame.
    Io(io::Error),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Closed => f.write_str("connection closed"),
            FrameError::TooLarge { len, max } => {
                write!(f, "frame of {len} bytes exceeds the limit of {max} bytes")
            }
            FrameError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Read one frame's payload, refusing lengths above `max`.
pub(crate) fn read_frame(r: &mut impl Read, max: u32) -> Result<Vec<u8>, FrameError> {
    let mut header = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => {
                return Err(FrameError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed in the middle of a frame header",
                )))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let len = u32::from_le_bytes(header);
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    // Grow with the bytes that actually arrive: a peer announcing a large
    // frame and sending nothing costs nothing.
    let mut buf = Vec::with_capacity((len as usize).min(64 * 1024));
    r.take(u64::from(len))
        .read_to_end(&mut buf)
        .map_err(FrameError::Io)?;
    if buf.len() != len as usize {
        return Err(FrameError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "connection closed in the middle of a frame ({} of {len} bytes)",
                buf.len()
            ),
        )));
    }
    Ok(buf)
}

/// Write an already encoded frame (see [`Request::encode`]).
pub(crate) fn write_frame(w: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    w.write_all(frame)?;
    w.flush()
}

/// Builds a frame: reserves the length prefix, fills it in `finish`.
struct Enc(Vec<u8>);

impl Enc {
    fn new(opcode: u8) -> Enc {
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(&[0, 0, 0, 0, opcode]);
        Enc(v)
    }
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u16(&mut self, x: u16) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn i64(&mut self, x: i64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        // Lengths above u32::MAX are caught by `finish` (frame > MAX_FRAME).
        self.0
            .extend_from_slice(&u32::try_from(b.len()).unwrap_or(u32::MAX).to_le_bytes());
        self.0.extend_from_slice(b);
    }
    fn opt_bytes(&mut self, b: Option<&[u8]>) {
        match b {
            None => self.u8(0),
            Some(b) => {
                self.u8(1);
                self.bytes(b);
            }
        }
    }
    fn strings(&mut self, v: &[String]) {
        self.0
            .extend_from_slice(&u32::try_from(v.len()).unwrap_or(u32::MAX).to_le_bytes());
        for s in v {
            self.bytes(s.as_bytes());
        }
    }
    fn duration(&mut self, d: Duration) {
        let ms = d.as_nanos().div_ceil(1_000_000);
        self.u64(u64::try_from(ms).unwrap_or(u64::MAX));
    }
    /// The whole frame, or the payload length when it exceeds [`MAX_FRAME`].
    fn finish(mut self) -> Result<Vec<u8>, usize> {
        let len = self.0.len() - 4;
        match u32::try_from(len) {
            Ok(l) if l <= MAX_FRAME => {
                self.0[..4].copy_from_slice(&l.to_le_bytes());
                Ok(self.0)
            }
            _ => Err(len),
        }
    }
}

/// Reads fields from a payload, never past its end.
struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError(format!(
                "truncated {what}: needs {n} bytes, {} left",
                self.0.len()
            )));
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Ok(h)
    }
    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, DecodeError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn i64(&mut self, what: &str) -> Result<i64, DecodeError> {
        Ok(self.u64(what)? as i64)
    }
    fn bytes(&mut self, what: &str) -> Result<Vec<u8>, DecodeError> {
        let n = self.u32(what)? as usize;
        Ok(self.take(n, what)?.to_vec())
    }
    fn string(&mut self, what: &str) -> Result<String, DecodeError> {
        String::from_utf8(self.bytes(what)?)
            .map_err(|_| DecodeError(format!("{what} is not UTF-8")))
    }
    fn opt_bytes(&mut self, what: &str) -> Result<Option<Vec<u8>>, DecodeError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.bytes(what)?)),
            f => Err(DecodeError(format!("bad presence flag {f} for {what}"))),
        }
    }
    fn opt_string(&mut self, what: &str) -> Result<Option<String>, DecodeError> {
        self.opt_bytes(what)?
            .map(|b| String::from_utf8(b).map_err(|_| DecodeError(format!("{what} is not UTF-8"))))
            .transpose()
    }
    fn strings(&mut self, what: &str) -> Result<Vec<String>, DecodeError> {
        let n = self.u32(what)? as usize;
        // Each string takes at least its 4-byte length: bound the allocation
        // by what the payload can actually hold.
        let mut v = Vec::with_capacity(n.min(self.0.len() / 4));
        for _ in 0..n {
            v.push(self.string(what)?);
        }
        Ok(v)
    }
    fn duration(&mut self, what: &str) -> Result<Duration, DecodeError> {
        Ok(Duration::from_millis(self.u64(what)?))
    }
    fn end(self) -> Result<(), DecodeError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(DecodeError(format!(
                "{} unexpected trailing bytes",
                self.0.len()
            )))
        }
    }
}

impl Request {
    /// A hello from this build.
    pub(crate) fn hello(token: Option<&str>) -> Request {
        Request::Hello {
            magic: MAGIC,
            version: PROTOCOL_VERSION,
            token: token.map(str::to_string),
        }
    }

    /// The whole frame, or the payload length when it exceeds [`MAX_FRAME`].
    pub(crate) fn encode(&self) -> Result<Vec<u8>, usize> {
        let e = match self {
            Request::Hello {
                magic,
                version,
                token,
            } => {
                let mut e = Enc::new(op::HELLO);
                e.0.extend_from_slice(magic);
                e.u16(*version);
                e.opt_bytes(token.as_deref().map(str::as_bytes));
                e
            }
            Request::Set { key, value } => {
                let mut e = Enc::new(op::SET);
                e.bytes(key.as_bytes());
                e.bytes(value);
                e
            }
            Request::Get { key, timeout } => {
                let mut e = Enc::new(op::GET);
                e.bytes(key.as_bytes());
                e.duration(*timeout);
                e
            }
            Request::TryGet { key } => {
                let mut e = Enc::new(op::TRY_GET);
                e.bytes(key.as_bytes());
                e
            }
            Request::Add { key, delta } => {
                let mut e = Enc::new(op::ADD);
                e.bytes(key.as_bytes());
                e.i64(*delta);
                e
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                let mut e = Enc::new(op::COMPARE_SET);
                e.bytes(key.as_bytes());
                e.opt_bytes(expected.as_deref());
                e.bytes(desired);
                e
            }
            Request::Wait { keys, timeout } => {
                let mut e = Enc::new(op::WAIT);
                e.strings(keys);
                e.duration(*timeout);
                e
            }
            Request::Delete { key } => {
                let mut e = Enc::new(op::DELETE);
                e.bytes(key.as_bytes());
                e
            }
        };
        e.finish()
    }

    /// Decode a frame payload.
    pub(crate) fn decode(payload: &[u8]) -> Result<Request, DecodeError> {
        let mut d = Dec(payload);
        let opcode = d.u8("opcode")?;
        let r = match opcode {
            op::HELLO => {
                let mut magic = [0u8; 8];
                magic.copy_from_slice(d.take(8, "magic")?);
                if magic != MAGIC {
                    // Do not read further: another protocol's bytes.
                    return Ok(Request::Hello {
                        magic,
                        version: 0,
                        token: None,
                    });
                }
                let version = d.u16("version")?;
                if version != PROTOCOL_VERSION {
                    // A later version may lay the rest out differently.
                    return Ok(Request::Hello {
                        magic,
                        version,
                        token: None,
                    });
                }
                Request::Hello {
                    magic,
                    version,
                    token: d.opt_string("token")?,
                }
            }
            op::SET => Request::Set {
                key: d.string("key")?,
                value: d.bytes("value")?,
            },
            op::GET => Request::Get {
                key: d.string("key")?,
                timeout: d.duration("timeout")?,
            },
            op::TRY_GET => Request::TryGet {
                key: d.string("key")?,
            },
            op::ADD => Request::Add {
                key: d.string("key")?,
                delta: d.i64("delta")?,
            },
            op::COMPARE_SET => Request::CompareSet {
                key: d.string("key")?,
                expected: d.opt_bytes("expected value")?,
                desired: d.bytes("desired value")?,
            },
            op::WAIT => Request::Wait {
                keys: d.strings("keys")?,
                timeout: d.duration("timeout")?,
            },
            op::DELETE => Request::Delete {
                key: d.string("key")?,
            },
            other => return Err(DecodeError(format!("unknown request opcode {other:#04x}"))),
        };
        d.end()?;
        Ok(r)
    }
}

impl Response {
    /// The whole frame, or the payload length when it exceeds [`MAX_FRAME`].
    pub(crate) fn encode(&self) -> Result<Vec<u8>, usize> {
        let e = match self {
            Response::Ok => Enc::new(op::OK),
            Response::Value(v) => {
                let mut e = Enc::new(op::VALUE);
                e.bytes(v);
                e
            }
            Response::Maybe(v) => {
                let mut e = Enc::new(op::MAYBE);
                e.opt_bytes(v.as_deref());
                e
            }
            Response::Int(i) => {
                let mut e = Enc::new(op::INT);
                e.i64(*i);
                e
            }
            Response::Bool(b) => {
                let mut e = Enc::new(op::BOOL);
                e.u8(u8::from(*b));
                e
            }
            Response::Swapped => Enc::new(op::SWAPPED),
            Response::Timeout { missing } => {
                let mut e = Enc::new(op::TIMEOUT);
                e.strings(missing);
                e
            }
            Response::Error { kind, message } => {
                let mut e = Enc::new(op::ERROR);
                e.u8(kind.code());
                e.bytes(message.as_bytes());
                e
            }
            Response::Refused { message } => {
                let mut e = Enc::new(op::REFUSED);
                e.bytes(message.as_bytes());
                e
            }
            Response::VersionMismatch { server_version } => {
                let mut e = Enc::new(op::VERSION_MISMATCH);
                e.u16(*server_version);
                e
            }
            Response::Busy { message } => {
                let mut e = Enc::new(op::BUSY);
                e.bytes(message.as_bytes());
                e
            }
        };
        e.finish()
    }

    /// Decode a frame payload.
    pub(crate) fn decode(payload: &[u8]) -> Result<Response, DecodeError> {
        let mut d = Dec(payload);
        let opcode = d.u8("opcode")?;
        let r = match opcode {
            op::OK => Response::Ok,
            op::VALUE => Response::Value(d.bytes("value")?),
            op::MAYBE => Response::Maybe(d.opt_bytes("value")?),
            op::INT => Response::Int(d.i64("counter")?),
            op::BOOL => match d.u8("flag")? {
                0 => Response::Bool(false),
                1 => Response::Bool(true),
                f => return Err(DecodeError(format!("bad boolean {f}"))),
            },
            op::SWAPPED => Response::Swapped,
            op::TIMEOUT => Response::Timeout {
                missing: d.strings("missing keys")?,
            },
            op::ERROR => Response::Error {
                kind: WireErrorKind::from_code(d.u8("error kind")?),
                message: d.string("error message")?,
            },
            op::REFUSED => Response::Refused {
                message: d.string("refusal")?,
            },
            op::VERSION_MISMATCH => Response::VersionMismatch {
                server_version: d.u16("version")?,
            },
            op::BUSY => Response::Busy {
                message: d.string("busy message")?,
            },
            other => return Err(DecodeError(format!("unknown response opcode {other:#04x}"))),
        };
        d.end()?;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn roundtrip_req(r: Request) {
        let f = r.encode().unwrap();
        let payload = read_frame(&mut Cursor::new(&f), MAX_FRAME).unwrap();
        assert_eq!(Request::decode(&payload).unwrap(), r);
    }

    fn roundtrip_resp(r: Response) {
        let f = r.encode().unwrap();
        let payload = read_frame(&mut Cursor::new(&f), MAX_FRAME).unwrap();
        assert_eq!(Response::decode(&payload).unwrap(), r);
    }

    #[test]
    fn every_message_roundtrips() {
        roundtrip_req(Request::hello(Some("tok")));
        roundtrip_req(Request::hello(None));
        roundtrip_req(Request::Set {
            key: "a/ü".into(),
            value: vec![0, 255, 7],
        });
        roundtrip_req(Request::Get {
            key: "k".into(),
            timeout: Duration::from_millis(1500),
        });
        roundtrip_req(Request::TryGet { key: String::new() });
        roundtrip_req(Request::Add {
            key: "c".into(),
            delta: -42,
        });
        roundtrip_req(Request::CompareSet {
            key: "c".into(),
            expected: None,
            desired: b"x".to_vec(),
        });
        roundtrip_req(Request::CompareSet {
            key: "c".into(),
            expected: Some(vec![]),
            desired: vec![],
        });
        roundtrip_req(Request::Wait {
            keys: vec!["a".into(), "b".into()],
            timeout: Duration::from_secs(3),
        });
        roundtrip_req(Request::Delete { key: "d".into() });
        for r in [
            Response::Ok,
            Response::Value(vec![1, 2]),
            Response::Maybe(None),
            Response::Maybe(Some(vec![])),
            Response::Int(i64::MIN),
            Response::Bool(true),
            Response::Swapped,
            Response::Timeout {
                missing: vec!["m".into()],
            },
            Response::Error {
                kind: WireErrorKind::Corrupt,
                message: "bad".into(),
            },
            Response::Refused {
                message: "no".into(),
            },
            Response::VersionMismatch { server_version: 9 },
            Response::Busy {
                message: "full".into(),
            },
        ] {
            roundtrip_resp(r);
        }
    }

    #[test]
    fn sub_millisecond_timeouts_round_up() {
        let f = Request::Get {
            key: "k".into(),
            timeout: Duration::from_micros(10),
        }
        .encode()
        .unwrap();
        let p = read_frame(&mut Cursor::new(&f), MAX_FRAME).unwrap();
        match Request::decode(&p).unwrap() {
            Request::Get { timeout, .. } => assert_eq!(timeout, Duration::from_millis(1)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn oversized_frame_is_refused_before_reading_it() {
        let mut header = (MAX_FRAME + 1).to_le_bytes().to_vec();
        header.extend_from_slice(b"abc");
        match read_frame(&mut Cursor::new(header), MAX_FRAME) {
            Err(FrameError::TooLarge { len, max }) => {
                assert_eq!(len, MAX_FRAME + 1);
                assert_eq!(max, MAX_FRAME);
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
        // A hello-sized cap applies before authentication.
        let header = (MAX_HELLO_FRAME + 1).to_le_bytes();
        assert!(matches!(
            read_frame(&mut Cursor::new(header), MAX_HELLO_FRAME),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_lying_length_is_an_eof_error_not_an_allocation() {
        // Announces 1 GiB, sends 3 bytes.
        let mut f = MAX_FRAME.to_le_bytes().to_vec();
        f.extend_from_slice(b"abc");
        match read_frame(&mut Cursor::new(f), MAX_FRAME) {
            Err(FrameError::Io(e)) => {
                assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
                assert!(e.to_string().contains("3 of 1073741824"), "{e}");
            }
            other => panic!("expected an EOF error, got {other:?}"),
        }
        assert!(matches!(
            read_frame(&mut Cursor::new(Vec::new()), MAX_FRAME),
            Err(FrameError::Closed)
        ));
        assert!(matches!(
            read_frame(&mut Cursor::new(vec![1, 0]), MAX_FRAME),
            Err(FrameError::Io(_))
        ));
    }

    #[test]
    fn malformed_payloads_are_errors() {
        // Truncated key length.
        assert!(Request::decode(&[op::SET, 5, 0]).is_err());
        // Key length past the end.
        assert!(Request::decode(&[op::TRY_GET, 9, 0, 0, 0, b'a']).is_err());
        // Unknown opcode.
        let e = Request::decode(&[0x7f]).unwrap_err();
        assert!(e.0.contains("0x7f"), "{e}");
        // Trailing garbage.
        let mut f = Request::Delete { key: "k".into() }.encode().unwrap();
        f.push(0);
        assert!(Request::decode(&f[4..]).unwrap_err().0.contains("trailing"));
        // A count of 2^32-1 strings in a tiny payload fails without allocating.
        assert!(Request::decode(&[op::WAIT, 255, 255, 255, 255]).is_err());
        // Not UTF-8.
        assert!(Request::decode(&[op::TRY_GET, 1, 0, 0, 0, 0xff]).is_err());
        assert!(Response::decode(&[op::BOOL, 2]).is_err());
        assert!(Response::decode(&[]).is_err());
    }

    #[test]
    fn foreign_hello_is_decoded_without_reading_further() {
        let mut p = vec![op::HELLO];
        p.extend_from_slice(b"GET / HT");
        p.extend_from_slice(b"TP/1.1\r\n");
        match Request::decode(&p).unwrap() {
            Request::Hello { magic, .. } => assert_ne!(magic, MAGIC),
            other => panic!("{other:?}"),
        }
    }
}
