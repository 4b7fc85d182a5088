//! The `Idempotency-Key` header, and the lock key a request's retries share.

use std::borrow::Cow;

use http::request::Parts;
use http::{HeaderMap, HeaderName};

use crate::error::{ConfigError, Result};
use crate::key::LockKey;
use crate::namespace::Namespace;

/// Why a request's `Idempotency-Key` is not one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BadKey {
    Missing,
    Repeated,
    Empty,
    TooLong(usize),
    Malformed,
}

impl BadKey {
    pub(crate) fn detail(self, header: &HeaderName, max: usize) -> String {
        match self {
            BadKey::Missing => format!("this request needs a `{header}` header"),
            BadKey::Repeated => format!("the `{header}` header is sent more than once"),
            BadKey::Empty => format!("the `{header}` header is empty"),
            BadKey::TooLong(len) => {
                format!("the `{header}` header is {len} bytes long; the limit is {max}")
            }
            BadKey::Malformed => format!(
                "the `{header}` header is not a structured-field string (`\"...\"`) nor a token of visible ASCII characters"
            ),
        }
    }
}

/// The key the client sent in `header`: a structured-field string (RFC 8941,
/// `"8e03978e-..."`, the draft's form), or, as many clients send it, the bare value of
/// visible ASCII characters without quotes or backslashes. At most `max` bytes once
/// unquoted.
pub(crate) fn parse<'a>(
    headers: &'a HeaderMap,
    header: &HeaderName,
    max: usize,
) -> Result<Cow<'a, str>, BadKey> {
    let mut values = headers.get_all(header).iter();
    let value = values.next().ok_or(BadKey::Missing)?;
    if values.next().is_some() {
        return Err(BadKey::Repeated);
    }
    let raw = value
        .to_str()
        .map_err(|_| BadKey::Malformed)?
        .trim_matches([' ', '\t']);
    let key = match raw.strip_prefix('"') {
        Some(quoted) => Cow::Owned(sf_string(quoted)?),
        None if raw
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\') =>
        {
            Cow::Borrowed(raw)
        }
        None => return Err(BadKey::Malformed),
    };
    if key.is_empty() {
        return Err(BadKey::Empty);
    }
    if key.len() > max {
        return Err(BadKey::TooLong(key.len()));
    }
    Ok(key)
}

/// The rest of an sf-string after its opening quote: printable ASCII, `\"` and `\\`
/// escapes, a closing quote and nothing after it.
fn sf_string(rest: &str) -> Result<String, BadKey> {
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.bytes();
    while let Some(b) = chars.next() {
        match b {
            b'\\' => match chars.next() {
                Some(e @ (b'"' | b'\\')) => out.push(char::from(e)),
                _ => return Err(BadKey::Malformed),
            },
            b'"' => {
                return if chars.next().is_none() {
                    Ok(out)
                } else {
                    Err(BadKey::Malformed)
                };
            }
            0x20..=0x7e => out.push(char::from(b)),
            _ => return Err(BadKey::Malformed),
        }
    }
    Err(BadKey::Malformed)
}

/// The route a key is scoped to: axum's matched route template where there is one
/// (`/vouchers/{id}/orders`), else the request's path.
pub(crate) fn route(parts: &Parts) -> &str {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return matched.as_str();
    }
    parts.uri.path()
}

/// `<prefix>:{<scope>␊<method>␊<route>␊<key>}`: the lock (and stored response) of one
/// key, for one caller, method and route. Everything but the prefix is in the hash tag,
/// escaped one-to-one (the newlines too), so no client input can reach another caller's
/// key, and a record lands in its lock's Redis Cluster slot.
pub(crate) fn lock_key(
    prefix: &Namespace,
    scope: &[LockKey],
    parts: &Parts,
    key: &str,
) -> Result<LockKey, ConfigError> {
    let mut part = String::with_capacity(64 + key.len());
    for s in scope {
        part.push_str(s.as_str());
        part.push('\n');
    }
    part.push_str(parts.method.as_str());
    part.push('\n');
    part.push_str(route(parts));
    part.push('\n');
    part.push_str(key);
    LockKey::in_namespace(prefix, &part)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    const H: HeaderName = HeaderName::from_static("idempotency-key");

    fn parsed(values: &[&[u8]]) -> Result<String, BadKey> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(H, HeaderValue::from_bytes(v).unwrap());
        }
        parse(&headers, &H, 16).map(Cow::into_owned)
    }

    #[test]
    fn keys_are_sf_strings_or_bare_tokens() {
        assert_eq!(parsed(&[b"\"abc\""]).unwrap(), "abc");
        assert_eq!(parsed(&[b"\"a b\\\"c\\\\\""]).unwrap(), "a b\"c\\");
        assert_eq!(parsed(&[b"8e03978e-40d5"]).unwrap(), "8e03978e-40d5");
        assert_eq!(parsed(&[b" abc "]).unwrap(), "abc");
        assert_eq!(parsed(&[]), Err(BadKey::Missing));
        assert_eq!(parsed(&[b"a", b"b"]), Err(BadKey::Repeated));
        assert_eq!(parsed(&[b"\"\""]), Err(BadKey::Empty));
        assert_eq!(parsed(&[b""]), Err(BadKey::Empty));
        assert_eq!(parsed(&[b"0123456789abcdefX"]), Err(BadKey::TooLong(17)));
        for bad in [
            &b"a b"[..],
            b"\"abc",
            b"\"abc\"x",
            b"\"a\\x\"",
            b"ab\"c",
            b"a\\b",
            b"\xc3\xa9",
            b"\"\xc3\xa9\"",
        ] {
            assert_eq!(parsed(&[bad]), Err(BadKey::Malformed), "{bad:?}");
        }
    }

    #[test]
    fn keys_are_scoped_to_caller_method_and_route() {
        let prefix = Namespace::new("idempotency").unwrap();
        let head = |method: &str, uri: &str| {
            http::Request::builder()
                .method(method)
                .uri(uri)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        let alice = [LockKey::namespaced("user", "alice").unwrap()];
        let bob = [LockKey::namespaced("user", "bob").unwrap()];
        let k = |scope: &[LockKey], method, uri, key| {
            lock_key(&prefix, scope, &head(method, uri), key).unwrap()
        };
        let base = k(&alice, "POST", "/orders", "k1");
        assert_eq!(base.namespace(), "idempotency");
        assert_eq!(
            base.as_str(),
            "idempotency:{user:%7Balice%7D%0APOST%0A/orders%0Ak1}"
        );
        assert_ne!(base, k(&bob, "POST", "/orders", "k1"));
        assert_ne!(base, k(&alice, "PATCH", "/orders", "k1"));
        assert_ne!(base, k(&alice, "POST", "/orders2", "k1"));
        assert_ne!(base, k(&alice, "POST", "/orders", "k2"));
        // A key cannot forge the separators: `%` is escaped too.
        assert_ne!(
            k(&alice, "POST", "/a", "b%0Ac"),
            k(&alice, "POST", "/a%0Ab", "c")
        );
    }
}
