//! [`LockBody`]: the response body of [`LockService`](super::LockService).

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project::pin_project;

use super::release::Release;

/// The response body of [`LockService`](super::LockService): the inner service's body,
/// or the rejection handler's bytes.
///
/// With [`ReleaseOn::BodyEnd`](super::ReleaseOn::BodyEnd) it holds the request's locks
/// until the inner body has ended: it releases them, waits for the release, and only
/// then reports the end of the stream. Dropped earlier (the client went away, a frame
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
        release: Release,
    },
    Rejection {
        data: Option<Bytes>,
    },
}

impl<B> LockBody<B> {
    pub(crate) fn new(body: B, release: Release) -> Self {
        LockBody {
            kind: Kind::Inner { body, release },
        }
    }

    pub(crate) fn rejection(data: Bytes) -> Self {
        LockBody {
            kind: Kind::Rejection {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// Whether this body still holds the request's locks.
    pub fn holds_locks(&self) -> bool {
        match &self.kind {
            Kind::Inner { release, .. } => release.is_holding(),
            Kind::Rejection { .. } => false,
        }
    }
}

impl<B> Body for LockBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body, release } => {
                if release.is_releasing() {
                    ready!(release.poll_released(cx));
                    return Poll::Ready(None);
                }
                match ready!(body.poll_frame(cx)) {
                    Some(Ok(frame)) => Poll::Ready(Some(Ok(frame))),
                    Some(Err(error)) => {
                        // The stream is broken: nothing more will be sent under the lock.
                        release.drop_now();
                        Poll::Ready(Some(Err(error)))
                    }
                    None => {
                        release.start();
                        ready!(release.poll_released(cx));
                        Poll::Ready(None)
                    }
                }
            }
            KindProj::Rejection { data } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(B::Data::from(d)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            // Not the end while locks are held: the release happens on the last poll.
            Kind::Inner { body, release } => !release.is_pending() && body.is_end_stream(),
            Kind::Rejection { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Rejection { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

impl<B> fmt::Debug for LockBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Inner { release, .. } => f
                .debug_struct("LockBody")
                .field("holds_locks", &release.is_holding())
                .finish_non_exhaustive(),
            Kind::Rejection { data } => f
                .debug_struct("LockBody::Rejection")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::BodyExt;

    use super::*;
    use crate::kinds::MultiLock;
    use crate::{Lease, LockClient, LockKey, MemoryBackend};

    async fn held(client: &LockClient, key: &LockKey) -> Release {
        let guard = MultiLock::new([client.get_lock(key).unwrap()])
            .try_lock_for(Duration::ZERO, Lease::Watchdog)
            .await
            .unwrap();
        Release::new(guard, client.clone())
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
        let body = LockBody::<http_body_util::Empty<Bytes>>::rejection(Bytes::from("no"));
        assert_eq!(body.size_hint().exact(), Some(2));
        assert!(!body.is_end_stream());
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(all, "no");
    }
}
