//! torch's TCPStore wire format (as spoken by torch 2.13's libuv server and
//! its C++ client), written from its documented behaviour.
//!
//! There are no frames: a request is one query byte followed by its fields,
//! and a reply is the bare fields of the answer. Integers are native-endian
//! (little-endian on every platform torch ships for); a string or byte string
//! is a `u64` length followed by the bytes; a list of keys is a `u64` count
//! followed by the keys. The first request of every connection is a
//! validation carrying a fixed magic number.
//!
//! | query | fields | reply |
//! |---|---|---|
//! | 0 validate | `u32` magic | none |
//! | 1 set | key, value | none |
//! | 2 compare_set | key, expected, desired | value now held (see [`super`]) |
//! | 3 get | key | value (empty when absent) |
//! | 4 add | key, `i64` delta | `i64` new value |
//! | 5 check | keys | `u8` 0 ready / 1 not ready |
//! | 6 wait | keys | `u8` 0 (stop waiting), once every key is set |
//! | 7 num_keys | — | `i64` |
//! | 8 delete | key | `i64` keys deleted |
//! | 9 append | key, bytes | none |
//! | 10 multi_get | keys | one value per key |
//! | 11 multi_set | `u64` count, (key, value) pairs | none |
//! | 12 cancel_wait | — | `u8` 1 (wait canceled) |
//! | 13 ping | `u32` nonce | the nonce |
//! | 14 queue_push | key, value | none |
//! | 15 queue_pop | key | `i64` length before the pop, then the value if it was > 0 |
//! | 16 queue_len | key | `i64` |
//! | 17 list_keys | — | `i64` count, then the keys |
//! | 18 barrier | key, `i64` world size | `u8` 0 once `world size` callers arrived |

/// The number every client sends first.
pub(crate) const MAGIC: u32 = 0x3C85_F7CE;
/// The longest key the server reads (torch's own limit).
pub(crate) const MAX_KEY: u64 = 8 * 1024;
/// The longest value the server reads (torch's own limit).
pub(crate) const MAX_VALUE: u64 = 8 * 1024 * 1024;
/// The most keys one request may name (torch's own limit).
pub(crate) const MAX_KEYS: u64 = 128 * 1024;

/// `check`'s answers.
pub(crate) const READY: u8 = 0;
pub(crate) const NOT_READY: u8 = 1;
/// `wait`'s and `barrier`'s answers.
pub(crate) const STOP_WAITING: u8 = 0;
pub(crate) const WAIT_CANCELED: u8 = 1;

/// Query bytes.
pub(crate) mod q {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const NUM_KEYS: u8 = 7;
    pub const DELETE: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
    pub const QUEUE_PUSH: u8 = 14;
    pub const QUEUE_POP: u8 = 15;
    pub const QUEUE_LEN: u8 = 16;
    pub const LIST_KEYS: u8 = 17;
    pub const BARRIER: u8 = 18;
}

/// A request being written.
pub(crate) struct Msg(Vec<u8>);

impl Msg {
    pub(crate) fn new(query: u8) -> Msg {
        Msg(vec![query])
    }
    pub(crate) fn u32(mut self, v: u32) -> Msg {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn i64(mut self, v: i64) -> Msg {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn count(mut self, n: usize) -> Msg {
        self.0.extend_from_slice(&(n as u64).to_le_bytes());
        self
    }
    pub(crate) fn bytes(mut self, b: &[u8]) -> Msg {
        self.0.extend_from_slice(&(b.len() as u64).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

/// A request the server read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    Validate(u32),
    Set(Vec<u8>, Vec<u8>),
    CompareSet(Vec<u8>, Vec<u8>, Vec<u8>),
    Get(Vec<u8>),
    Add(Vec<u8>, i64),
    Check(Vec<Vec<u8>>),
    Wait(Vec<Vec<u8>>),
    NumKeys,
    Delete(Vec<u8>),
    Append(Vec<u8>, Vec<u8>),
    MultiGet(Vec<Vec<u8>>),
    MultiSet(Vec<(Vec<u8>, Vec<u8>)>),
    CancelWait,
    Ping(u32),
    QueuePush(Vec<u8>, Vec<u8>),
    QueuePop(Vec<u8>),
    QueueLen(Vec<u8>),
    ListKeys,
    Barrier(Vec<u8>, i64),
}

/// What [`parse`] found at the start of a buffer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Parsed {
    /// A whole request, and how many bytes it took.
    Done(Request, usize),
    /// The request is not complete yet: read more.
    Incomplete,
    /// Not a request of this protocol (unknown query, a length over the
    /// limits); the connection must be closed.
    Bad(String),
}

/// A bounds-checked reader over a buffer that may end early.
struct Cur<'a> {
    buf: &'a [u8],
    at: usize,
}

/// `Err(None)`: incomplete; `Err(Some(why))`: bad.
type Step<T> = std::result::Result<T, Option<String>>;

impl Cur<'_> {
    fn take(&mut self, n: usize) -> Step<&[u8]> {
        let end = self.at.checked_add(n).ok_or(None)?;
        let s = self.buf.get(self.at..end).ok_or(None)?;
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Step<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Step<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Step<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
    fn i64(&mut self) -> Step<i64> {
        Ok(self.u64()? as i64)
    }
    fn sized(&mut self, max: u64, what: &str) -> Step<Vec<u8>> {
        let n = self.u64()?;
        if n > max {
            return Err(Some(format!("{what} of {n} bytes (at most {max})")));
        }
        Ok(self.take(n as usize)?.to_vec())
    }
    fn key(&mut self) -> Step<Vec<u8>> {
        self.sized(MAX_KEY, "a key")
    }
    fn value(&mut self) -> Step<Vec<u8>> {
        self.sized(MAX_VALUE, "a value")
    }
    fn count(&mut self) -> Step<usize> {
        let n = self.u64()?;
        if n > MAX_KEYS {
            return Err(Some(format!(
                "{n} keys in one request (at most {MAX_KEYS})"
            )));
        }
        Ok(n as usize)
    }
    fn keys(&mut self) -> Step<Vec<Vec<u8>>> {
        let n = self.count()?;
        // Each key takes at least its 8-byte length: no allocation beyond
        // what the buffer already holds.
        let mut keys = Vec::with_capacity(n.min(self.buf.len() / 8));
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
    }
}

/// Read one request from the start of `buf`.
pub(crate) fn parse(buf: &[u8]) -> Parsed {
    let mut c = Cur { buf, at: 0 };
    match parse_in(&mut c) {
        Ok(r) => Parsed::Done(r, c.at),
        Err(None) => Parsed::Incomplete,
        Err(Some(why)) => Parsed::Bad(why),
    }
}

fn parse_in(c: &mut Cur<'_>) -> Step<Request> {
    use Request as R;
    Ok(match c.u8()? {
        q::VALIDATE => R::Validate(c.u32()?),
        q::SET => R::Set(c.key()?, c.value()?),
        q::COMPARE_SET => R::CompareSet(c.key()?, c.value()?, c.value()?),
        q::GET => R::Get(c.key()?),
        q::ADD => R::Add(c.key()?, c.i64()?),
        q::CHECK => R::Check(c.keys()?),
        q::WAIT => R::Wait(c.keys()?),
        q::NUM_KEYS => R::NumKeys,
        q::DELETE => R::Delete(c.key()?),
        q::APPEND => R::Append(c.key()?, c.value()?),
        q::MULTI_GET => R::MultiGet(c.keys()?),
        q::MULTI_SET => {
            let n = c.count()?;
            let mut pairs = Vec::with_capacity(n.min(c.buf.len() / 16));
            for _ in 0..n {
                pairs.push((c.key()?, c.value()?));
            }
            R::MultiSet(pairs)
        }
        q::CANCEL_WAIT => R::CancelWait,
        q::PING => R::Ping(c.u32()?),
        q::QUEUE_PUSH => R::QueuePush(c.key()?, c.value()?),
        q::QUEUE_POP => R::QueuePop(c.key()?),
        q::QUEUE_LEN => R::QueueLen(c.key()?),
        q::LIST_KEYS => R::ListKeys,
        q::BARRIER => R::Barrier(c.key()?, c.i64()?),
        other => return Err(Some(format!("unknown query byte {other}"))),
    })
}

/// The reply bytes of a value (`u64` length, then the bytes).
pub(crate) fn value_reply(out: &mut Vec<u8>, v: &[u8]) {
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    out.extend_from_slice(v);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_round_trips_and_every_prefix_is_incomplete() {
        let cases: Vec<(Vec<u8>, Request)> = vec![
            (
                Msg::new(q::VALIDATE).u32(MAGIC).into_bytes(),
                Request::Validate(MAGIC),
            ),
            (
                Msg::new(q::SET).bytes(b"k").bytes(b"v").into_bytes(),
                Request::Set(b"k".to_vec(), b"v".to_vec()),
            ),
            (
                Msg::new(q::COMPARE_SET)
                    .bytes(b"k")
                    .bytes(b"")
                    .bytes(b"n")
                    .into_bytes(),
                Request::CompareSet(b"k".to_vec(), vec![], b"n".to_vec()),
            ),
            (
                Msg::new(q::ADD).bytes(b"c").i64(-3).into_bytes(),
                Request::Add(b"c".to_vec(), -3),
            ),
            (
                Msg::new(q::WAIT)
                    .count(2)
                    .bytes(b"a")
                    .bytes(b"bb")
                    .into_bytes(),
                Request::Wait(vec![b"a".to_vec(), b"bb".to_vec()]),
            ),
            (
                Msg::new(q::MULTI_SET)
                    .count(1)
                    .bytes(b"a")
                    .bytes(b"1")
                    .into_bytes(),
                Request::MultiSet(vec![(b"a".to_vec(), b"1".to_vec())]),
            ),
            (Msg::new(q::PING).u32(7).into_bytes(), Request::Ping(7)),
            (Msg::new(q::LIST_KEYS).into_bytes(), Request::ListKeys),
            (
                Msg::new(q::BARRIER).bytes(b"b").i64(4).into_bytes(),
                Request::Barrier(b"b".to_vec(), 4),
            ),
        ];
        for (bytes, want) in cases {
            for cut in 0..bytes.len() {
                assert_eq!(
                    parse(&bytes[..cut]),
                    Parsed::Incomplete,
                    "{want:?} cut at {cut}"
                );
            }
            let mut two = bytes.clone();
            two.extend_from_slice(&bytes);
            assert_eq!(parse(&two), Parsed::Done(want, bytes.len()));
        }
    }

    #[test]
    fn oversized_lengths_and_unknown_queries_are_bad_before_any_allocation() {
        let mut huge_key = vec![q::GET];
        huge_key.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse(&huge_key), Parsed::Bad(m) if m.contains("a key")));
        let mut huge_value = Msg::new(q::SET).bytes(b"k").into_bytes();
        huge_value.extend_from_slice(&(MAX_VALUE + 1).to_le_bytes());
        assert!(matches!(parse(&huge_value), Parsed::Bad(m) if m.contains("a value")));
        let mut many = vec![q::WAIT];
        many.extend_from_slice(&(MAX_KEYS + 1).to_le_bytes());
        assert!(matches!(parse(&many), Parsed::Bad(m) if m.contains("keys")));
        assert!(matches!(parse(&[99]), Parsed::Bad(m) if m.contains("99")));
        // An HTTP request is not a TCPStore query.
        assert!(matches!(parse(b"GET / HTTP/1.1\r\n"), Parsed::Bad(_)));
    }
}
