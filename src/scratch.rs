//! Building a shared string in one allocation.
//!
//! An `Arc<str>` made from a `String` is a second allocation and a copy; owners and keys
//! are made on every request's path, so they are written into a per-thread scratch
//! buffer first and copied once into their `Arc`.

use std::cell::RefCell;
use std::sync::Arc;

/// Longer scratch buffers are not kept (a rare long key does not pin its memory).
const KEEP: usize = 4096;

thread_local! {
    static SCRATCH: RefCell<String> = const { RefCell::new(String::new()) };
}

/// The string `write` writes, as an `Arc<str>` made with one allocation (after the
/// thread's first).
pub(crate) fn arc_str(write: impl FnOnce(&mut String)) -> Arc<str> {
    let mut write = Some(write);
    let shared = SCRATCH.try_with(|scratch| {
        // Not re-entered (nothing here calls back out), but never panic if it were.
        let mut buf = scratch.try_borrow_mut().ok()?;
        buf.clear();
        (write.take()?)(&mut buf);
        let shared = Arc::from(buf.as_str());
        if buf.capacity() > KEEP {
            *buf = String::new();
        }
        Some(shared)
    });
    match (shared, write) {
        (Ok(Some(shared)), _) => shared,
        // The thread is shutting down or the buffer is busy: the plain way.
        (_, Some(write)) => {
            let mut buf = String::new();
            write(&mut buf);
            Arc::from(buf)
        }
        (_, None) => Arc::from(""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_what_was_written_and_resets_between_uses() {
        assert_eq!(&*arc_str(|s| s.push_str("a:1")), "a:1");
        assert_eq!(&*arc_str(|s| s.push('b')), "b");
        let long = "x".repeat(KEEP * 2);
        assert_eq!(&*arc_str(|s| s.push_str(&long)), long.as_str());
        assert_eq!(&*arc_str(|s| s.push('c')), "c");
    }
}
