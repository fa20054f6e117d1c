/// What `Accelerator::prepare` returns for a loader, optimizer, scheduler or
/// model: an object that behaves like the inner one (usually through
/// `Deref`/`DerefMut`), knows it has been prepared, and gives the inner
/// object back.
///
/// Preparing a value that is already a `Wrapper` returns it unchanged; the
/// runtime relies on [`Wrapper::is_prepared`] for that.
pub trait Wrapper {
    /// The wrapped object.
    type Inner;

    /// Shared access to the wrapped object.
    fn inner(&self) -> &Self::Inner;

    /// Exclusive access to the wrapped object.
    fn inner_mut(&mut self) -> &mut Self::Inner;

    /// Give the wrapped object back (Accelerate's `unwrap_model`).
    fn into_inner(self) -> Self::Inner
    where
        Self: Sized;

    /// Always `true` for a wrapper; lets generic code tell prepared objects
    /// from raw ones.
    fn is_prepared(&self) -> bool {
        true
    }
}
