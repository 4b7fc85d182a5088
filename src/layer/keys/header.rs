//! [`HeaderKey`]: keys a request by one header's value.

use std::borrow::Cow;
use std::future::{Ready, ready};

use http::HeaderName;
use http::request::Parts;

use super::{Extracted, KeyError, KeyExtractor, Keys, namespaced};
use crate::error::ConfigError;
use crate::namespace::Namespace;

/// Keys a request by one header's value: `<namespace>:{<value>}`, escaped with
/// [`LockKey::namespaced`](crate::LockKey::namespaced).
///
/// A missing header is a 400 unless the extractor is [`optional`](HeaderKey::optional);
/// a header sent twice, or one with a byte outside visible ASCII, space and tab (what
/// [`HeaderValue::to_str`](http::HeaderValue::to_str) reads), is a 400. Spaces inside
/// a value are part of the key (`a b` keys `{a b}`; a tab is escaped, `%09`, like any
/// control character): HTTP has already trimmed whitespace from its ends, and a key is
/// an exact string, so two spellings never share a lock by accident.
///
/// Headers are set by the client: see the warning on [`KeyExtractor`].
///
/// ```
/// use http::HeaderName;
/// use tower_lock::layer::HeaderKey;
///
/// const USER: HeaderName = HeaderName::from_static("x-user-id");
/// let keys = HeaderKey::new(USER).namespace("user")?;
/// # let _ = keys;
/// # Ok::<(), tower_lock::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct HeaderKey {
    name: HeaderName,
    namespace: Namespace,
    optional: bool,
}

impl HeaderKey {
    /// Keys by header `name`, with no namespace of its own (the key is `{<value>}`,
    /// prefixed by the layer's [key prefix](crate::layer::LockLayerBuilder::key_prefix)).
    pub fn new(name: HeaderName) -> Self {
        HeaderKey {
            name,
            namespace: Namespace::empty(),
            optional: false,
        }
    }

    /// Puts the value under `namespace` (`<namespace>:{<value>}`).
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSetting`](crate::ConfigError::InvalidSetting) naming `namespace` when it breaks the
    /// [`Namespace`] rule: braces or control characters, a `:` at either end (the
    /// joining `:` is added) or two in a row, or longer than
    /// [`MAX_NAMESPACE_LEN`](crate::MAX_NAMESPACE_LEN) bytes.
    pub fn namespace(
        mut self,
        namespace: impl Into<Cow<'static, str>>,
    ) -> Result<Self, ConfigError> {
        self.namespace = Namespace::new(namespace)?;
        Ok(self)
    }

    /// A request without the header passes through unlocked instead of being rejected.
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }

    fn keys(&self, parts: &Parts) -> Result<Keys, KeyError> {
        let mut values = parts.headers.get_all(&self.name).iter();
        let Some(value) = values.next() else {
            return if self.optional {
                Ok(Keys::none())
            } else {
                Err(KeyError::new(format!("missing header `{}`", self.name)))
            };
        };
        if values.next().is_some() {
            return Err(KeyError::new(format!(
                "header `{}` given more than once",
                self.name
            )));
        }
        let value = value.to_str().map_err(|_| {
            KeyError::new(format!(
                "header `{}` is not visible ASCII (spaces and tabs aside)",
                self.name
            ))
        })?;
        let what = format!("header `{}`", self.name);
        Ok(Keys::from(namespaced(&self.namespace, &what, value)?))
    }
}

impl KeyExtractor for HeaderKey {
    type Future = Ready<Extracted>;

    fn extract(&self, parts: Parts) -> Self::Future {
        let keys = self.keys(&parts);
        ready((parts, keys))
    }
}

#[cfg(test)]
mod tests {
    use http::StatusCode;

    use super::*;
    use crate::layer::keys::head;

    fn keys_of(k: &impl Fn(&Parts) -> Result<Keys, KeyError>, parts: &Parts) -> Vec<String> {
        k(parts)
            .unwrap()
            .into_iter()
            .map(|k| k.as_str().to_owned())
            .collect()
    }

    const USER: HeaderName = HeaderName::from_static("x-user-id");

    #[test]
    fn header_key_escapes_and_rejects() {
        let keys = HeaderKey::new(USER).namespace("user").unwrap();
        let got = |p: &Parts| keys.keys(p);
        assert_eq!(keys_of(&got, &head(&[("x-user-id", "42")])), ["user:{42}"]);
        assert_eq!(
            keys_of(&got, &head(&[("x-user-id", "a}:x{b")])),
            ["user:{a%7D:x%7Bb}"]
        );

        let missing = keys.keys(&head(&[])).unwrap_err();
        assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
        assert!(missing.message().contains("missing header `x-user-id`"));
        let twice = keys
            .keys(&head(&[("x-user-id", "1"), ("x-user-id", "2")]))
            .unwrap_err();
        assert!(twice.message().contains("more than once"), "{twice}");
        let empty = keys.keys(&head(&[("x-user-id", "")])).unwrap_err();
        assert!(empty.message().contains("empty"), "{empty}");
        let mut long = head(&[]);
        long.headers.insert(USER, "x".repeat(2000).parse().unwrap());
        let long = keys.keys(&long).unwrap_err();
        assert!(long.message().contains("limit"), "{long}");

        assert!(keys.clone().optional().keys(&head(&[])).unwrap().is_empty());

        // Inner spaces are part of the key and a tab is escaped, as documented; other
        // bytes are not visible ASCII.
        assert_eq!(
            keys_of(&got, &head(&[("x-user-id", "a b\tc")])),
            ["user:{a b%09c}"]
        );
        let mut binary = head(&[]);
        binary
            .headers
            .insert(USER, http::HeaderValue::from_bytes(b"a\xffb").unwrap());
        let binary = keys.keys(&binary).unwrap_err();
        assert_eq!(binary.status(), StatusCode::BAD_REQUEST);
        assert!(binary.message().contains("not visible ASCII"), "{binary}");
    }

    #[tokio::test]
    async fn extract_hands_the_head_back() {
        let keys = HeaderKey::new(USER).namespace("user").unwrap();
        let (parts, got) = keys.extract(head(&[("x-user-id", "9")])).await;
        assert_eq!(got.unwrap().as_slice()[0].as_str(), "user:{9}");
        assert_eq!(parts.headers[USER], "9");
    }
}
