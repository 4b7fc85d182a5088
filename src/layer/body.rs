//! [`LockBody`]: the response body of [`LockService`](super::LockService).

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use pin_project::pin_project;

use super::rejection::RejectionBody;
use super::request_locks::RequestLocks;
use crate::error::BoxError;

/// The response body of [`LockService`](super::LockService): the inner service's body,
/// or a rejection's.
///
/// With [`ReleaseOn::BodyEnd`](super::ReleaseOn::BodyEnd) it holds the request's locks
/// until the body is done, and **releases them before the client can have the last
/// byte**: the frame that completes the body — the one after which the inner body
/// reports its end, or that brings it to the length announced by its exact size hint or
/// the response's `Content-Length` header (an HTTP/1.1 server sends that many bytes and
/// then stops polling) — is held back until the release has finished. A body whose end is only known when it says so
/// ends with the release instead. Dropped earlier (the client went away, a frame
/// failed), it releases them in a spawned task.
#[pin_project]
pub struct LockBody<B> {
    #[pin]
    kind: Kind<B>,
}

#[pin_project(project = KindProj)]
enum Kind<B> {
    Inner {
        #[pin]
        body: B,
        /// Locks held until the body ends; empty when released with the response.
        locks: RequestLocks,
        /// Bytes still to come, when the body announced its exact length.
        remaining: Option<u64>,
        /// The completing frame, held back while the release runs.
        last: Option<Frame<Bytes>>,
    },
    Rejection {
        #[pin]
        body: RejectionBody,
    },
}

impl<B: Body> LockBody<B> {
    pub(crate) fn new(body: B, locks: RequestLocks) -> Self {
        Self::with_length(body, locks, None)
    }

    /// `content_length`: what the response's `Content-Length` header announces, used
    /// when the body's size hint is not exact (a stream whose handler set the header):
    /// the server sends that many bytes and then stops polling.
    pub(crate) fn with_length(body: B, locks: RequestLocks, content_length: Option<u64>) -> Self {
        let remaining = if locks.is_holding() {
            body.size_hint().exact().or(content_length)
        } else {
            None
        };
        LockBody {
            kind: Kind::Inner {
                body,
                locks,
                remaining,
                last: None,
            },
        }
    }
}

impl<B> LockBody<B> {
    pub(crate) fn rejection(body: RejectionBody) -> Self {
        LockBody {
            kind: Kind::Rejection { body },
        }
    }

    /// Whether this body still holds the request's locks.
    pub fn holds_locks(&self) -> bool {
        match &self.kind {
            Kind::Inner { locks, .. } => locks.is_holding(),
            Kind::Rejection { .. } => false,
        }
    }
}

impl<B> Body for LockBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner {
                mut body,
                locks,
                remaining,
                last,
            } => {
                if locks.is_releasing() {
                    ready!(locks.poll_released(cx));
                    return Poll::Ready(last.take().map(Ok));
                }
                if let Some(frame) = last.take() {
                    return Poll::Ready(Some(Ok(frame)));
                }
                match ready!(body.as_mut().poll_frame(cx)) {
                    Some(Ok(frame)) => {
                        if let (Some(left), Some(data)) = (remaining.as_mut(), frame.data_ref()) {
                            *left = left.saturating_sub(data.remaining() as u64);
                        }
                        let completes = *remaining == Some(0) || body.is_end_stream();
                        if completes && locks.is_holding() {
                            // Hold the last bytes back until the locks are free.
                            locks.start();
                            *last = Some(frame);
                            ready!(locks.poll_released(cx));
                            return Poll::Ready(last.take().map(Ok));
                        }
                        Poll::Ready(Some(Ok(frame)))
                    }
                    Some(Err(error)) => {
                        // The stream is broken: nothing more will be sent under the lock.
                        locks.drop_now();
                        Poll::Ready(Some(Err(error.into())))
                    }
                    None => {
                        locks.start();
                        ready!(locks.poll_released(cx));
                        Poll::Ready(None)
                    }
                }
            }
            KindProj::Rejection { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            // Not the end while locks are held: the release happens on the last poll.
            Kind::Inner {
                body, locks, last, ..
            } => !locks.is_pending() && last.is_none() && body.is_end_stream(),
            Kind::Rejection { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Rejection { body } => body.size_hint(),
        }
    }
}

impl<B> fmt::Debug for LockBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Inner { locks, .. } => f
                .debug_struct("LockBody")
                .field("holds_locks", &locks.is_holding())
                .finish_non_exhaustive(),
            Kind::Rejection { .. } => f.write_str("LockBody::Rejection"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::BodyExt;

    use super::*;
    use crate::{Lease, LockClient, LockKey, MemoryBackend};

    async fn held(client: &LockClient, key: &LockKey) -> RequestLocks {
        let guard = client
            .get_lock(key)
            .unwrap()
            .try_lock_for(Duration::ZERO, Lease::Watchdog)
            .await
            .unwrap();
        RequestLocks::new(crate::lock::Guards::One(guard), client.clone())
    }

    /// A body whose frames arrive through a channel.
    struct Streamed(tokio::sync::mpsc::Receiver<Bytes>);

    impl Body for Streamed {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0.poll_recv(cx).map(|d| d.map(|d| Ok(Frame::data(d))))
        }
    }

    #[tokio::test]
    async fn locks_are_released_when_the_body_ends_and_not_before() {
        let backend = MemoryBackend::new();
        let client = LockClient::new(backend.clone());
        let key = LockKey::new("body").unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut body = LockBody::new(Streamed(rx), held(&client, &key).await);
        assert!(!body.is_end_stream());

        tx.send(Bytes::from_static(b"a")).await.unwrap();
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "a");
        assert!(body.holds_locks());
        assert!(backend.contains_key(&key), "held while the body streams");

        drop(tx);
        assert!(body.frame().await.is_none());
        assert!(!body.holds_locks());
        assert!(
            !backend.contains_key(&key),
            "released by the time the end is reported"
        );
    }

    #[tokio::test]
    async fn dropping_the_body_early_releases() {
        let backend = MemoryBackend::new();
        let client = LockClient::new(backend.clone());
        let key = LockKey::new("body-drop").unwrap();
        let body = LockBody::new(
            http_body_util::Full::new(Bytes::from_static(b"x")),
            held(&client, &key).await,
        );
        assert!(backend.contains_key(&key));
        drop(body);
        for _ in 0..100 {
            if !backend.contains_key(&key) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the dropped body's locks were not released");
    }

    #[tokio::test]
    async fn rejection_body_yields_its_bytes_once() {
        let boxed = http_body_util::Full::new(Bytes::from("no"))
            .map_err(|never| match never {})
            .boxed_unsync();
        let body = LockBody::<http_body_util::Empty<Bytes>>::rejection(boxed);
        assert_eq!(body.size_hint().exact(), Some(2));
        assert!(!body.is_end_stream());
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(all, "no");
    }

    /// An HTTP/1.1 server that knows the length stops polling after the announced bytes:
    /// the frame that completes them is held back until the locks are free.
    #[tokio::test]
    async fn the_frame_completing_an_announced_length_waits_for_the_release() {
        let backend = MemoryBackend::new();
        let client = LockClient::new(backend.clone());
        let key = LockKey::new("body-len").unwrap();
        let mut body = LockBody::new(
            http_body_util::Full::new(Bytes::from_static(b"whole")),
            held(&client, &key).await,
        );
        assert_eq!(body.size_hint().exact(), Some(5), "the length is kept");
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "whole");
        assert!(
            !backend.contains_key(&key),
            "released before the last byte was handed over"
        );
        assert!(body.frame().await.is_none());
    }
}
