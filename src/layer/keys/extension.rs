//! [`ExtensionKey`]: keys a request by a value earlier middleware put in its extensions
//! (an authenticated identity).

use std::any::type_name;
use std::borrow::Cow;
use std::fmt;
use std::future::{Ready, ready};
use std::marker::PhantomData;

use http::request::Parts;

use super::{Extracted, KeyError, KeyExtractor, Keys, namespaced};
use crate::error::ConfigError;
use crate::namespace::Namespace;

/// Keys a request by a value that earlier middleware put in the request extensions —
/// typically the authenticated user's id: `<namespace>:{<f(value)>}`.
///
/// This is an extractor for identities: the value comes from your authentication, not
/// from the client. Authentication must run before `LockLayer` (be added to the router
/// *after* it, as layers wrap what was added before them). With an authentication
/// *extractor* instead of a middleware, use [`key_from`](super::key_from).
///
/// A missing extension is a 500 (the middleware that sets it is not in front of the
/// layer) unless the extractor is [`optional`](ExtensionKey::optional), in which case
/// the request passes through unlocked.
///
/// ```
/// use tower_lock::layer::ExtensionKey;
///
/// #[derive(Clone)]
/// struct UserId(u64);
///
/// let keys = ExtensionKey::new(|user: &UserId| user.0.to_string()).namespace("user")?;
/// # let _ = keys;
/// # Ok::<(), tower_lock::Error>(())
/// ```
pub struct ExtensionKey<T, F> {
    f: F,
    namespace: Namespace,
    optional: bool,
    _value: PhantomData<fn(&T)>,
}

impl<T, F, V> ExtensionKey<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> V + Send + Sync + 'static,
    V: AsRef<str>,
{
    /// Keys by `f(extension)`, where the extension of type `T` was inserted by earlier
    /// middleware.
    pub fn new(f: F) -> Self {
        ExtensionKey {
            f,
            namespace: Namespace::empty(),
            optional: false,
            _value: PhantomData,
        }
    }

    /// Puts the value under `namespace` (`<namespace>:{<value>}`).
    ///
    /// # Errors
    ///
    /// As [`HeaderKey::namespace`](super::HeaderKey::namespace).
    pub fn namespace(
        mut self,
        namespace: impl Into<Cow<'static, str>>,
    ) -> Result<Self, ConfigError> {
        self.namespace = Namespace::new(namespace)?;
        Ok(self)
    }

    /// A request without the extension passes through unlocked instead of being
    /// rejected.
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }

    fn keys(&self, parts: &Parts) -> Result<Keys, KeyError> {
        let Some(value) = parts.extensions.get::<T>() else {
            return if self.optional {
                Ok(Keys::none())
            } else {
                Err(KeyError::server(format!(
                    "request extension `{}` is missing; is the middleware that sets it in front of `LockLayer`?",
                    type_name::<T>()
                )))
            };
        };
        let value = (self.f)(value);
        Ok(Keys::from(namespaced(
            &self.namespace,
            &"request extension",
            value.as_ref(),
        )?))
    }
}

impl<T, F: Clone> Clone for ExtensionKey<T, F> {
    fn clone(&self) -> Self {
        ExtensionKey {
            f: self.f.clone(),
            namespace: self.namespace.clone(),
            optional: self.optional,
            _value: PhantomData,
        }
    }
}

impl<T, F> fmt::Debug for ExtensionKey<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtensionKey")
            .field("type", &type_name::<T>())
            .field("namespace", &self.namespace)
            .field("optional", &self.optional)
            .finish()
    }
}

impl<T, F, V> KeyExtractor for ExtensionKey<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> V + Send + Sync + 'static,
    V: AsRef<str>,
{
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

    #[derive(Clone)]
    struct UserId(u64);

    #[test]
    fn extension_key() {
        let keys = ExtensionKey::new(|u: &UserId| u.0.to_string())
            .namespace("u")
            .unwrap();
        let mut p = head(&[]);
        let missing = keys.keys(&p).unwrap_err();
        assert_eq!(missing.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(missing.is_server_error());
        assert!(missing.message().contains("UserId"), "{missing}");
        p.extensions.insert(UserId(7));
        assert_eq!(keys.keys(&p).unwrap().as_slice()[0].as_str(), "u:{7}");
        assert!(keys.optional().keys(&head(&[])).unwrap().is_empty());
    }
}
