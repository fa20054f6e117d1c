//! [`Mailbox`]: messages kept for a later receive, in order per source
//! rank and tag. The group keeps one for host sends to self; a device
//! engine keeps one over its own copy of the message (`M`: a device
//! allocation, or the bytes it staged off the device) for device sends to
//! self and for messages that arrived before their receive. The check that
//! a message fits its receive, and the words of a refusal, live here once.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use crate::sync::lock;
use crate::{DType, Result};

/// One kept message: `bytes` bytes of `dtype` elements, held in `body`.
struct Mail<M> {
    dtype: DType,
    bytes: usize,
    body: M,
}

/// The kept messages, oldest first, per (source rank, tag).
type Queues<M> = HashMap<(usize, u32), VecDeque<Mail<M>>>;

/// What a receive found in a [`Mailbox`].
#[derive(Debug, PartialEq, Eq)]
pub enum Taken<M> {
    /// The oldest message for the receive, which fits it.
    Fits(M),
    /// The oldest message for the receive, which does not fit it: it was
    /// dropped, and this says both shapes ([`Mailbox::misfit`]).
    Misfit(String),
    /// No message from that rank with that tag.
    Empty,
}

/// Messages kept for a later receive, per (source rank, tag), oldest
/// first, over an engine-supplied copy `M` of each one.
pub struct Mailbox<M> {
    /// The rank that owns the mailbox (messages from it are sends to self).
    rank: usize,
    queues: Mutex<Queues<M>>,
    posted: Condvar,
}

impl<M> fmt::Debug for Mailbox<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kept: usize = lock(&self.queues).values().map(VecDeque::len).sum();
        f.debug_struct("Mailbox")
            .field("rank", &self.rank)
            .field("kept", &kept)
            .finish()
    }
}

impl<M> Mailbox<M> {
    /// An empty mailbox of rank `rank`.
    pub fn new(rank: usize) -> Mailbox<M> {
        Mailbox {
            rank,
            queues: Mutex::new(HashMap::new()),
            posted: Condvar::new(),
        }
    }

    /// Keep `body`, a message of `bytes` bytes of `dtype` elements from rank
    /// `src` with `tag`, for its receive, and wake a receive waiting in
    /// [`wait_take`](Self::wait_take).
    pub fn post(&self, src: usize, tag: u32, dtype: DType, bytes: usize, body: M) {
        let mail = Mail { dtype, bytes, body };
        lock(&self.queues)
            .entry((src, tag))
            .or_default()
            .push_back(mail);
        self.posted.notify_all();
    }

    /// The oldest message from `src` with `tag`, checked against a receive
    /// of `len` elements of `dtype`.
    pub fn take(&self, src: usize, tag: u32, dtype: DType, len: usize) -> Taken<M> {
        let mail = lock(&self.queues)
            .get_mut(&(src, tag))
            .and_then(VecDeque::pop_front);
        self.check(mail, src, tag, dtype, len)
    }

    /// [`take`](Self::take), waiting for a [`post`](Self::post) until
    /// `deadline` ([`Taken::Empty`] then). `between` runs between two
    /// looks (a group checks that it is not poisoned); its error ends the
    /// wait.
    ///
    /// # Errors
    /// `between`'s.
    pub fn wait_take(
        &self,
        (src, tag): (usize, u32),
        (dtype, len): (DType, usize),
        deadline: Instant,
        mut between: impl FnMut() -> Result<()>,
    ) -> Result<Taken<M>> {
        let mut queues = lock(&self.queues);
        loop {
            if let Some(mail) = queues.get_mut(&(src, tag)).and_then(VecDeque::pop_front) {
                drop(queues);
                return Ok(self.check(Some(mail), src, tag, dtype, len));
            }
            drop(queues);
            between()?;
            queues = lock(&self.queues);
            let now = Instant::now();
            if now >= deadline {
                return Ok(Taken::Empty);
            }
            queues = self
                .posted
                .wait_timeout(queues, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Wake every receive waiting in [`wait_take`](Self::wait_take), so
    /// that it runs its `between` check (after an abort or a poisoning).
    pub fn wake(&self) {
        self.posted.notify_all();
    }

    /// The words of a receive of `len` elements of `dtype` refusing the
    /// message of `bytes` bytes of `sent` elements from `src` with `tag`.
    pub fn misfit(
        &self,
        src: usize,
        tag: u32,
        (sent, bytes): (DType, usize),
        dtype: DType,
        len: usize,
    ) -> String {
        let who = if src == self.rank {
            "this rank sent itself".to_string()
        } else {
            format!("rank {src} sent")
        };
        format!(
            "{who} {} {sent} elements with tag {tag}, the receive buffer holds {len} {dtype} elements (the message was dropped)",
            bytes / sent.size()
        )
    }

    fn check(
        &self,
        mail: Option<Mail<M>>,
        src: usize,
        tag: u32,
        dtype: DType,
        len: usize,
    ) -> Taken<M> {
        match mail {
            None => Taken::Empty,
            Some(m) if m.dtype == dtype && m.bytes == len * dtype.size() => Taken::Fits(m.body),
            Some(m) => Taken::Misfit(self.misfit(src, tag, (m.dtype, m.bytes), dtype, len)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn messages_are_kept_per_source_and_tag_in_order_and_checked() {
        let mb = Mailbox::new(1);
        mb.post(1, 7, DType::F32, 8, "first");
        mb.post(1, 7, DType::F32, 4, "second");
        mb.post(0, 7, DType::I8, 3, "from rank 0");
        assert_eq!(mb.take(1, 8, DType::F32, 2), Taken::Empty);
        assert_eq!(mb.take(1, 7, DType::F32, 2), Taken::Fits("first"));
        let Taken::Misfit(text) = mb.take(1, 7, DType::F32, 2) else {
            panic!("a message of another length fits")
        };
        assert_eq!(
            text,
            "this rank sent itself 1 f32 elements with tag 7, the receive buffer holds 2 f32 elements (the message was dropped)"
        );
        assert_eq!(mb.take(1, 7, DType::F32, 1), Taken::Empty, "dropped");
        let Taken::Misfit(text) = mb.take(0, 7, DType::U8, 3) else {
            panic!("a message of another dtype fits")
        };
        assert!(text.starts_with("rank 0 sent 3 i8 elements"), "{text}");
    }

    #[test]
    fn a_waiting_receive_gets_a_later_post_or_gives_up_at_the_deadline() {
        let mb = Arc::new(Mailbox::new(0));
        let poster = {
            let mb = mb.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                mb.post(0, 1, DType::U8, 1, vec![9u8]);
            })
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        let got = mb.wait_take((0, 1), (DType::U8, 1), deadline, || Ok(()));
        assert_eq!(got.unwrap(), Taken::Fits(vec![9u8]));
        poster.join().unwrap();
        let soon = Instant::now() + Duration::from_millis(10);
        let mut looks = 0;
        let got = mb.wait_take((0, 1), (DType::U8, 1), soon, || {
            looks += 1;
            Ok(())
        });
        assert_eq!(got.unwrap(), Taken::Empty);
        assert!(looks >= 1);
    }

    #[test]
    fn the_check_between_looks_ends_the_wait() {
        let mb: Mailbox<()> = Mailbox::new(0);
        let deadline = Instant::now() + Duration::from_secs(60);
        let e = mb
            .wait_take((0, 1), (DType::U8, 1), deadline, || {
                Err(crate::Error::new(crate::ErrorKind::Aborted, "poisoned"))
            })
            .unwrap_err();
        assert_eq!(e.kind(), &crate::ErrorKind::Aborted);
    }
}
