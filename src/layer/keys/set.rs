//! [`Keys`], the key set a request locks, and [`IntoKeys`], what a key function may
//! return.

use super::KeyError;
use crate::key::LockKey;

/// A request's lock keys: none (the request is not locked), one, or several. One key,
/// the common case, needs no allocation.
///
/// ```
/// use tower_lock::LockKey;
/// use tower_lock::layer::Keys;
///
/// let one = Keys::from(LockKey::new("order:{42}")?);
/// assert_eq!(one.len(), 1);
/// let two: Keys = vec![LockKey::new("a")?, LockKey::new("b")?].into();
/// assert_eq!(two.as_slice().len(), 2);
/// assert!(Keys::none().is_empty());
/// # Ok::<(), tower_lock::Error>(())
/// ```
#[derive(Clone, Default)]
pub struct Keys {
    repr: KeysRepr,
}

#[derive(Clone, Default)]
enum KeysRepr {
    #[default]
    None,
    One(LockKey),
    Many(Vec<LockKey>),
}

impl Keys {
    /// No keys: the request passes through unlocked.
    pub fn none() -> Self {
        Keys::default()
    }

    /// The keys, in the order given.
    pub fn as_slice(&self) -> &[LockKey] {
        match &self.repr {
            KeysRepr::None => &[],
            KeysRepr::One(key) => std::slice::from_ref(key),
            KeysRepr::Many(keys) => keys,
        }
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// No keys: the request is not locked.
    pub fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// The keys, as a vector.
    pub fn into_vec(self) -> Vec<LockKey> {
        match self.repr {
            KeysRepr::None => Vec::new(),
            KeysRepr::One(key) => vec![key],
            KeysRepr::Many(keys) => keys,
        }
    }

    /// The single key, if there is exactly one; else the keys back.
    pub(crate) fn into_one(self) -> Result<LockKey, Keys> {
        match self.repr {
            KeysRepr::One(key) => Ok(key),
            KeysRepr::Many(mut keys) if keys.len() == 1 => keys.pop().ok_or_else(Keys::none),
            repr => Err(Keys { repr }),
        }
    }

    /// Each key through `f`, which may fail.
    pub(crate) fn try_map<E>(
        self,
        mut f: impl FnMut(LockKey) -> Result<LockKey, E>,
    ) -> Result<Keys, E> {
        Ok(Keys {
            repr: match self.repr {
                KeysRepr::None => KeysRepr::None,
                KeysRepr::One(key) => KeysRepr::One(f(key)?),
                KeysRepr::Many(keys) => {
                    KeysRepr::Many(keys.into_iter().map(f).collect::<Result<_, E>>()?)
                }
            },
        })
    }
}

/// Equal when they list the same keys in the same order.
impl PartialEq for Keys {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Keys {}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl From<LockKey> for Keys {
    fn from(key: LockKey) -> Self {
        Keys {
            repr: KeysRepr::One(key),
        }
    }
}

impl From<Vec<LockKey>> for Keys {
    fn from(keys: Vec<LockKey>) -> Self {
        Keys {
            repr: if keys.is_empty() {
                KeysRepr::None
            } else {
                KeysRepr::Many(keys)
            },
        }
    }
}

impl FromIterator<LockKey> for Keys {
    fn from_iter<I: IntoIterator<Item = LockKey>>(iter: I) -> Self {
        Keys::from(iter.into_iter().collect::<Vec<_>>())
    }
}

impl IntoIterator for Keys {
    type Item = LockKey;
    type IntoIter = std::vec::IntoIter<LockKey>;

    fn into_iter(self) -> Self::IntoIter {
        self.into_vec().into_iter()
    }
}

/// What a key function may return: the key(s) to lock, nothing (the request passes
/// through unlocked), or an error (the request is rejected).
///
/// | returned | meaning |
/// |---|---|
/// | [`LockKey`], `[LockKey; N]`, `Vec<LockKey>` | lock these (several: all or none, in sorted order) |
/// | `String` | validated with [`LockKey::new`]; invalid text is a 400 |
/// | `None`, an empty `Vec` | no lock for this request |
/// | `Err(e)` | rejected: `e` becomes a [`KeyError`] (400 by default) |
pub trait IntoKeys {
    /// The keys; empty for "no lock".
    ///
    /// # Errors
    ///
    /// A [`KeyError`] when the request cannot be keyed.
    fn into_keys(self) -> Result<Keys, KeyError>;
}

impl IntoKeys for Keys {
    fn into_keys(self) -> Result<Keys, KeyError> {
        Ok(self)
    }
}

impl IntoKeys for LockKey {
    fn into_keys(self) -> Result<Keys, KeyError> {
        Ok(Keys::from(self))
    }
}

impl IntoKeys for Vec<LockKey> {
    fn into_keys(self) -> Result<Keys, KeyError> {
        Ok(Keys::from(self))
    }
}

impl<const N: usize> IntoKeys for [LockKey; N] {
    fn into_keys(self) -> Result<Keys, KeyError> {
        Ok(self.into_iter().collect())
    }
}

impl IntoKeys for String {
    fn into_keys(self) -> Result<Keys, KeyError> {
        Ok(Keys::from(LockKey::new(self)?))
    }
}

impl<T: IntoKeys> IntoKeys for Option<T> {
    fn into_keys(self) -> Result<Keys, KeyError> {
        self.map_or_else(|| Ok(Keys::none()), IntoKeys::into_keys)
    }
}

impl<T: IntoKeys, E: Into<KeyError>> IntoKeys for Result<T, E> {
    fn into_keys(self) -> Result<Keys, KeyError> {
        self.map_err(Into::into)?.into_keys()
    }
}

#[cfg(test)]
mod tests {
    use http::StatusCode;
    use http::request::Parts;

    use super::*;
    use crate::error::Error;
    use crate::layer::keys::{head, key_fn};

    #[test]
    fn closures_return_anything_into_keys() {
        fn k(s: &str) -> LockKey {
            LockKey::new(s).unwrap()
        }
        fn run(f: impl Fn(&Parts) -> Result<Keys, KeyError>) -> Result<Keys, KeyError> {
            f(&head(&[]))
        }
        assert_eq!(
            run(|p| key_fn(|_| k("a"))(p).into_keys()).unwrap(),
            Keys::from(vec![k("a")])
        );
        assert!(
            run(|p| key_fn(|_| None::<LockKey>)(p).into_keys())
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            run(|p| key_fn(|_| [k("b"), k("a")])(p).into_keys())
                .unwrap()
                .len(),
            2
        );
        let text = run(|p| key_fn(|_| String::from("a{b"))(p).into_keys()).unwrap_err();
        assert_eq!(text.status(), StatusCode::BAD_REQUEST);
        let fails = run(|p| key_fn(|_| Err::<LockKey, _>("no user"))(p).into_keys()).unwrap_err();
        assert_eq!(fails.message(), "no user");
        // Any other error than an invalid key is the server's, and not shown.
        let internal = KeyError::from(Error::Lost);
        assert!(internal.is_server_error());
    }
}
