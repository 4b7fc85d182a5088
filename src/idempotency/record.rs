//! What a stored response is: the request's [`Fingerprint`] and the response's status,
//! kept headers and body, encoded as the opaque record a
//! [`ReplayStore`](crate::backend::ReplayStore) keeps.

use std::fmt;
use std::hash::Hasher;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use siphasher::sip128::{Hasher128, SipHasher13};

/// What identifies a request's content, so that a retry can be told from another
/// request reusing its key: by default a 128-bit hash of the method, the path, the
/// query and the body ([`Fingerprint::of`]).
///
/// Not a cryptographic digest: it tells apart the requests one caller sends under one
/// key (keys are scoped to the caller), which nobody else can choose.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 16]);

/// Fixed keys: every replica must compute the same fingerprint for the same request.
const KEYS: (u64, u64) = (0x746f_7765_722d_6c6f, 0x636b_2d69_6465_6d70);

impl Fingerprint {
    /// The default: the method, the path, the query and the body.
    pub fn of(parts: &Parts, body: &[u8]) -> Self {
        let mut h = Self::hasher();
        for part in [
            parts.method.as_str().as_bytes(),
            parts.uri.path().as_bytes(),
            parts.uri.query().unwrap_or("").as_bytes(),
            body,
        ] {
            // Length-prefixed, so that no two different splits hash the same.
            h.write_u64(part.len() as u64);
            h.write(part);
        }
        Fingerprint(h.finish128().as_bytes())
    }

    /// A fingerprint of any bytes: for a custom
    /// [`fingerprint`](super::IdempotencyLayerBuilder::fingerprint) function that
    /// hashes what identifies its requests (a canonical form of a JSON body, say).
    pub fn from_content(content: &[u8]) -> Self {
        let mut h = Self::hasher();
        h.write(content);
        Fingerprint(h.finish128().as_bytes())
    }

    /// The raw 16 bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    fn hasher() -> SipHasher13 {
        SipHasher13::new_with_keys(KEYS.0, KEYS.1)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint(")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

/// A response kept for replay, with the fingerprint of the request that made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) fingerprint: Fingerprint,
    /// When it was stored, by the storing replica's clock, to the millisecond.
    pub(crate) stored_at: SystemTime,
    pub(crate) status: StatusCode,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
}

/// The first byte of every record: the layout below. A record of another version is
/// not replayed (it reads as corrupt).
const VERSION: u8 = 2;

/// Why a stored record could not be read.
#[derive(Debug, thiserror::Error)]
#[error("stored response is corrupt: {0}")]
pub(crate) struct Corrupt(&'static str);

impl Record {
    /// The record of `status`, the headers of `headers` on `keep`, and `body`.
    pub(crate) fn new(
        fingerprint: Fingerprint,
        status: StatusCode,
        headers: &HeaderMap,
        keep: &[HeaderName],
        body: Bytes,
    ) -> Self {
        let headers = keep
            .iter()
            .flat_map(|name| {
                headers
                    .get_all(name)
                    .iter()
                    .map(move |value| (name.clone(), value.clone()))
            })
            .collect();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis();
        let stored_at = UNIX_EPOCH + Duration::from_millis(u64::try_from(now).unwrap_or(u64::MAX));
        Record {
            fingerprint,
            stored_at,
            status,
            headers,
            body,
        }
    }

    /// `version | fingerprint (16) | stored at (u64, ms since the Unix epoch) | status
    /// (u16) | header count (u16) | per header: name length (u16), name, value length
    /// (u32), value | body`, integers big-endian.
    pub(crate) fn encode(&self) -> Bytes {
        let head: usize = self
            .headers
            .iter()
            .map(|(n, v)| 6 + n.as_str().len() + v.len())
            .sum();
        let mut out = BytesMut::with_capacity(1 + 16 + 8 + 2 + 2 + head + self.body.len());
        out.put_u8(VERSION);
        out.put_slice(self.fingerprint.as_bytes());
        let stored_at = self
            .stored_at
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis();
        out.put_u64(u64::try_from(stored_at).unwrap_or(u64::MAX));
        out.put_u16(self.status.as_u16());
        // Header names are at most 64 KiB by construction of the allowlist; values are
        // bounded by what hyper accepts. Counts beyond u16 cannot come from `new`.
        out.put_u16(u16::try_from(self.headers.len()).unwrap_or(u16::MAX));
        for (name, value) in self.headers.iter().take(usize::from(u16::MAX)) {
            let name = name.as_str().as_bytes();
            out.put_u16(u16::try_from(name.len()).unwrap_or(u16::MAX));
            out.put_slice(&name[..name.len().min(usize::from(u16::MAX))]);
            let value = value.as_bytes();
            out.put_u32(u32::try_from(value.len()).unwrap_or(u32::MAX));
            out.put_slice(&value[..value.len().min(u32::MAX as usize)]);
        }
        out.put_slice(&self.body);
        out.freeze()
    }

    /// Reads a record [`encode`](Self::encode) wrote; never panics on any input.
    pub(crate) fn decode(bytes: &Bytes) -> Result<Self, Corrupt> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(1)? != [VERSION] {
            return Err(Corrupt("unknown version"));
        }
        let mut fingerprint = [0; 16];
        fingerprint.copy_from_slice(r.take(16)?);
        let stored_at = UNIX_EPOCH
            .checked_add(Duration::from_millis(r.u64()?))
            .ok_or(Corrupt("time out of range"))?;
        let status = StatusCode::from_u16(r.u16()?).map_err(|_| Corrupt("status out of range"))?;
        let count = r.u16()?;
        let mut headers = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let len = usize::from(r.u16()?);
            let name =
                HeaderName::from_bytes(r.take(len)?).map_err(|_| Corrupt("bad header name"))?;
            let len = r.u32()? as usize;
            let value =
                HeaderValue::from_bytes(r.take(len)?).map_err(|_| Corrupt("bad header value"))?;
            headers.push((name, value));
        }
        Ok(Record {
            fingerprint: Fingerprint(fingerprint),
            stored_at,
            status,
            headers,
            body: bytes.slice(r.at..),
        })
    }
}

struct Reader<'a> {
    bytes: &'a Bytes,
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Corrupt> {
        let end = self.at.checked_add(n).ok_or(Corrupt("length overflow"))?;
        let slice = self.bytes.get(self.at..end).ok_or(Corrupt("truncated"))?;
        self.at = end;
        Ok(slice)
    }

    fn u16(&mut self) -> Result<u16, Corrupt> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, Corrupt> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, Corrupt> {
        let mut b = [0; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(b))
    }
}

#[cfg(test)]
mod tests {
    use http::header;

    use super::*;

    fn parts(method: &str, uri: &str) -> Parts {
        http::Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn fingerprints_tell_method_path_query_and_body_apart() {
        let base = Fingerprint::of(&parts("POST", "/a?x=1"), b"body");
        assert_eq!(base, Fingerprint::of(&parts("POST", "/a?x=1"), b"body"));
        for other in [
            Fingerprint::of(&parts("PATCH", "/a?x=1"), b"body"),
            Fingerprint::of(&parts("POST", "/b?x=1"), b"body"),
            Fingerprint::of(&parts("POST", "/a?x=2"), b"body"),
            Fingerprint::of(&parts("POST", "/a?x=1"), b"bodz"),
            // The same bytes split differently between query and body.
            Fingerprint::of(&parts("POST", "/a?x=1b"), b"ody"),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn a_record_round_trips() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.append(header::LINK, HeaderValue::from_static("</a>"));
        headers.append(header::LINK, HeaderValue::from_static("</b>"));
        headers.insert(header::SET_COOKIE, HeaderValue::from_static("secret=1"));
        let body: Bytes = (0..=255u8).cycle().take(70_000).collect::<Vec<_>>().into();
        let record = Record::new(
            Fingerprint::from_content(b"x"),
            StatusCode::CREATED,
            &headers,
            &[header::CONTENT_TYPE, header::LINK],
            body,
        );
        assert_eq!(record.headers.len(), 3, "set-cookie is not on the list");
        let decoded = Record::decode(&record.encode()).unwrap();
        assert_eq!(decoded, record);
    }

    #[test]
    fn no_input_makes_decode_panic() {
        let record = Record::new(
            Fingerprint::from_content(b"x"),
            StatusCode::OK,
            &HeaderMap::from_iter([(header::CONTENT_TYPE, HeaderValue::from_static("a/b"))]),
            &[header::CONTENT_TYPE],
            Bytes::from_static(b"hello"),
        )
        .encode();
        // Every truncation, and every single-byte change, reads or fails cleanly.
        for len in 0..record.len() {
            let _ = Record::decode(&record.slice(..len));
        }
        for at in 0..record.len() {
            for byte in [0u8, 0x7f, 0xff] {
                let mut changed = record.to_vec();
                changed[at] = byte;
                let _ = Record::decode(&Bytes::from(changed));
            }
        }
        assert!(Record::decode(&Bytes::new()).is_err());
        assert!(Record::decode(&Bytes::from_static(&[2])).is_err());
        let mut v1 = record.to_vec();
        v1[0] = 1;
        assert!(Record::decode(&Bytes::from(v1)).is_err(), "an old layout");
    }
}
