//! [`IdempotencyBody`]: the response body of
//! [`IdempotencyService`](super::IdempotencyService).

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project::pin_project;

use crate::error::BoxError;
use crate::layer::RejectionBody;

/// The response body of [`IdempotencyService`](super::IdempotencyService): a response
/// read whole (stored, or replayed), the inner service's body passed through (a
/// request the layer does not cover, or a response not stored, with whatever part of
/// it the layer read before it found the response would not be stored), or a
/// rejection's.
///
/// It holds no lock: the layer has released its lock by the time the response leaves
/// it (a stored response was read whole first; a body passed through unstored is not
/// the key's to protect).
#[pin_project]
pub struct IdempotencyBody<B> {
    #[pin]
    kind: Kind<B>,
}

#[pin_project(project = KindProj)]
enum Kind<B> {
    Whole {
        data: Option<Bytes>,
    },
    Inner {
        #[pin]
        body: B,
    },
    /// A response read in part: the frames read, then the rest.
    Prefixed {
        read: VecDeque<Frame<Bytes>>,
        rest: Pin<Box<B>>,
    },
    Rejection {
        #[pin]
        body: RejectionBody,
    },
}

impl<B> IdempotencyBody<B> {
    pub(crate) fn whole(data: Bytes) -> Self {
        let data = (!data.is_empty()).then_some(data);
        IdempotencyBody {
            kind: Kind::Whole { data },
        }
    }

    pub(crate) fn inner(body: B) -> Self {
        IdempotencyBody {
            kind: Kind::Inner { body },
        }
    }

    /// The frames `read` from `rest`, then what `rest` has left.
    pub(crate) fn prefixed(read: VecDeque<Frame<Bytes>>, rest: Pin<Box<B>>) -> Self {
        IdempotencyBody {
            kind: Kind::Prefixed { read, rest },
        }
    }

    pub(crate) fn rejection(body: RejectionBody) -> Self {
        IdempotencyBody {
            kind: Kind::Rejection { body },
        }
    }
}

impl<B> Body for IdempotencyBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Whole { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Prefixed { read, rest } => match read.pop_front() {
                Some(frame) => Poll::Ready(Some(Ok(frame))),
                None => rest.as_mut().poll_frame(cx).map_err(Into::into),
            },
            KindProj::Rejection { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Whole { data } => data.is_none(),
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Prefixed { read, rest } => read.is_empty() && rest.is_end_stream(),
            Kind::Rejection { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Whole { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Inner { body } => body.size_hint(),
            Kind::Prefixed { read, rest } => {
                let read: u64 = read
                    .iter()
                    .filter_map(|frame| frame.data_ref().map(|d| d.len() as u64))
                    .sum();
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(read));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(read));
                }
                hint
            }
            Kind::Rejection { body } => body.size_hint(),
        }
    }
}

impl<B> fmt::Debug for IdempotencyBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Whole { .. } => "whole",
            Kind::Inner { .. } => "inner",
            Kind::Prefixed { .. } => "prefixed",
            Kind::Rejection { .. } => "rejection",
        };
        f.debug_tuple("IdempotencyBody").field(&kind).finish()
    }
}
