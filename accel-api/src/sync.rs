//! The one poison-recovering lock: a panic while a lock was held leaves
//! the data as the panicking thread left it, and every user of these locks
//! keeps state that stays consistent between statements, so the next
//! thread takes the lock instead of panicking in turn.

use std::sync::{Mutex, MutexGuard};

/// Lock `m`, recovering it from a panic of an earlier holder.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
